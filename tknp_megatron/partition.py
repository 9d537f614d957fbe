"""Exact min-max partitions of a layer sequence into contiguous blocks, by bytes.

Two searches over ``layer_bytes`` (one int per layer), with the first block also carrying
``first_extra`` bytes (the embedding) and the last ``last_extra`` (final norm and output
layer):

* :func:`balance_contiguous`: N blocks minimising the largest block (one weight copy).
* :func:`balance_pairs`: N (even) blocks minimising the largest pair sum block b +
  block b + N/2 (the dual-active-root copy, where a node stores both).

:mod:`tknp_megatron.placement` turns their blocks into a :class:`~tknp_megatron.placement.Placement`.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

__all__ = ["Block", "balance_contiguous", "balance_pairs", "block_sums", "check_blocks"]

Block = Tuple[int, int]
_NEG = np.iinfo(np.int64).min // 4  # "unreachable" in the dual-copy search


def check_blocks(num_items: int, num_blocks: int) -> None:
    """Raise ``ValueError`` unless ``num_items`` layers can form ``num_blocks`` non-empty blocks."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if num_blocks > num_items:
        raise ValueError(f"cannot cut {num_items} layers into {num_blocks} non-empty blocks")


def _prefix(values: Sequence[int]) -> List[int]:
    out = [0]
    for v in values:
        if v < 0:
            raise ValueError(f"layer bytes must be non-negative, got {v}")
        out.append(out[-1] + int(v))
    return out


def _blocks_from_cuts(cuts: Sequence[int]) -> Tuple[Block, ...]:
    return tuple((int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:]))


def _prefix_block_sums(prefix, blocks, first_extra: int, last_extra: int) -> List[int]:
    sums = [prefix[e] - prefix[s] for s, e in blocks]
    sums[0] += first_extra
    sums[-1] += last_extra
    return sums


def block_sums(
    layer_bytes: Sequence[int], blocks: Sequence[Block], first_extra: int = 0, last_extra: int = 0
) -> List[int]:
    """Bytes of each block: its layers' bytes, plus ``first_extra`` on block 0 and
    ``last_extra`` on the last block."""
    return _prefix_block_sums(_prefix(layer_bytes), blocks, first_extra, last_extra)


def balance_contiguous(
    layer_bytes: Sequence[int], num_blocks: int, first_extra: int = 0, last_extra: int = 0
) -> Tuple[Block, ...]:
    """Exact min-max partition of the layers into ``num_blocks`` non-empty contiguous blocks.

    Block 0 also carries ``first_extra`` bytes and the last block ``last_extra``. Dynamic
    programme over (blocks used, layers covered), O(num_blocks * L^2). Returns the blocks as
    ``[start, end)`` pairs in order.
    """
    n = len(layer_bytes)
    check_blocks(n, num_blocks)
    prefix = _prefix(layer_bytes)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_blocks + 1)]
    arg = [[0] * (n + 1) for _ in range(num_blocks + 1)]
    best[0][0] = 0
    for j in range(1, num_blocks + 1):
        for i in range(j, n - (num_blocks - j) + 1):
            tail = last_extra if i == n else 0
            for p in range(j - 1, i):
                cost = prefix[i] - prefix[p] + tail + (first_extra if p == 0 else 0)
                value = max(best[j - 1][p], cost)
                if value < best[j][i]:
                    best[j][i], arg[j][i] = value, p
    cuts = [n]
    for j in range(num_blocks, 0, -1):
        cuts.append(arg[j][cuts[-1]])
    return _blocks_from_cuts(cuts[::-1])


def _pair_max(prefix, blocks, first_extra: int, last_extra: int) -> int:
    sums = _prefix_block_sums(prefix, blocks, first_extra, last_extra)
    half = len(sums) // 2
    return max(sums[b] + sums[b + half] for b in range(half))


def _pairs_at_split(prefix: np.ndarray, half: int, cap: int, m: int, fe: int, le: int):
    """Cuts with block b (in [0, m)) plus block b + half (in [m, L)) <= cap, or None.

    State (i, j): the first half is cut up to layer i, the second up to layer j. A step to
    (i', j') costs P(i') - P(i) + P(j') - P(j), so (i', j') is reachable iff the largest
    P(i) + P(j) over reachable states strictly below-left is >= P(i') + P(j') - budget:
    a 2D running maximum per step.
    """
    s = prefix[: m + 1, None] + prefix[None, m:]
    rows, cols = s.shape
    reach = np.zeros(s.shape, dtype=bool)
    reach[0, 0] = True
    history, budgets = [], []
    for b in range(half):
        budget = cap - (fe if b == 0 else 0) - (le if b == half - 1 else 0)
        best = np.where(reach, s, _NEG)
        best = np.maximum.accumulate(np.maximum.accumulate(best, axis=0), axis=1)
        below = np.full(s.shape, _NEG, dtype=np.int64)
        below[1:, 1:] = best[:-1, :-1]
        history.append(reach)
        budgets.append(budget)
        reach = s - budget <= below
        left = half - 1 - b  # blocks still to place in each half: leave a layer for each
        if left:
            reach[rows - left :, :] = False
            reach[:, cols - left :] = False
        if not reach.any():
            return None
    if not reach[-1, -1]:
        return None
    i, j = rows - 1, cols - 1
    first, second = [i], [j + m]
    for b in range(half - 1, -1, -1):
        ok = history[b][:i, :j] & (s[:i, :j] >= s[i, j] - budgets[b])
        i, j = (int(x) for x in np.argwhere(ok)[0])
        first.append(i)
        second.append(j + m)
    return first[::-1] + second[::-1][1:]


def balance_pairs(
    layer_bytes: Sequence[int], num_blocks: int, first_extra: int, last_extra: int
) -> Tuple[Block, ...]:
    """Exact partition into ``num_blocks`` (even) blocks minimising max(block b + block b+N/2).

    Bisection on the cap with an exact feasibility test per split point m (the first layer
    of block N/2), starting from the single-copy optimum, which is kept on ties.
    """
    n = len(layer_bytes)
    check_blocks(n, num_blocks)
    half = num_blocks // 2
    blocks = balance_contiguous(layer_bytes, num_blocks, first_extra, last_extra)
    prefix_list = _prefix(layer_bytes)
    prefix = np.asarray(prefix_list, dtype=np.int64)
    hi = _pair_max(prefix_list, blocks, first_extra, last_extra)
    lo = -(-(prefix_list[-1] + first_extra + last_extra) // half)
    while lo < hi:
        mid = (lo + hi) // 2
        cuts = None
        for m in range(half, n - half + 1):
            cuts = _pairs_at_split(prefix, half, mid, m, first_extra, last_extra)
            if cuts is not None:
                break
        if cuts is None:
            lo = mid + 1
        else:
            blocks = _blocks_from_cuts(cuts)
            hi = _pair_max(prefix_list, blocks, first_extra, last_extra)
    return blocks
