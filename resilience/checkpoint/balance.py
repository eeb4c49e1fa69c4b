"""The one load balancer: split sized items over ranks so that every rank computes the same split."""

from __future__ import annotations


def balance(sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """The rank (``0 .. ranks-1``) of each item: largest first, each to the least loaded rank
    (ties: the lowest rank; equal sizes go in ``sizes``' order). Deterministic, so every rank
    that calls it with the same ``sizes`` gets the same answer without a collective."""
    load = [0] * ranks
    owner = {}
    keys = list(sizes)
    for i in sorted(range(len(keys)), key=lambda i: (-sizes[keys[i]], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[keys[i]] = rank
        load[rank] += sizes[keys[i]]
    return owner
