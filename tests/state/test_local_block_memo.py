"""``resilience.torch_private.local_shape_and_offset`` memoized: per mesh coordinate (a mesh equal
to an earlier one on another rank of the same process gets its own block; a second call does not
reach torch), and never under torch's ``LocalTensorMode``. torch's fake process group: one process, no peers, no port."""

import pytest
import torch

from resilience.torch_private import local_shape_and_offset


def _fake_world(rank: int, world_size: int):
    """torch's fake process group (no peers, no port) as ``rank`` of ``world_size``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def test_local_shape_and_offset_is_memoized_per_mesh_coordinate(monkeypatch):
    # Memoized by shape, mesh shape, coordinate and placements: a mesh equal to an earlier one
    # (same rank map) on another rank of the same process must get its own block.
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    from resilience import torch_private

    if dist.is_initialized():
        pytest.skip("needs its own (fake) process group")
    torch_private._LOCAL_BLOCKS.clear()
    blocks, meshes = [], []
    for rank in (1, 2):
        _fake_world(rank, 4)
        try:
            mesh = init_device_mesh("cpu", (4,))
            t = DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], run_check=False, shape=torch.Size([8, 3]), stride=(3, 1))
            blocks.append(local_shape_and_offset(t))
            with monkeypatch.context() as patch:  # the second call must not reach torch
                patch.setattr(torch_private, "_compute_local_block", lambda *a: pytest.fail("not memoized"))
                assert local_shape_and_offset(t) == blocks[-1]
            meshes.append(mesh)
        finally:
            dist.destroy_process_group()
    assert meshes[0] == meshes[1] and blocks == [((2, 3), (2, 0)), ((2, 3), (4, 0))]
    assert len(torch_private._LOCAL_BLOCKS) == 2


def test_local_shape_and_offset_is_not_memoized_under_local_tensor_mode():
    # One process playing every rank: the offsets differ per simulated rank, nothing is memoized.
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from resilience.torch_private import _LOCAL_BLOCKS

    local_tensor = pytest.importorskip("torch.distributed._local_tensor")
    if dist.is_initialized():
        pytest.skip("needs its own (fake) process group")
    _LOCAL_BLOCKS.clear()
    _fake_world(0, 4)
    try:
        with local_tensor.LocalTensorMode(4):
            mesh = init_device_mesh("cpu", (4,))
            t = distribute_tensor(torch.arange(24.0).reshape(8, 3), mesh, [Shard(0)])
            shape, offsets = local_shape_and_offset(t)
            assert _LOCAL_BLOCKS == {}
    finally:
        dist.destroy_process_group()
    assert shape == (2, 3) and {rank: offsets[0].node._local_ints[rank] for rank in range(4)} == {0: 0, 1: 2, 2: 4, 3: 6}


def test_nothing_is_memoized_while_a_fake_tensor_mode_traces():
    # A trace (fake tensors, symbolic coordinates with compile_on_one_rank) must not be answered
    # from, nor fill, the memo.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from resilience.torch_private import _tracing_or_local

    assert not _tracing_or_local()
    with FakeTensorMode():
        assert _tracing_or_local()
