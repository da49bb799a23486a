"""Question answering from a user's file (RAGEN's ``MetaMathQAEnv``), the first user of the text protocol.

    env = fastpo.envs.make("qa", num_envs=8, data_path="qa.jsonl", max_attempts=3)
    obs = env.reset(np.arange(8))                      # the questions
    obs, reward, terminated, truncated, info = env.step(["42"] * 8)

Data: ``data_path``, JSONL (or one JSON array) of objects. ``file_format="plain"`` reads
``question_key`` / ``answer_key`` (default "question" / "answer"; the answer may be a string or a
number); ``"metamathqa"`` reads MetaMathQA's ``{"query", "response"}`` with the answer after
"The answer is: " (RAGEN's regex); ``"auto"`` (default) picks plain when the first record has the
plain keys, else metamathqa when it has "query" and "response". Nothing is downloaded.

Episode: ``reset`` shows item ``CounterRng(seed, STREAM_QA).randint(len(items))``. Each ``step`` is one
attempt: the answer is compared with the label after lowercasing and removing all whitespace
(RAGEN's normalisation). Correct: reward ``1 / 2**attempt`` (attempt counted from 0), "Correct!",
``terminated``. Wrong: reward 0, "Incorrect. Please think again."; the attempt that uses up
``max_attempts`` reports ``truncated``. Default ``max_attempts = 1``: RAGEN runs MetaMathQA with
``max_actions_per_traj: 1`` (one answer per episode). Flags: ``success`` = correct,
``action_is_valid`` = the normalised answer is not empty, ``action_is_effective`` = correct.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .base import build_config
from .rng import STREAM_QA, CounterRng
from .text import TextBatchEnv, TextEnv, load_records

# RAGEN's config/envs.yaml ``env_instruction`` for MetamathQA.
INSTRUCTION = "You are solving Math problems. "

FILE_FORMATS = ("auto", "plain", "metamathqa")

_METAMATHQA_ANSWER = re.compile(r"The answer is: (.*?)$", re.DOTALL)  # RAGEN's _extract_answer


@dataclass
class QAConfig:
    data_path: str | None = None
    """JSONL file (or JSON array) of question/answer records; required."""
    file_format: str = "auto"
    """``"plain"`` (question_key / answer_key), ``"metamathqa"`` (query / response) or ``"auto"``."""
    question_key: str = "question"
    """Field holding the question in the plain format."""
    answer_key: str = "answer"
    """Field holding the answer in the plain format."""
    max_attempts: int = 1
    """Answers allowed per episode; the last wrong one reports ``truncated`` (RAGEN: 1)."""
    instruction: str = INSTRUCTION
    """Task description for the first user message (RAGEN's MetamathQA ``env_instruction``)."""

    def __post_init__(self) -> None:
        if self.data_path is None:
            raise ValueError("env 'qa' needs data_path= a JSONL file of question/answer records")
        if self.file_format not in FILE_FORMATS:
            raise ValueError(f"file_format must be one of {FILE_FORMATS}, got {self.file_format!r}")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1, got {self.max_attempts!r}")
        if not isinstance(self.instruction, str):
            raise ValueError(f"instruction must be a str, got {type(self.instruction).__name__}")


def normalize_answer(text: str) -> str:
    """RAGEN's comparison key: lowercase, all whitespace removed."""
    return re.sub(r"\s+", "", text.strip().lower())


def load_items(cfg: QAConfig) -> list[tuple[str, str]]:
    """``(question, answer)`` pairs of ``cfg.data_path``; ValueError naming the path and line on bad data."""
    records = load_records(cfg.data_path)
    fmt = cfg.file_format
    if fmt == "auto":
        first_where, first = records[0]
        if cfg.question_key in first and cfg.answer_key in first:
            fmt = "plain"
        elif "query" in first and "response" in first:
            fmt = "metamathqa"
        else:
            raise ValueError(
                f"{first_where}: cannot tell the file format from keys {sorted(first)}: expected "
                f"{cfg.question_key!r}/{cfg.answer_key!r} or MetaMathQA's 'query'/'response'"
            )
    q_key, a_key = (cfg.question_key, cfg.answer_key) if fmt == "plain" else ("query", "response")
    items = []
    for where, rec in records:
        missing = [k for k in (q_key, a_key) if k not in rec]
        if missing:
            raise ValueError(f"{where}: missing key(s) {missing} ({fmt} format)")
        question, answer = rec[q_key], rec[a_key]
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{where}: {q_key!r} must be a non-empty str, got {question!r:.100}")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: {a_key!r} must be a str or a number, got {answer!r:.100}")
        answer = str(answer)
        if fmt == "metamathqa":
            match = _METAMATHQA_ANSWER.search(answer)
            if match is None:
                raise ValueError(f"{where}: 'response' has no 'The answer is: ...'")
            answer = match.group(1).strip()
        if not normalize_answer(answer):
            raise ValueError(f"{where}: the answer is empty")
        items.append((question, answer))
    return items


class QAInstance(TextEnv):
    """One QA episode (a ``TextEnv``)."""

    max_actions_per_turn = 1

    def __init__(self, items: list[tuple[str, str]], instruction: str = INSTRUCTION):
        self.items = items
        self.instruction = instruction
        self.index, self.answer, self.attempt = -1, "", 0

    def reset(self, seed: int) -> str:
        self.index = CounterRng(seed, STREAM_QA).randint(len(self.items))
        question, answer = self.items[self.index]
        self.answer, self.attempt = normalize_answer(answer), 0
        return question

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        given = normalize_answer(action_text)
        correct = given == self.answer
        reward = 1.0 / 2**self.attempt if correct else 0.0
        self.attempt += 1
        obs = "Correct!" if correct else "Incorrect. Please think again."
        info = {"success": correct, "action_is_valid": given != "", "action_is_effective": correct}
        return obs, reward, correct, info


class QAEnv(TextBatchEnv):
    """``num_envs`` QA episodes over one data file; config: the fields of ``QAConfig``."""

    def __init__(self, num_envs: int, **config: Any):
        cfg = build_config(QAConfig, "qa", config)
        items = load_items(cfg)
        self.config = cfg
        super().__init__(num_envs, lambda: QAInstance(items, cfg.instruction), max_steps=cfg.max_attempts, name="qa")

    def answers(self) -> list[str]:
        """The normalised label of each instance's current question (for tests and SFT data)."""
        return [env.answer for env in self.envs]
