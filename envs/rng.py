"""Counter-based random numbers shared by every fastpo env (C++ ``csrc/rng.h`` is its exact twin).

Draw ``k`` of a stream is a pure function of ``(seed, stream, attempt, k)``, so a level, a slip or a
bandit pull depends only on the seed: never on batch size, position in the batch or thread count.

    key    = mix64(mix64(seed) ^ mix64((stream << 32) | attempt))      (all arithmetic mod 2**64)
    u64_k  = mix64(key ^ mix64(k))                                     k = 1, 2, 3, ...
    uniform = (u64 >> 11) * 2**-53                                     in [0, 1)
    randint(n) = u64 % n                                               in [0, n)

``mix64`` is the splitmix64 finaliser. ``attempt`` numbers the retries of a failed generation (RAGEN
re-seeds with Python's salted ``hash()``, which differs between processes; this does not).
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1

# Stream ids: one per independent use of randomness. Keep in sync with csrc/rng.h.
STREAM_SOKOBAN_GEN = 1
STREAM_FROZENLAKE_GEN = 2
STREAM_FROZENLAKE_SLIP = 3
STREAM_BANDIT = 4
STREAM_COUNTDOWN = 5
STREAM_QA = 6
STREAM_GAME2048 = 7
STREAM_SUDOKU = 8
STREAM_RUBIKS = 9


def mix64(z: int) -> int:
    """splitmix64 finaliser of ``z`` (taken mod 2**64)."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


class CounterRng:
    """Stream ``stream`` of seed ``seed`` (any Python int; negative seeds wrap mod 2**64)."""

    __slots__ = ("key", "counter")

    def __init__(self, seed: int, stream: int, attempt: int = 0, counter: int = 0):
        self.key = mix64(mix64(int(seed) & MASK64) ^ mix64(((stream << 32) | attempt) & MASK64))
        self.counter = counter

    def next_u64(self) -> int:
        self.counter += 1
        return mix64(self.key ^ mix64(self.counter))

    def uniform(self) -> float:
        """Float in [0, 1) with 53 random bits."""
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))

    def randint(self, n: int) -> int:
        """Integer in [0, n); ``n`` >= 1."""
        if n < 1:
            raise ValueError(f"randint needs n >= 1, got {n}")
        return self.next_u64() % n
