"""The sharding rule of a tensor (resilience.checkpoint.formats.shard_rule): its pieces, and the
ones overlapping a block, from (global shape, mesh shape, placements) alone, as torch shards."""

from __future__ import annotations

import itertools
import math
import random

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from resilience.checkpoint.formats.pieces import overlap_slices, tiling_problem
from resilience.checkpoint.formats.shard_rule import Rule, balance_replicas


def _torch_block(shape, mesh, dims, rank):
    rule = Rule(mesh, dims)
    placements = [Replicate() if d is None else Shard(d) for d in dims]
    local, offsets = _compute_local_shape_and_global_offset(shape, mesh, list(rule.coordinate(rank)), placements)
    return tuple(offsets), tuple(local)


def _cases(n, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 11) for _ in range(ndim))
        mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        dims = tuple(rng.choice([None, *range(ndim)]) for _ in mesh)
        yield shape, mesh, dims, rng.randrange(math.prod(mesh) * 3)


def test_each_ranks_block_is_torchs_own_for_uneven_shards_and_2d_meshes():
    for shape, mesh, dims, replica in _cases(300):
        rule = Rule(mesh, dims, replica % math.prod(m for m, d in zip(mesh, dims) if d is None))
        for rank in range(math.prod(mesh)):
            assert rule.block(shape, rank) == _torch_block(shape, mesh, dims, rank), (shape, mesh, dims, rank)


def test_the_pieces_tile_the_tensor_are_the_distinct_blocks_and_each_is_written_by_one_holder():
    for shape, mesh, dims, replica in _cases(300, seed=1):
        rule = Rule(mesh, dims, replica % math.prod(m for m, d in zip(mesh, dims) if d is None))
        found = rule.pieces(shape)
        assert tiling_problem(list(shape), [{"offsets": list(o), "shape": list(s)} for _, o, s in found]) is None
        held = {rule.block(shape, r) for r in range(rule.world_size) if math.prod(rule.block(shape, r)[1])}
        assert {(o, s) for _, o, s in found} == held
        for rank, offsets, size in found:
            assert rule.writes(rank) and rule.block(shape, rank) == (offsets, size)
        assert sum(rule.writes(r) and math.prod(rule.block(shape, r)[1]) > 0 for r in range(rule.world_size)) == len(found)


def test_the_pieces_overlapping_a_block_are_exactly_those_that_overlap_it():
    for shape, mesh, dims, _ in _cases(200, seed=2):
        rule = Rule(mesh, dims)
        every = rule.pieces(shape)
        for offsets in itertools.islice(itertools.product(*(range(n) for n in shape)), 6):
            size = tuple(max(1, (n - o) // 2) for n, o in zip(shape, offsets))
            want = [p for p in every if overlap_slices(list(offsets), list(size), list(p[1]), list(p[2])) is not None]
            assert rule.pieces(shape, offsets, size) == want


def test_an_fsdp2_rule_at_8192_ranks_finds_a_ranks_pieces_without_listing_them_all():
    rule = Rule((8192,), (0,))
    assert rule.pieces((32000, 4096), (4000, 0), (8, 4096)) == [(1000, (4000, 0), (4, 4096)), (1001, (4004, 0), (4, 4096))]
    hsdp = Rule((2, 4096), (None, 0), replica=1)
    assert [r for r, _, _ in hsdp.pieces((11008, 4096), (0, 0), (4, 4096))] == [4096, 4097]
    assert Rule.from_json(hsdp.to_json()) == hsdp


def test_the_copies_along_a_replicate_dim_are_written_by_replicas_sharing_the_bytes():
    # HSDP's (Replicate, Shard(0)) on 2 x 2: two large and six small tensors; plain tensors over 4 ranks
    sizes = {"up": 400, "up_b": 40, "down": 400, "down_b": 24, "norm": 24, "norm_b": 24, "head": 72, "head_b": 12}
    rules = balance_replicas({key: Rule((2, 2), (None, 0)) for key in sizes}, sizes)
    per_replica = [sum(n for key, n in sizes.items() if rules[key].replica == r) for r in (0, 1)]
    assert sorted(per_replica) == [496, 500]
    plain = balance_replicas({f"t{i}": Rule((4,), (None,)) for i in range(8)}, {f"t{i}": 10 for i in range(8)})
    assert sorted(rule.replica for rule in plain.values()) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert balance_replicas({"w": None, "s": Rule((4,), (0,))}, {"w": 1, "s": 8}) == {"w": None, "s": Rule((4,), (0,))}


def test_a_replicated_models_plan_is_the_holders_split_without_n_holders_per_tensor():
    # _replicated_plan (balance over whole tensors) must give exactly _assign's plan for N identical
    # holders: empty tensors, dtypes of other sizes and equal sizes (ties) included
    import torch

    from resilience.checkpoint.formats.pieces import _assign, _replicated_plan, block_of

    rng = random.Random(0)
    for _ in range(200):
        dtypes = [torch.float32, torch.bfloat16, torch.int64]
        shape = lambda: tuple(rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(rng.randint(0, 3)))  # noqa: E731
        state = {f"k{i}": torch.zeros(shape(), dtype=rng.choice(dtypes)) for i in range(rng.randint(0, 30))}
        world = rng.choice([1, 2, 3, 4, 7, 64])
        assert _replicated_plan(state, world).tensors == _assign([{k: block_of(t) for k, t in state.items()}] * world, world).tensors


def test_replicas_of_a_world_of_8192_balance_as_a_full_heap_would():
    # the heap holds at most as many replicas as tensors of the kind: the same choice as a heap of all 8,192
    sizes = {f"t{i}": (i * 7919) % 97 + 1 for i in range(300)}
    rules = balance_replicas({key: Rule((8192,), (None,)) for key in sizes}, sizes)
    assert sorted(rule.replica for rule in rules.values()) == list(range(300))
    few = balance_replicas({key: Rule((4,), (None,)) for key in sizes}, sizes)
    loads = [sum(n for key, n in sizes.items() if few[key].replica == r) for r in range(4)]
    assert max(loads) - min(loads) <= max(sizes.values())
