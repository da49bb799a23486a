"""Countdown (RAGEN's ``CountdownEnv``): write an equation that uses each given number once and equals
the target.

    env = fastpo.envs.make("countdown", num_envs=2)
    env.reset(np.array([0, 1]))              # ["Target: 52, nums: [70, 78, 44]", ...]
    obs, reward, terminated, truncated, info = env.step(["78 + 44 - 70", "1 + 2"])   # reward [1.0, 0.0]

Instances are generated from the seed and are solvable by construction (``generate_instance``): draw
``k`` uniformly from ``num_counts`` (attempt 0 of the counter RNG), then (attempt 1, 2, ...) ``k``
numbers in [min_num, max_num], combined in random pairs with random operators until one value is
left, every intermediate value a positive integer (``-`` takes the larger minus the smaller of two
different values, ``/`` only divides exactly). That value is the target when it lies in
[min_target, max_target]; otherwise the next attempt draws new numbers. With ``data_path`` the
instances come from a JSONL file of ``{"target": int, "nums": [int, ...]}`` rows instead (RAGEN's
public Countdown-Tasks-3to4 data set, converted from parquet): row ``seed % len(rows)`` as in RAGEN,
after RAGEN's selection (its first ``max_instances`` rows, of which those its +/- check can solve).

Reward (RAGEN's ``compute_reward``): ``score`` (1.0) when the equation uses exactly the given numbers
(as a multiset, each written as a plain integer: "3.0" or "03" is another number) and its value is
within 1e-5 of the target; ``format_score`` (0.1) when it uses exactly the numbers but the value
differs or it divides by zero; 0 otherwise, including anything that is not an arithmetic expression
over numbers, ``+ - * /``, unary signs and parentheses (see ``fastpo.envs.expr``; nothing is ever
passed to ``eval``). One action ends the episode; ``success`` =
full score; ``action_is_effective`` = reward > 0; ``action_is_valid`` is always True, as in RAGEN.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .base import build_config
from .expr import MAX_DEPTH, MAX_LEN, ExprError, evaluate, literals, parse
from .rng import STREAM_COUNTDOWN, CounterRng
from .text import TextBatchEnv, TextEnv, load_records

# RAGEN's config/envs.yaml ``env_instruction`` for Countdown.
INSTRUCTION = (
    "You are solving the Countdown puzzle. You should use the num list to create an equation that equals the "
    "target. Example answer format: <think> To find an equation using [3, 5, 2] to get 4. Let's check 2 + 5 = 7, "
    "7 - 3 = 4. So the answer is 2 + 5 - 3 = 4. </think><answer>2 + 5 - 3</answer>"
)

MAX_ATTEMPTS = 10_000
#: Distinct signed sums ``ragen_has_solution`` tracks at most (bounds its time and memory).
MAX_SIGNED_SUMS = 1 << 20


@dataclass
class CountdownConfig:
    num_counts: tuple[int, ...] = (3, 4)
    """How many numbers an instance has, drawn uniformly from this tuple (each in 2..6)."""
    min_num: int = 1
    """Smallest number (>= 1)."""
    max_num: int = 99
    """Largest number (RAGEN's data set: 1..99)."""
    min_target: int = 1
    """Smallest target (>= 1)."""
    max_target: int = 100
    """Largest target (RAGEN's data set: about 100)."""
    data_path: str | None = None
    """JSONL file of ``{"target", "nums"}`` rows to use instead of generated instances."""
    max_instances: int = 20000
    """With ``data_path``: keep only the first rows (RAGEN's ``max_instances``); 0 keeps all."""
    ragen_filter: bool = True
    """With ``data_path``: keep only rows RAGEN's ``has_solution`` accepts (target = +-n1 +-n2 ...)."""
    score: float = 1.0
    """Reward of a correct equation."""
    format_score: float = 0.1
    """Reward of an equation over exactly the given numbers whose value is wrong."""
    max_len: int = MAX_LEN
    """Longest answer (characters) that is parsed; longer answers score 0."""
    max_depth: int = MAX_DEPTH
    """Deepest nesting (parentheses, unary signs) that is parsed; deeper answers score 0."""

    def __post_init__(self) -> None:
        self.num_counts = tuple(self.num_counts)
        if not self.num_counts or any(_bad_int(k) or not 2 <= k <= 6 for k in self.num_counts):
            raise ValueError(f"num_counts must be a non-empty tuple of ints in [2, 6], got {self.num_counts!r}")
        for lo, hi in (("min_num", "max_num"), ("min_target", "max_target")):
            a, b = getattr(self, lo), getattr(self, hi)
            if _bad_int(a) or _bad_int(b) or not 1 <= a <= b:
                raise ValueError(f"need ints 1 <= {lo} <= {hi}, got {lo}={a!r}, {hi}={b!r}")
        for field in ("max_instances", "max_len", "max_depth"):
            value = getattr(self, field)
            if _bad_int(value) or value < (0 if field == "max_instances" else 1):
                raise ValueError(f"{field} must be a non-negative int (max_len, max_depth >= 1), got {value!r}")
        for field in ("score", "format_score"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{field} must be a finite number, got {value!r}")


def _bad_int(x: Any) -> bool:
    return isinstance(x, bool) or not isinstance(x, int)


def generate_instance(seed: int, cfg: CountdownConfig | None = None) -> tuple[int, list[int], str]:
    """The instance of ``seed``: ``(target, nums, solution)``, ``solution`` an equation over ``nums``
    (each once) whose value is ``target``. Raises RuntimeError if no attempt lands in the target range."""
    cfg = cfg or CountdownConfig()
    k = cfg.num_counts[CounterRng(seed, STREAM_COUNTDOWN).randint(len(cfg.num_counts))]  # fixed per seed
    for attempt in range(1, MAX_ATTEMPTS + 1):
        rng = CounterRng(seed, STREAM_COUNTDOWN, attempt)
        nums = [cfg.min_num + rng.randint(cfg.max_num - cfg.min_num + 1) for _ in range(k)]
        items = [(n, str(n)) for n in nums]  # (value, expression)
        while len(items) > 1:
            a = items.pop(rng.randint(len(items)))
            b = items.pop(rng.randint(len(items)))
            (x, ex), (y, ey) = (a, b) if a[0] >= b[0] else (b, a)  # x >= y
            ops = ["+", "*"] + (["-"] if x != y else []) + (["/"] if x % y == 0 else [])
            op = ops[rng.randint(len(ops))]
            value = {"+": x + y, "*": x * y, "-": x - y, "/": x // y}[op]
            items.append((value, f"({ex} {op} {ey})"))
        target, expression = items[0]
        if cfg.min_target <= target <= cfg.max_target:
            return target, nums, expression[1:-1]
    raise RuntimeError(
        f"countdown seed {seed}: no target in [{cfg.min_target}, {cfg.max_target}] after {MAX_ATTEMPTS} attempts; "
        "widen the target range or narrow the number range"
    )


def ragen_has_solution(nums: list[int], target: int) -> bool:
    """RAGEN's ``has_solution``: some +-n1 +-n2 ... equals the target (it ignores * and /).

    RAGEN tries all 2^n sign patterns; the same answer comes from the set of reachable signed sums, which stays
    at most 2 * sum(|n|) + 1 values (a few hundred for RAGEN's data), so a long row cannot hang the load. Rows
    whose set would pass ``MAX_SIGNED_SUMS`` (many large numbers) raise ValueError instead."""
    sums = {0}
    for n in nums:
        sums = {s + n for s in sums} | {s - n for s in sums}
        if len(sums) > MAX_SIGNED_SUMS:
            raise ValueError(f"countdown row with {len(nums)} numbers {nums!r:.120}: its +/- solvability check "
                             f"exceeds {MAX_SIGNED_SUMS} distinct sums; use fewer or smaller numbers, or "
                             f"ragen_filter=False")
    return target in sums


def score_equation(equation: str, target: int, nums: list[int], cfg: CountdownConfig | None = None) -> float:
    """Countdown reward of ``equation`` for the instance ``(target, nums)``; see the module docstring."""
    cfg = cfg or CountdownConfig()
    try:
        tree = parse(equation, cfg.max_len, cfg.max_depth)
    except ExprError:
        return 0.0
    if Counter(literals(tree)) != Counter(str(n) for n in nums):  # "3.0" or "03" is not the number 3
        return 0.0
    try:
        value = evaluate(tree)
    except ZeroDivisionError:
        return float(cfg.format_score)
    return float(cfg.score) if abs(value - target) < 1e-5 else float(cfg.format_score)


def load_instances(cfg: CountdownConfig) -> list[tuple[int, list[int]]]:
    """``(target, nums)`` rows of ``cfg.data_path`` after RAGEN's selection (see CountdownConfig)."""
    rows = []
    for where, rec in load_records(cfg.data_path):
        target, nums = rec.get("target"), rec.get("nums")
        if _bad_int(target) or not isinstance(nums, list) or not nums or any(_bad_int(n) for n in nums):
            raise ValueError(f"{where}: expected {{'target': int, 'nums': [int, ...]}}, got {rec!r:.200}")
        rows.append((target, nums))
    if cfg.max_instances:
        rows = rows[: cfg.max_instances]
    if cfg.ragen_filter:
        rows = [(t, n) for t, n in rows if ragen_has_solution(n, t)]
    if not rows:
        raise ValueError(f"data file {cfg.data_path!r}: no row is left after RAGEN's selection (ragen_filter=False?)")
    return rows


class CountdownInstance(TextEnv):
    """One Countdown episode (a ``TextEnv``); ``solution`` is a correct equation (None for file rows)."""

    instruction = INSTRUCTION
    max_actions_per_turn = 1

    def __init__(self, cfg: CountdownConfig, rows: list[tuple[int, list[int]]] | None = None):
        self.cfg, self.rows = cfg, rows
        self.target, self.nums, self.solution = 0, [], None

    def reset(self, seed: int) -> str:
        if self.rows is None:
            self.target, self.nums, self.solution = generate_instance(seed, self.cfg)
        else:
            self.target, self.nums = self.rows[seed % len(self.rows)]
            self.solution = None
        return f"Target: {self.target}, nums: {self.nums}"

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        reward = score_equation(action_text, self.target, self.nums, self.cfg)
        info = {"success": reward == self.cfg.score, "action_is_valid": True, "action_is_effective": reward > 0}
        return f"Your answer get {reward:g} points.", reward, True, info  # RAGEN's feedback text


class CountdownEnv(TextBatchEnv):
    """``num_envs`` Countdown instances; config: the fields of ``CountdownConfig``."""

    def __init__(self, num_envs: int, **config: Any):
        cfg = build_config(CountdownConfig, "countdown", config)
        rows = load_instances(cfg) if cfg.data_path is not None else None
        self.config = cfg
        super().__init__(num_envs, lambda: CountdownInstance(cfg, rows), name="countdown")

    def solutions(self) -> list[str | None]:
        """A correct equation per instance (generated instances; None for rows of ``data_path``)."""
        return [env.solution for env in self.envs]
