"""One rank of the sharded-save benchmark (``bench/sharded_save.py`` starts two with ``resilience.launch``).

The model-like state of ``bench.common.build_state`` is sharded with FSDP2 over every rank
(``fully_shard`` per block, then the whole; Adam after one step, its state sharded too), so each
rank holds about 1/N of it. Every round runs three methods in a rotating order, each timed from a
barrier before to a barrier after, so a time covers every rank's writing:

* ``disk``: each rank ``os.write``s the bytes of its local shards into its own file and fsyncs it
  (the disk's aggregate write rate for this state);
* ``ours``: ``Checkpointer.save`` of the sharded model and optimizer (each rank writes its part:
  its model shards as ``model/shard-*.safetensors`` in the default format, its optimizer shard
  through DCP; no Hugging Face bundle, ``save_consolidated: false``, so only the save is timed);
* ``dcp``: DCP ``save`` of the same sharded state dict (``get_state_dict``; ``FileSystemWriter``
  with ``sync_files``).

Rank 0 writes the times (s) and sizes (bytes) as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--size", type=int, required=True, help="fp32 model bytes (the whole model, before sharding)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--model-save-format", choices=("safetensors", "torch_save"), default="safetensors")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bench.common import build_state, median, nbytes, remove, rotate, size_on_disk, touch_memory
    from bench.storage import save_dcp, write_raw
    from resilience.checkpoint import Checkpointer, TrainingState
    from resilience.config import CheckpointConfig
    from resilience.distributed import DistContext
    from resilience.state.step_scheduler import StepScheduler

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def shard(model: torch.nn.Module) -> None:
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    model, optimizer = build_state(args.size, wrap=shard)
    local = [p.detach().to_local() for p in model.parameters()]
    local += [v.to_local() if hasattr(v, "to_local") else v for p in model.parameters() for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    local = [t.contiguous() for t in local]
    local_bytes = nbytes(local)
    sizes = [None] * world
    dist.all_gather_object(sizes, local_bytes)

    work = Path(args.dir)
    ctx = DistContext.from_env()
    times: dict[str, list[float]] = {"disk": [], "ours": [], "dcp": []}
    written: dict[str, int] = {}

    def target(method: str) -> Path:
        return work / {"disk": f"raw-{rank}.bin", "ours": "ours", "dcp": "dcp"}[method]

    def run(method: str, step: int) -> None:
        if method == "disk":
            write_raw(target("disk"), local)
        elif method == "ours":
            config = CheckpointConfig(checkpoint_dir=str(target("ours")), model_save_format=args.model_save_format, save_consolidated=False)
            state = TrainingState(model=model, optimizer=optimizer)
            Checkpointer(config, ctx, state=state, scheduler=StepScheduler(num_epochs=1, global_step=step)).save()
        else:
            save_dcp(target("dcp"), model, optimizer)

    for rnd in range(args.repeat):
        for method in rotate(list(times), rnd):
            touch_memory(local_bytes)
            dist.barrier()
            start = time.perf_counter()
            run(method, rnd + 1)
            dist.barrier()
            times[method].append(time.perf_counter() - start)
            if rank == 0:
                written[method] = size_on_disk(work / "ours") if method == "ours" else size_on_disk(target(method)) if method == "dcp" else 0
            dist.barrier()
            if method == "disk" or rank == 0:  # the shared directories are removed once
                remove(target(method))
            dist.barrier()
    if rank == 0:
        written["disk"] = sum(sizes)
        doc = {
            "world_size": world,
            "model_save_format": args.model_save_format,
            "state_bytes": sum(sizes),
            "state_bytes_per_rank": sizes,
            "bytes_written": written,
            "times": times,
            "median_s": {k: median(v) for k, v in times.items()},
        }
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    ctx.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
