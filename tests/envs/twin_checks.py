"""Checks the tests of the RAGEN-2 games (2048, Sudoku, the 2x2 cube) share: every check runs on both backends, the
C++ batch env and its pure-Python twin."""

import pytest

import fastpo.envs as envs

BACKENDS = ["cpp", "python"]


def assert_bad_config_is_one_line(env_name: str, config: dict, message: str) -> None:
    """Building ``env_name`` with ``config`` raises ValueError matching ``message`` on both backends."""
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=message):
            envs.make(env_name, 1, backend=backend, **config)
