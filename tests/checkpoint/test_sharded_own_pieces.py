"""A sharded (FSDP2) checkpoint loaded at the saver's layout: each rank reads its own piece files
(model and optimizer) whole, straight into its shards, and digests them as they pass, so a flipped
byte in one of them is still found (2 real gloo ranks, one process start for both scenarios)."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import pytest

WORLD = 2
OPTIM_PIECE_1 = "optim/shard-00002-model-00001-of-00001.safetensors"  # rank 1's optimizer pieces


def worker(rank: int, port: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from resilience.checkpoint import Checkpointer, TrainingState
    from resilience.checkpoint.loading import inline_files
    from resilience.checkpoint.reader import CheckpointCorrupted
    from resilience.config import CheckpointConfig
    from resilience.distributed import DistContext
    from resilience.state.step_scheduler import StepScheduler

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()

    def local() -> list:
        out = [p.detach().to_local() for p in model.parameters()]
        return out + [v.to_local() if hasattr(v, "to_local") else v for p in model.parameters() for v in optimizer.state[p].values()]

    saved = [t.clone() for t in local()]
    ctx = DistContext.from_env()
    state = TrainingState(model=model, optimizer=optimizer)
    config = CheckpointConfig(checkpoint_dir=str(Path(out_path).parent / "ck"), save_consolidated=False)
    ckpt = Checkpointer(config, ctx, state=state, scheduler=StepScheduler(num_epochs=1, global_step=1))
    ckpt.save()

    chosen: list[Path] = []

    def zeroed_load() -> tuple[str | None, bool]:
        with torch.no_grad():
            for t in local():
                t.zero_()
        try:
            chosen.append(ckpt.find_resume_point())
            ckpt.load(chosen[-1], state)
        except CheckpointCorrupted as exc:
            return str(exc), False
        return None, all(torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)) for a, b in zip(saved, local(), strict=True))

    report: dict = {}
    report["error"], report["bitwise"] = zeroed_load()
    manifest = ckpt._chosen_manifest[1]
    report["inline"] = inline_files(manifest, state, weights_only=False, world_size=WORLD)
    report["inline_resharded"] = inline_files(manifest, state, weights_only=False, world_size=WORLD + 1)
    dist.barrier()
    if rank == 0:  # one byte of rank 1's optimizer pieces, in the tensors' bytes: same size, only the digest can tell
        target = chosen[0] / OPTIM_PIECE_1
        data = bytearray(target.read_bytes())
        data[-5] ^= 0xFF
        target.write_bytes(bytes(data))
    dist.barrier()
    report["corrupt_error"], _ = zeroed_load()
    ctx.close()
    dist.destroy_process_group()
    Path(out_path).write_text(json.dumps(report))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from gloo_ranks import run_worker_ranks  # here: the worker mode imports only what it runs

    return run_worker_ranks(__file__, WORLD, tmp_path_factory.mktemp("own_pieces"), timeout=120)


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_each_rank_digests_its_own_pieces_as_it_reads_them_and_a_flipped_byte_fails_every_rank(ranks):
    for rank, report in enumerate(ranks):
        assert report["error"] is None and report["bitwise"], f"rank {rank}: the intact checkpoint did not load back bitwise: {report['error']}"
        own = {f"{d}/shard-0000{rank + 1}-model-00001-of-00001.safetensors" for d in ("model", "optim")}
        assert own <= set(report["inline"]), f"rank {rank}: its own pieces are not read (and digested) by the loader: {report['inline']}"
        assert not own & set(report["inline_resharded"]), "at another world size the pieces are read by slices: the thread digests them"
        assert report["corrupt_error"] is not None and OPTIM_PIECE_1 in report["corrupt_error"], f"rank {rank}: {report['corrupt_error']}"
    assert "rank 1" in ranks[0]["corrupt_error"], "rank 1 found it, while reading its own file"


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
