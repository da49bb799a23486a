"""How the built-in engine splits one admission's prefill rows into forwards.

A prefill forward is left-padded: every row computes as many query positions as the row with the most new tokens,
and every query attends over as many columns as the longest context in the forward. Rows that arrive together are
often very unequal: a new episode's first prompt (the system prompt and instructions, hundreds of tokens) next to
the next turn of a running one (an observation, about a hundred), or a continued turn that needs a single token.
Padded together, the short rows compute the long row's positions: on the long-tail bench with partial rollouts
18-24% of the prefilled positions were padding (``bench_async.py --no-split-prefill``, ``prefill_padding_share``).
Splitting costs a forward's fixed part instead (reading every weight once, the per-layer launches). ``split_rows``
picks the split with the least estimated cost.

Cost model, in token-columns (one query position attending over one context column): a forward over rows R with new
tokens P (the most of any row) and context W (the longest row's columns after it) costs
``len(R) * P * (W + TOKEN_COLUMNS) + FORWARD_COLUMNS``. On the bench model (52M Qwen2, bf16, 2-core Xeon) a new
token cost about as much in its matmuls as attending over ~1,000 columns, and a forward's fixed part about as much as
75 new tokens at a 1,000-column context. The split only needs these ratios roughly right: the padding it removes is
usually far larger than either.
"""

from __future__ import annotations

from collections.abc import Sequence

#: A new token's own compute (its matmuls), in context columns its attention would read.
TOKEN_COLUMNS = 1024
#: A forward's fixed cost in token-columns (~75 new tokens at a 1,000-column context).
FORWARD_COLUMNS = 150_000


def forward_cost(sizes: Sequence[int], ends: Sequence[int]) -> int:
    """The modelled cost of one left-padded forward over rows with `sizes` new tokens whose contexts end at `ends`
    columns (their cached tokens plus the new ones)."""
    return len(sizes) * max(sizes) * (max(ends) + TOKEN_COLUMNS) + FORWARD_COLUMNS


def split_rows(sizes: Sequence[int], ends: Sequence[int]) -> list[list[int]]:
    """Split rows into forwards: returns groups of row indices (each group one forward; every row in exactly one).

    Args:
        sizes: new tokens of each row (>= 1).
        ends: columns of each row's context after the new tokens (its cached length + its size).

    Rows are ordered by size (then end) and cut into contiguous runs by dynamic programming on ``forward_cost``:
    the cheapest split of that order (exact for the order; n is at most the engine's slots, so O(n^2) is nothing).
    Rows of equal size stay together unless their contexts differ enough to pay for a forward.
    """
    if len(sizes) != len(ends):
        raise ValueError(f"sizes and ends differ in length: {len(sizes)} vs {len(ends)}")
    if not sizes:
        return []
    # no split can save more than every row's padding; when that is under one forward, one forward is optimal (rows
    # of equal size and context, as a lock-step turn's often are, cost O(n) instead of the O(n^2) search: 12 ms
    # for 256 rows in Python)
    widest, longest = max(sizes), max(ends)
    padding = sum(widest * (longest + TOKEN_COLUMNS) - s * (e + TOKEN_COLUMNS)
                  for s, e in zip(sizes, ends, strict=True))
    if padding <= FORWARD_COLUMNS:
        return [list(range(len(sizes)))]
    order = sorted(range(len(sizes)), key=lambda i: (sizes[i], ends[i]))
    n = len(order)
    best = [0] + [None] * n  # best[i]: cost of the first i rows of `order`
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        size = end = 0
        for j in range(i, 0, -1):  # the last group is order[j - 1 : i]; its maxima grow as j falls
            size, end = max(size, sizes[order[j - 1]]), max(end, ends[order[j - 1]])
            cost = best[j - 1] + (i - j + 1) * size * (end + TOKEN_COLUMNS) + FORWARD_COLUMNS
            if best[i] is None or cost < best[i]:
                best[i], cut[i] = cost, j - 1
    groups = []
    i = n
    while i > 0:
        groups.append(order[cut[i]:i])
        i = cut[i]
    return groups[::-1]
