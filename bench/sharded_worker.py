"""One rank of the sharded save and load benchmark (``bench/sharded_save.py`` starts them with ``resilience.launch``).

The model-like state of ``bench.common.build_state`` is sharded with FSDP2 over every rank
(``fully_shard`` per block, then the whole; Adam after one step, its state sharded too), so each
rank holds about 1/N of it. Every method is timed from a barrier before to a barrier after, so a
time covers every rank's work; the methods' order rotates from round to round.

``--mode save`` (N ranks): ``--save-repeat`` rounds of the save, then ``--repeat`` rounds of the load
on the same N ranks.

* save ``disk``: each rank ``os.write``s the bytes of its local shards into its own file and
  fsyncs it (the disk's aggregate write rate for this state);
* save ``ours``: ``Checkpointer.save`` of the sharded model and optimizer (each rank writes its
  part: its model and optimizer pieces as safetensors; no Hugging Face bundle,
  ``save_consolidated: false``, so only the save is timed);
* save ``dcp``: DCP ``save`` of the same sharded state dict (``get_state_dict``; ``FileSystemWriter``
  with ``sync_files``);
* load ``disk``: each rank reads its own file of the last round back into its shards, cold
  (every file of every method dropped from the page cache with ``posix_fadvise(DONTNEED)`` first);
* load ``ours``: ``Checkpointer.load`` of the last round's checkpoint (found untimed) into the
  live model and optimizer, cold, every digest checked, and compared bitwise with the saved state
  after (a difference fails the run);
* load ``dcp``: DCP ``load`` + ``set_state_dict`` of the last round's DCP checkpoint, cold.

Before every load of every method the live state is zeroed (untimed): ours is then caught if it
leaves a tensor untouched, and all three read into memory prepared the same way. The ranks also
read that method's files once (untimed) before they are dropped from the page cache: on the
bench VM a "cold" read is served by the host's cache when the same file was read shortly before
(3.3 GB/s) and from its disk otherwise (0.6-1.5 GB/s), and the rotation of methods would decide
which (:func:`bench.common.read_once`).

Then one more save and load with their phases timed (:mod:`bench.sharded_phases`). Rank 0
writes the digest of every full tensor (model and optimizer, by name) to ``reference.json``, and
the files of the last round stay for the next run.

``--mode reshard`` (another number of ranks, e.g. 1): loads those files into the same model
sharded over its own ranks: ``disk`` reads every saver's file, in rank order, into its shards (the
same bytes); ``ours`` loads the checkpoint (``world_size_change: elastic``), compared with
``reference.json`` full tensor by full tensor; ``dcp`` loads DCP's. Rank 0 writes the times (s)
and sizes (bytes) as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

REFERENCE = "reference.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--size", type=int, required=True, help="fp32 model bytes (the whole model, before sharding)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--save-repeat", type=int, default=None, help="rounds of the saves (default: --repeat)")
    parser.add_argument("--mode", choices=("save", "reshard"), default="save")
    parser.add_argument("--model-save-format", choices=("safetensors", "torch_save"), default="safetensors")
    args = parser.parse_args(argv)
    if args.save_repeat is None:
        args.save_repeat = args.repeat

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bench.common import build_state

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def shard(model: torch.nn.Module) -> None:
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    model, optimizer = build_state(args.size, wrap=shard)
    bench = _Bench(args, model, optimizer)
    try:
        doc = bench.save_mode() if args.mode == "save" else bench.reshard_mode()
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    finally:
        bench.ctx.close()
        dist.destroy_process_group()
    return 0


def local_state(model: Any, optimizer: Any) -> list[Any]:
    """This rank's tensors of the state (its shards of the parameters, then of each parameter's
    optimizer state), contiguous, in a fixed order. Called again after a load: a load may replace
    the optimizer's tensors."""
    out = [p.detach().to_local() for p in model.parameters()]
    out += [v.to_local() if hasattr(v, "to_local") else v for p in model.parameters() for v in optimizer.state[p].values() if hasattr(v, "numel")]
    return [t.contiguous() for t in out]


def tensor_digest(t: Any) -> str:
    """xxh3-128 of a tensor's bytes, with its dtype and shape."""
    import xxhash

    from bench.common import byte_view

    h = xxhash.xxh3_128(f"{t.dtype}{list(t.shape)}".encode())
    h.update(byte_view(t.contiguous()))
    return h.hexdigest()


def full_digests(model: Any, optimizer: Any) -> dict[str, str]:
    """The digest of every full tensor of the state by name (model keys; ``optim.<fqn>.<key>``),
    gathered from the shards (a collective: every rank calls it; rank 0's dict is the one to keep)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    named = {f"model.{k}": v for k, v in msd.items()}
    named.update({f"optim.{fqn}.{k}": v for fqn, entry in osd["state"].items() for k, v in entry.items() if hasattr(v, "numel")})
    return {name: tensor_digest(t.full_tensor() if hasattr(t, "full_tensor") else t) for name, t in sorted(named.items())}


class _Bench:
    """The rounds of one run (see the module's docstring)."""

    def __init__(self, args: argparse.Namespace, model: Any, optimizer: Any):
        import torch.distributed as dist

        from bench.common import nbytes
        from resilience.distributed import DistContext

        self.args, self.model, self.optimizer = args, model, optimizer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.work = Path(args.dir)
        self.ctx = DistContext.from_env()
        self.local = local_state(model, optimizer)
        self.local_bytes = nbytes(self.local)
        self.sizes = self.all_gather(self.local_bytes)

    def all_gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def checkpointer(self, step: int, **config: Any) -> Any:
        from resilience.checkpoint import Checkpointer, TrainingState
        from resilience.config import CheckpointConfig
        from resilience.state.step_scheduler import StepScheduler

        conf = CheckpointConfig(checkpoint_dir=str(self.work / "ours"), model_save_format=self.args.model_save_format, save_consolidated=False, **config)
        state = TrainingState(model=self.model, optimizer=self.optimizer)
        return Checkpointer(conf, self.ctx, state=state, scheduler=StepScheduler(num_epochs=1, global_step=step))

    def raw_file(self, rank: int) -> Path:
        return self.work / f"raw-{rank}.bin"

    def timed(self, run: Any, nbytes: int) -> float:
        """``run()`` between two barriers, after touching a working-size buffer; its seconds."""
        import torch.distributed as dist

        from bench.common import touch_memory

        touch_memory(nbytes)
        dist.barrier()
        start = time.perf_counter()
        run()
        dist.barrier()
        return time.perf_counter() - start

    def cold(self, read_first: str | None = None) -> None:
        """Every file of every method out of the page cache (rank 0; then a barrier).
        ``read_first``: the load method (``disk``, ``ours``, ``dcp``) whose files the ranks read
        once before (:func:`bench.common.read_once`), so its timed cold read comes from the host's
        cache like every other method's."""
        import torch.distributed as dist

        from bench.common import drop_cache, read_once

        if read_first is not None:
            read_once(self.load_files(read_first), self.rank, self.world)
            dist.barrier()
        if self.rank == 0:
            drop_cache([p for p in self.work.iterdir() if p.name != REFERENCE])
        dist.barrier()

    def load_files(self, method: str) -> list[Path]:
        """What a load by ``method`` reads: the anchor's files, our checkpoint's directory
        (``LATEST``'s), or DCP's."""
        if method == "disk":
            found = sorted(self.work.glob("raw-*.bin"))
        elif method == "ours":
            found = [(self.work / "ours" / "LATEST").resolve()]
        else:
            found = [self.work / method]
        if not found or not all(p.exists() for p in found):  # reading nothing would warm one method only
            raise FileNotFoundError(f"the files of the {method} load are missing under {self.work}: {found}")
        return found

    # -- save mode ---------------------------------------------------------------------------
    def save_mode(self) -> dict[str, Any]:
        import torch.distributed as dist

        from bench.common import median, remove, rotate, size_on_disk
        from bench.sharded_phases import LOAD, SAVE, timed_phases
        from bench.storage import save_dcp, write_raw

        targets = {"disk": self.raw_file(self.rank), "ours": self.work / "ours", "dcp": self.work / "dcp"}
        runs = {
            "disk": lambda step: write_raw(targets["disk"], self.local),
            "ours": lambda step: self.checkpointer(step).save(),
            "dcp": lambda step: save_dcp(targets["dcp"], self.model, self.optimizer),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        written: dict[str, int] = {}
        # Untimed, as bench/storage.py does: the first big write of a process runs much slower here
        self.timed(functools.partial(runs["disk"], 0), self.local_bytes)
        self.cold()
        for rnd in range(self.args.save_repeat):
            for method in rotate(list(runs), rnd):
                if method == "disk" or self.rank == 0:  # the shared directories are removed once
                    remove(targets[method])
                dist.barrier()
                times[method].append(self.timed(functools.partial(runs[method], rnd + 1), self.local_bytes))
                if self.rank == 0:
                    written[method] = size_on_disk(targets[method]) if method != "disk" else sum(self.sizes)
                self.cold()  # our own output out of the page cache before the next method writes
        reference = full_digests(self.model, self.optimizer)  # untimed: what every load must give back
        if self.rank == 0:
            (self.work / REFERENCE).write_text(json.dumps(reference))
        load = self.load_rounds(mine=reference)
        save_phases = timed_phases(SAVE, lambda: self.checkpointer(self.args.save_repeat + 1).save())
        self.cold(read_first="ours")
        load_phases = timed_phases(LOAD, lambda: self.load_ours(self.args.save_repeat + 1))
        self.check_local("the phase-timed load")
        return {
            "world_size": self.world,
            "model_save_format": self.args.model_save_format,
            "state_bytes": sum(self.sizes),
            "state_bytes_per_rank": self.sizes,
            "bytes_written": written,
            "times": times,
            "median_s": {k: median(v) for k, v in times.items()},
            "load": load,
            "phases": {"save": self.all_gather(save_phases), "load": self.all_gather(load_phases)},
        }

    def load_ours(self, step: int, **config: Any) -> None:
        from resilience.checkpoint import TrainingState

        ckpt = self.checkpointer(step, **config)
        found = ckpt.find_resume_point()
        assert found is not None, f"no checkpoint under {self.work / 'ours'}"
        ckpt.load(found, TrainingState(model=self.model, optimizer=self.optimizer))

    def zero_state(self) -> None:
        """Overwrite the live state (untimed), so a load that leaves a tensor untouched is caught."""
        import torch

        with torch.no_grad():
            for t in local_state(self.model, self.optimizer):
                t.zero_()

    def check_local(self, what: str) -> None:
        """Raise unless every local tensor equals, bitwise, what this rank held at the save."""
        now = [tensor_digest(t) for t in local_state(self.model, self.optimizer)]
        bad = [i for i, (a, b) in enumerate(zip(self.saved_local, now, strict=True)) if a != b]
        if bad:
            raise AssertionError(f"rank {self.rank}: {what} differs from the saved state in {len(bad)} of {len(now)} local tensors (first: #{bad[0]})")

    def load_rounds(self, *, mine: dict[str, str] | None = None, reference: dict[str, str] | None = None) -> dict[str, Any]:
        """Rounds of (disk, ours, dcp) loads, cold; ours' result checked bitwise after every round.
        ``mine`` (same world size): against this rank's local tensors at the save; ``reference``
        (resharded): every full tensor against the saver's digests."""
        from bench.common import median, rotate, size_on_disk
        from bench.storage import load_dcp

        if mine is not None:
            self.saved_local = [tensor_digest(t) for t in local_state(self.model, self.optimizer)]
        elastic = {"world_size_change": "elastic"} if reference is not None else {}
        runs = {
            "disk": self.read_disk,
            "ours": lambda: self.load_ours(self.args.save_repeat + 1, **elastic),
            "dcp": lambda: load_dcp(self.work / "dcp", self.model, self.optimizer),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        read = {"disk": sum(p.stat().st_size for p in self.work.glob("raw-*.bin"))}
        read.update({name: size_on_disk(self.work / name) for name in ("ours", "dcp")})
        checks = 0
        self.cold("disk")
        self.timed(self.read_disk, self.local_bytes)  # untimed: the first cold read of a process is slower too
        for rnd in range(self.args.repeat):
            for method in rotate(list(runs), rnd):
                # every method's, not only ours': zeroing slows the next read into that memory
                # (ours 1.00 s -> 1.48 s here, bench/README), so the anchor gets it too
                self.zero_state()
                self.cold(read_first=method)
                times[method].append(self.timed(runs[method], self.local_bytes))
                if method == "ours":
                    self.check_loaded(reference)
                    checks += 1
        return {"world_size": self.world, "times": times, "median_s": {k: median(v) for k, v in times.items()}, "bytes_read": read, "bitwise_checks": checks}

    def check_loaded(self, reference: dict[str, str] | None) -> None:
        if reference is None:
            self.check_local("the load")
            return
        got = full_digests(self.model, self.optimizer)
        if self.rank == 0 and got != reference:
            differ = sorted(k for k in set(got) | set(reference) if got.get(k) != reference.get(k))
            raise AssertionError(f"the resharded load differs from the saved state in {len(differ)} of {len(reference)} tensors: {differ[:5]}")

    def read_disk(self) -> None:
        """The disk anchor of a load: at the saver's world size each rank reads its own file into
        its shards; resharded, every rank reads the savers' files one after the other into its
        shards (one rank: all of them, the same bytes)."""
        from bench.common import byte_view
        from bench.storage import read_raw

        saved = sorted(self.work.glob("raw-*.bin"))
        if len(saved) == self.world:
            read_raw(self.raw_file(self.rank), self.local)
            return
        views = [byte_view(t) for t in self.local]
        for path in saved:
            with open(path, "rb", buffering=0) as fh:
                while views:
                    n = fh.readinto(views[0][: 64 << 20])
                    if not n:
                        break
                    views[0] = views[0][n:]
                    if not views[0]:
                        views.pop(0)

    # -- reshard mode ------------------------------------------------------------------------
    def reshard_mode(self) -> dict[str, Any]:
        from bench.sharded_phases import LOAD, timed_phases

        reference = json.loads((self.work / REFERENCE).read_text())
        load = self.load_rounds(reference=reference)
        self.cold(read_first="ours")
        phases = timed_phases(LOAD, lambda: self.load_ours(self.args.save_repeat + 1, world_size_change="elastic"))
        self.check_loaded(reference)
        return {"load": load, "state_bytes_per_rank": self.sizes, "phases": {"load": self.all_gather(phases)}}


if __name__ == "__main__":
    sys.exit(main())
