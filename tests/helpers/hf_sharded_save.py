"""A sharded checkpoint written by torch's own writer (``HuggingFaceStorageWriter(save_distributed=True)``),
in the file format ``model_save_format: safetensors`` uses for DTensor models: every rank writes
its local pieces into ``model/shard-0000K-model-0000I-of-0000N.safetensors`` with DCP's
``DCP_SHARDING_INFO`` (each piece's offsets in the full tensor).

Usage: hf_sharded_save.py OUT_DIR MODE [publish [FAIL_RANK]]   (2 ranks; MODE fsdp, tp or 2d (4 ranks))

A tiny Llama from a config (no download) with an odd vocabulary (257: the embedding and the head
split 129/128, unevenly) is sharded by MODE: ``fsdp`` (FSDP2 ``fully_shard``: every parameter
``Shard(0)``), ``tp`` (``parallelize_module`` of each MLP: ``Shard(0)`` and ``Shard(1)`` pieces,
the rest replicated and written once), ``2d`` (a 2x2 mesh: TP in each MLP, FSDP2 over it, so a
weight is ``(Shard(0), Shard(1))``). Writes OUT_DIR/model/ (shards, ``hf_metadata/config.json``)
and, on rank 0, OUT_DIR/full.safetensors: every full tensor, for the tests to compare with.

With ``publish``: the shards are one collective part of a checkpoint saved by our writer
(``write_checkpoint`` + ``publish``) into OUT_DIR/ckpt/step_1, beside the part
``checkpoint_parts`` adds for ``save_consolidated`` with a DTensor model (the bundle, streamed
from every rank's shards once they are durable); the model part itself is left out.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM

import ranks  # this folder's shared rank start

out, mode = Path(sys.argv[1]), sys.argv[2]
world, rank = ranks.join()
config = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)
model = LlamaForCausalLM(config)
full = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
tp_plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
if mode == "fsdp":
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
elif mode == "tp":
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        parallelize_module(layer.mlp, mesh, tp_plan)
elif mode == "2d":
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    for layer in model.model.layers:
        parallelize_module(layer.mlp, mesh["tp"], tp_plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
else:
    raise SystemExit(f"unknown MODE {mode!r}")

state = get_model_state_dict(model)
assert any(isinstance(v, DTensor) for v in state.values())
# two consolidated files: the embedding and the layers in one, the rest in the other
index = {key: 1 if key.startswith("model.embed_tokens") or ".layers." in key else 2 for key in state}


def save_shards(staging: Path) -> list[str]:
    """Write the shards (a collective) and ``hf_metadata/config.json`` (rank 0) under ``staging/model``."""
    writer = HuggingFaceStorageWriter(str(staging / "model"), save_distributed=True, fqn_to_index_mapping=index)
    dcp.save(state, storage_writer=writer)
    written = [f"model/{p.name}" for p in (staging / "model").glob(f"shard-{rank + 1:05d}-*.safetensors")]
    if rank == 0:
        (staging / "model" / "hf_metadata").mkdir()
        config.architectures = ["LlamaForCausalLM"]
        config.to_json_file(str(staging / "model" / "hf_metadata" / "config.json"))
        written.append("model/hf_metadata/config.json")
    return written


def save_with_our_writer() -> None:
    """The shards as a collective part of a checkpoint, beside the bundle part ``checkpoint_parts`` makes."""
    from resilience.checkpoint import parts as checkpoint_parts
    from resilience.checkpoint.parts import Part
    from resilience.checkpoint.writer import CheckpointSaveError, publish, write_checkpoint
    from resilience.config import config_from_dict
    from resilience.distributed import DistContext
    from resilience.state.training_state import TrainingState

    ctx = DistContext.from_env()
    ckpt = config_from_dict({"checkpoint": {"save_consolidated": "every"}}).checkpoint
    site = checkpoint_parts._SaveSite(ckpt, ctx, ctx.group, out, None)
    made = checkpoint_parts._model_parts(TrainingState(model=model), "periodic", site, None, None)
    assert [p.name for p in made] == ["model", "consolidated"] and made[0].kwargs["consolidated"] is False, made
    assert made[1].after_peers and not made[0].after_peers
    if sys.argv[4:] == [str(rank)]:
        from resilience.checkpoint.formats import bundle_shards

        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device (injected)")

        bundle_shards.write_file = broken
    try:
        written = write_checkpoint(ctx, out / "ckpt", "step_1", [Part("shards", save_shards, by="all ranks"), made[1]])
    except CheckpointSaveError as exc:
        (out / f"failed-rank{rank}.txt").write_text(str(exc))
    else:
        if rank == 0:
            publish(out / "ckpt", "step_1", written, {"global_step": 1})
    ctx.close()


if sys.argv[3:4] == ["publish"]:
    save_with_our_writer()
else:
    save_shards(out)
for key, value in state.items():  # the saved pieces are the full tensors' values
    whole = value.full_tensor() if isinstance(value, DTensor) else value
    assert torch.equal(whole, full[key]), key
if rank == 0:
    save_file(full, str(out / "full.safetensors"))
dist.barrier()
dist.destroy_process_group()
