"""``resilience.torch_private.local_shape_and_offset`` memoized: per mesh coordinate (a mesh equal
to an earlier one on another rank of the same process gets its own block), and never under
torch's ``LocalTensorMode``. torch's fake process group: one process, no peers, no port."""

import pytest
import torch

from resilience.torch_private import local_shape_and_offset


def _fake_world(rank: int, world_size: int):
    """torch's fake process group (no peers, no port) as ``rank`` of ``world_size``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def test_local_shape_and_offset_is_memoized_per_mesh_coordinate():
    # Memoized by shape, mesh, placements and coordinate: a mesh equal to an earlier one (same
    # rank map, so the same hash) on another rank of the same process must get its own block.
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    from resilience.torch_private import _cached_local_block

    if dist.is_initialized():
        pytest.skip("needs its own (fake) process group")
    blocks = []
    for rank in (1, 2):
        _fake_world(rank, 4)
        try:
            mesh = init_device_mesh("cpu", (4,))
            t = DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], run_check=False, shape=torch.Size([8, 3]), stride=(3, 1))
            hits = _cached_local_block.cache_info().hits
            blocks.append(local_shape_and_offset(t))
            assert local_shape_and_offset(t) == blocks[-1]
            assert _cached_local_block.cache_info().hits == hits + 1  # the second call is the memo's
        finally:
            dist.destroy_process_group()
    assert blocks == [((2, 3), (2, 0)), ((2, 3), (4, 0))]


def test_local_shape_and_offset_is_not_memoized_under_local_tensor_mode():
    # One process playing every rank: the offsets differ per simulated rank, nothing is memoized.
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from resilience.torch_private import _cached_local_block

    local_tensor = pytest.importorskip("torch.distributed._local_tensor")
    if dist.is_initialized():
        pytest.skip("needs its own (fake) process group")
    _fake_world(0, 4)
    try:
        with local_tensor.LocalTensorMode(4):
            mesh = init_device_mesh("cpu", (4,))
            t = distribute_tensor(torch.arange(24.0).reshape(8, 3), mesh, [Shard(0)])
            before = _cached_local_block.cache_info()
            shape, offsets = local_shape_and_offset(t)
            assert _cached_local_block.cache_info() == before
    finally:
        dist.destroy_process_group()
    assert shape == (2, 3) and {rank: offsets[0].node._local_ints[rank] for rank in range(4)} == {0: 0, 1: 2, 2: 4, 3: 6}
