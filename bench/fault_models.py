"""The model the fault harness trains, replicated (DDP) or sharded (FSDP2), and its unsharded twin
for reading a checkpoint back.

    model, net = build("fsdp2")     # net: what the loop trains and saves (DDP wrapper, or the FSDP2 module)
    weights = final_weights(checkpoint_dir, "fsdp2")
"""

from __future__ import annotations

from pathlib import Path

MODELS = ("ddp", "fsdp2")


def plain():
    """Linear(16, 32) -> ReLU -> Dropout(0.1) -> Linear(32, 4), unsharded, seeded by the caller."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))


def build(kind: str):
    """(model, net) on this rank of the default process group: ``ddp`` wraps :func:`plain` in
    DistributedDataParallel; ``fsdp2`` shards each Linear, then the whole, over every rank
    (``fully_shard``: parameters become DTensors). Raises ValueError for another ``kind``."""
    import torch
    import torch.distributed as dist

    model = plain()
    if kind == "ddp":
        return model, torch.nn.parallel.DistributedDataParallel(model)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model
    raise ValueError(f"--model: expected one of {', '.join(MODELS)}, got {kind!r}")


def final_weights(checkpoint: Path) -> dict:
    """The model weights saved in ``checkpoint``, whatever the world size, sharding and
    ``model_save_format``: loaded (resharded) into an unsharded :func:`plain` in this process."""
    from resilience.checkpoint.formats.model_io import load_model

    model = plain()
    load_model(checkpoint, model)  # DCP or shards, any world size, into this one process
    return model.state_dict()
