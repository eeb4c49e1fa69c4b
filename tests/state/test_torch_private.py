"""The torch internals behind resilience/torch_private.py, checked against the installed torch: a torch
that moved one fails here rather than silently in a save's plan or a resume's data order."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from resilience.torch_private import TORCH_VERSION, dataloader_sampler_iter, local_shape_and_offset, placement_classes


def test_torch_version_is_the_installed_one():
    assert f"{TORCH_VERSION[0]}.{TORCH_VERSION[1]}." in torch.__version__ + "."


def test_placement_classes_are_dtensors_own(one_rank_group):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    assert placement_classes() == (Replicate, Shard)
    mesh = init_device_mesh("cpu", (1,))
    t = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(1)])
    assert isinstance(t.placements[0], placement_classes()[1])


def test_local_shape_and_offset_is_the_block_to_local_holds(one_rank_group):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    t = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(1)])
    shape, offsets = local_shape_and_offset(t)
    assert shape == tuple(t.to_local().shape) == (3, 4) and offsets == (0, 0)
    assert all(isinstance(n, int) for n in shape + offsets)


def test_dataloader_sampler_iter_draws_the_epochs_index_lists_without_loading_data():
    data = TensorDataset(torch.arange(10.0))
    loader = DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(0))
    expected = [batch[0].long().tolist() for batch in DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(0))]
    indices = dataloader_sampler_iter(iter(loader))
    assert indices is not None
    assert [list(batch) for batch in indices] == expected  # the same order, from the same generator draw
    assert dataloader_sampler_iter(iter([1, 2])) is None
    assert dataloader_sampler_iter(x for x in range(3)) is None


def test_dataloader_sampler_iter_leaves_torchdatas_loader_to_its_own_state():
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(TensorDataset(torch.arange(4.0)), batch_size=2)
    assert dataloader_sampler_iter(iter(loader)) is None
