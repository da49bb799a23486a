"""fastpo.log: the library's messages through logging, the console's streams and level, main rank only unless a
record asks for every rank."""

from __future__ import annotations

import logging

import pytest

from fastpo import log
from fastpo.config import ConfigError
from fastpo.config_load import parse_args


@pytest.fixture
def fastpo_logger():
    logger = logging.getLogger("fastpo")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_console_streams_and_level(capsys, fastpo_logger):
    log.console("info")
    child = logging.getLogger("fastpo.checkpoint")
    child.info("a note")
    child.warning("warning: a problem")
    child.debug("details")
    out, err = capsys.readouterr()
    assert (out, err) == ("a note\n", "warning: a problem\n")  # the message alone, as the prints were
    log.console("warning")
    child.info("a note")
    child.warning("still shown")
    assert capsys.readouterr() == ("", "still shown\n")
    log.console("debug")
    child.debug("details")
    assert capsys.readouterr().out == "details\n"
    assert sum(isinstance(h, log._Console) for h in fastpo_logger.handlers) == 1  # idempotent
    with pytest.raises(ValueError, match=r"log level must be one of \['debug', 'info', 'warning', 'error'\]"):
        log.console("loud")


def test_other_ranks_are_silent_unless_the_record_is_for_every_rank(capsys, monkeypatch, fastpo_logger):
    log.console("info")
    child = logging.getLogger("fastpo.storage")
    monkeypatch.setenv("RANK", "1")
    child.info("rank 0 only")
    child.info("mine", extra=log.ALL_RANKS)
    assert capsys.readouterr().out == "mine\n"
    monkeypatch.setenv("RANK", "0")
    child.info("rank 0 only")
    assert capsys.readouterr().out == "rank 0 only\n"


def test_log_level_is_a_config_field_with_its_choices():
    assert parse_args(["--trainer.log_level", "warning"]).trainer.log_level == "warning"
    with pytest.raises(ConfigError, match="log_level"):
        parse_args(["--trainer.log_level", "loud"])
