"""The one load balancer: split sized items over ranks so that every rank computes the same split."""

from __future__ import annotations

import heapq


def balance(sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """The rank (``0 .. ranks-1``) of each item: largest first, each to the least loaded rank
    (ties: the lowest rank; equal sizes go in ``sizes``' order). Deterministic, so every rank
    that calls it with the same ``sizes`` gets the same answer without a collective.

    O(items log items + items log ranks): the least loaded rank comes from a heap of
    ``(load, rank)``, which orders exactly as the scan ``min(range(ranks), key=(load, rank))``
    did, so the split is unchanged (a scan cost O(items x ranks): 24,874 files x 8,192 ranks
    took 28 s per rank at the resume, bench/README.md).

    Raises:
        ValueError: ``ranks < 1`` while there are items.
    """
    if ranks < 1 and sizes:
        raise ValueError(f"balance: {len(sizes)} items over {ranks} ranks")
    keys = list(sizes)
    owner = {}
    heap = [(0, r) for r in range(min(ranks, len(keys)))]  # ranks past the item count never get one
    for i in sorted(range(len(keys)), key=lambda i: (-sizes[keys[i]], i)):
        load, rank = heapq.heappop(heap)
        owner[keys[i]] = rank
        heapq.heappush(heap, (load + sizes[keys[i]], rank))
    return owner


def stream_range(total: int, rank: int, ranks: int) -> tuple[int, int]:
    """Rank ``rank``'s byte range ``[start, stop)`` of a stream of ``total`` bytes cut into
    ``ranks`` contiguous ranges that differ in length by at most one byte."""
    return total * rank // ranks, total * (rank + 1) // ranks


def stream_owners(sizes: list[tuple[str, int]], ranks: int) -> dict[str, int]:
    """The rank whose :func:`stream_range` holds the first byte of each item of ``sizes`` laid end
    to end in the given order (an empty item: the rank holding the byte after it, the last rank at
    the end). Every rank computes the same without a collective; O(items log ranks)."""
    total = sum(size for _, size in sizes)
    owner, start = {}, 0
    for key, size in sizes:
        # the largest r with stream_range(total, r, ranks)[0] <= start: ceil((start + 1) * ranks / total) - 1
        owner[key] = min(ranks - 1, ((start + 1) * ranks - 1) // total) if total else 0
        start += size
    return owner
