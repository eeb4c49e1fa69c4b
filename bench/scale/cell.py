"""One cell of the scale bench, in a process of its own: one save and one resume of a mode at N ranks.

``python -m bench.scale.cell --mode fsdp2 --ranks 1024 --dir D --out cell.json`` simulates rank
0 and then rank 1 (see :mod:`bench.scale`), writing ``cell.json`` after each of the four runs
(save 0, save 1, resume 0, resume 1), so that a cell stopped at its time limit keeps what it
measured (``"stage"`` names the run it was in).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from bench.scale import llama, probe, resume, save, sim, sparse
from resilience.checkpoint import parts as ckpt_parts
from resilience.checkpoint import reader, size_checks, writer
from resilience.checkpoint.formats import model_io, optim_files, optim_io, optim_shards, pieces, shard_files, sharded_model
from resilience.checkpoint.policy import retention
from resilience.checkpoint.storage import dcp_io

SIM_RANK = 1
"""The non-zero rank simulated: one holding a block of every tensor at every N measured (rank
N-1 holds nothing at all at 8,192 ranks under FSDP2)."""


_KEEP: dict[str, Any] = {}


def install_spies(cap_s: float) -> dict[str, Any]:
    """Time the library's (and DCP's) functions on the save and resume paths, by name (once per
    process); returns the dict their last calls' arguments are kept in."""
    if _KEEP:
        return _KEEP
    keep = _KEEP
    keep["installed"] = True
    spied = [
        (ckpt_parts, "get_state_dict", "torch get_state_dict"),
        (optim_io, "_split", "optim_io._split"),
        (optim_files, "replicated", "optim_files.replicated (gather)"),
        (pieces, "make_plan", "pieces.make_plan (gather + _assign)"),
        (pieces, "_assign", "pieces._assign"),
        (model_io, "tied_aliases", "model_io.tied_aliases"),
        (model_io, "_save_sharded", "model_io._save_sharded (model part)"),
        (model_io, "_file_plan", "model_io._file_plan"),
        (shard_files, "index_doc", "shard_files.index_doc"),
        (shard_files, "write_rank_files", "shard_files.write_rank_files"),
        (optim_files, "assign", "optim_files.assign"),
        (optim_files, "save", "optim_files.save"),
        (optim_shards, "capture", "optim_shards.capture (plan)"),
        (optim_shards, "save", "optim_shards.save"),
        (optim_shards, "load", "optim_shards.load"),
        (dcp_io, "save_tensors", "dcp_io.save_tensors (DCP save)"),
        (DefaultSavePlanner, "create_local_plan", "DCP create_local_plan (save)"),
        (DefaultSavePlanner, "create_global_plan", "DCP create_global_plan (save, coordinator)"),
        (dcp_fs._FileSystemWriter, "finish", "DCP finish: .metadata (coordinator)"),
        (writer, "_write_parts", "writer._write_parts"),
        (writer, "write_manifest", "manifest.write_manifest"),
        (writer, "_rename_into_place", "writer._rename_into_place"),
        (writer, "write_pointer", "pointers.write_pointer"),
        (retention, "plan_prune", "retention.plan_prune"),
        (retention, "set_aside", "retention.set_aside"),
        (retention, "delete_files", "retention.delete_files (background)"),
        (retention, "remove_set_aside", "retention.remove_set_aside (background)"),
        (reader, "choose", "resume_choice.choose"),
        (size_checks, "validate", "manifest.validate"),
        (model_io, "load_model", "model_io.load_model"),
        (sharded_model, "read_layout", "sharded_model.read_layout"),
        (sharded_model, "read_aliases", "sharded_model.read_aliases"),
        (shard_files, "load_by_slices", "shard_files.load_by_slices"),
        (model_io, "get_model_state_dict", "torch get_model_state_dict (load)"),
        (optim_io, "load_optimizer", "optim_io.load_optimizer"),
        (optim_io, "get_optimizer_state_dict", "torch get_optimizer_state_dict (load)"),
        (optim_io, "set_optimizer_state_dict", "torch set_optimizer_state_dict"),
        (optim_files, "load", "optim_files.load"),
        (dcp_io, "load_tensors", "dcp_io.load_tensors (DCP load)"),
        (dcp_io.SafeFileSystemReader, "read_metadata", "dcp_io read_metadata (.metadata unpickled)"),
        (DefaultLoadPlanner, "create_local_plan", "DCP create_local_plan (load)"),
    ]
    for owner, name, label in spied:
        probe.spy(owner, name, label, keep=keep)
    probe.spy(reader, "_share", "reader._share (digest share)", cap_s=cap_s, fallback=resume.fast_share)
    return keep


def run_cell(mode: str, world_size: int, workdir: Path, out: Path, cap_s: float, dcp_max_ranks: int = 1024, log: Any = print) -> dict[str, Any]:
    """Simulate the cell, writing what is measured to ``out`` as it goes; returns it. Above
    ``dcp_max_ranks`` an ``fsdp2`` state is saved without its optimizer: DCP's coordinator holds
    every rank's plan (4.7 GB and ~1 min of CPU at 1,024 ranks here), which this machine cannot
    hold at 8,192; the table adds the optimizer's part measured at the largest N it was run at,
    as a lower bound. The sharded optimizer state no longer goes through DCP (it is written as
    per-rank pieces, ``optim_shards``), so every cell now runs with its optimizer and
    ``dcp_max_ranks`` only matters to a state that still would."""
    with_optimizer = True  # dcp_max_ranks: for a state saved through DCP; none of the bench's is now
    root = workdir / f"{mode}-{world_size}" / "checkpoints"
    shutil.rmtree(root.parent, ignore_errors=True)
    root.mkdir(parents=True)
    probe.install_counters()
    keep = install_spies(cap_s)
    cell = sim.Cell(mode=mode, world_size=world_size, sim_rank=SIM_RANK)
    sim.CELL = cell
    undo = sim.install_dcp_wrapper()
    doc: dict[str, Any] = {"mode": mode, "world_size": world_size, "sim_rank": SIM_RANK, "cap_s": cap_s, "optimizer": with_optimizer, "runs": {}}
    try:
        with sparse.byte_level_replaced():
            for phase, rank in (("save", 0), ("save", SIM_RANK), ("resume", 0), ("resume", SIM_RANK)):
                doc["stage"] = f"{phase} rank {rank}"
                out.write_text(json.dumps(doc, indent=1) + "\n")
                started = time.perf_counter()
                # What the simulation keeps (rank 0's results for rank r: every rank's plans) must not
                # slow the rank's own work through the cyclic collector's passes over it.
                gc.freeze()
                _fresh_dcp_plan_caches()  # each simulated rank is a process of its own: no plan cached by another
                mesh = llama.start_rank(mode, rank, world_size)
                try:
                    device = "meta" if phase == "resume" and mode == "fsdp2" else "cpu"  # its loader copies into the live shards
                    model, optimizer = llama.build_state(mode, rank, world_size, mesh, device=device)
                    state = save.training_state(model, optimizer if with_optimizer else None)
                    if phase == "save":
                        result = save.simulate_save(cell, rank, state, root, keep)
                    else:
                        result = resume.simulate_resume(cell, rank, state, root)
                finally:
                    llama.stop_rank()
                if cell.mismatches:
                    raise AssertionError("the data made for the simulated rank differs from its own:\n" + "\n".join(cell.mismatches))
                result["wall_s"] = time.perf_counter() - started
                doc["runs"][f"{phase}.{rank}"] = result
                log(f"scale: {mode} N={world_size}: {phase} rank {rank}: {result['wall_s']:.1f} s")
                del model, optimizer, state
                if (phase, rank) == ("save", SIM_RANK):  # rank 0's save results were kept for rank r only
                    cell.results = {key: value for key, value in cell.results.items() if key[0] != "save"}
        doc["stage"] = "done"
    except BaseException as exc:
        doc["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        raise
    finally:
        out.write_text(json.dumps(doc, indent=1) + "\n")
        undo()
        shutil.rmtree(root.parent, ignore_errors=True)
    return doc


def _fresh_dcp_plan_caches() -> None:
    """Empty DCP's class-level plan caches (``dcp_io.caching_planner``), as in a new process."""
    for name in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata", "_cached_final_save_plan"):
        cache = getattr(SavePlanner, name, None)
        if isinstance(cache, dict):
            cache.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale.cell", description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=llama.MODES, required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cap-s", type=float, default=60.0)
    parser.add_argument("--dcp-max-ranks", type=int, default=1024)
    args = parser.parse_args(argv)
    # DCP's load plan asks the (fake) process group for its device: a deprecation notice per load
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint.planner_helpers")
    run_cell(args.mode, args.ranks, args.dir, args.out, args.cap_s, args.dcp_max_ranks, log=lambda line: print(line, file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
