"""One save as one simulated rank runs it, through the library's own save path.

For rank q (0, then r) of N: :func:`~resilience.checkpoint.parts.checkpoint_parts` (the training
thread's part: torch's state dicts, the optimizer's capture and its replicated-or-sharded gather,
the model plan and its gather, the rank-0 records, RNG, data position), then
:func:`~resilience.checkpoint.writer.write_checkpoint` (staging, every part run as it runs in a
save, the records gather to rank 0), and on rank 0 :func:`~resilience.checkpoint.writer.publish`,
then ``LOWEST_VAL`` and retention's choice (victims renamed aside) as ``Checkpointer._after_publish``
calls them, then the verdict, then (rank 0) its share of the background deletion.
That is ``Checkpointer._write``'s sequence; ``Checkpointer.save`` itself is not used because
building a ``Checkpointer`` runs the start-up checks (a whole extra model plan for a sharded model).

The other ranks' files are made while rank 0's records are gathered (:class:`PeerFiles`), by the
library's own per-rank writers called with rank q's inputs: ``shard_files.write_rank_files`` with
rank q's share of the plan, ``optim_files.save`` for rank q, DCP's data file from rank q's central
plan, ``parts._write_rank_state`` (its RNG and data position). Before rank 0 publishes, an older checkpoint
of the same files (hard links) is put in place with ``LATEST`` on it, so that retention
(``max_recent_checkpoints: 1``) removes a real checkpoint of N ranks, as it does at every save
of a long run.
"""

from __future__ import annotations

import collections
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from bench.scale.probe import PROBE
from bench.scale.sim import Cell, SimContext
from resilience.checkpoint import parts as ckpt_parts
from resilience.checkpoint import writer
from resilience.checkpoint.formats import optim_files, optim_shards, shard_files
from resilience.checkpoint.layout import LATEST, MANIFEST, OPTIM_DIR, PRUNING_PREFIX, STAGING_PREFIX, checkpoint_name
from resilience.checkpoint.policy import retention
from resilience.checkpoint.policy.lowest_val import LowestVal
from resilience.checkpoint.storage.durable import FileRecord, record
from resilience.checkpoint.storage.manifest import write_manifest, write_rank_manifest
from resilience.checkpoint.storage.pointers import write_pointer
from resilience.config import CheckpointConfig
from resilience.state.step_scheduler import StepScheduler
from resilience.state.training_state import TrainingState

STEP, PREVIOUS_STEP = 200, 100
GLOBAL_BATCH = 4


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainingState:
    """The registered state: the model, its optimizer and a data loader (its position is saved per rank)."""
    return TrainingState(model=model, optimizer=optimizer, dataloader=DataLoader(list(range(4096)), batch_size=GLOBAL_BATCH))


def scheduler() -> StepScheduler:
    """The counters at the save: step 200 of epoch 0."""
    return StepScheduler(num_epochs=1, epoch=0, batches_in_epoch=STEP, global_step=STEP)


def manifest_meta(world_size: int, step: int, parent: dict[str, Any] | None, optimizer_saved: bool = True) -> dict[str, Any]:
    """The manifest's ``meta`` as ``Checkpointer.save`` builds it."""
    return {
        "epoch": 0,
        "global_step": step,
        "world_size": world_size,
        "reason": "periodic",
        "saved_at": time.time(),
        "run_id": "scale-bench",
        "torch_version": torch.__version__,
        "global_batch_size": GLOBAL_BATCH * world_size,
        "gradient_accumulation_steps": 1,
        "epoch_complete": False,
        "optimizer_saved": optimizer_saved,
        "is_async": False,
        "timings": {},
        "checkpoint_id": uuid.uuid4().hex,
        "parent": parent,
    }


class PeerFiles:
    """Rank q's files of the save, made in the staging directory by the library's own writers
    from the inputs rank 0's run captured (``keep``: the spied calls' arguments): :meth:`own`
    (what rank q sends its block's leader), :meth:`listed` (what it sends rank 0: its files any
    rank may read, and for a block's leader the rank manifest it writes with
    ``write_rank_manifest`` from its members' own records)."""

    def __init__(self, cell: Cell, staging: Path, keep: dict[str, Any], parts: list[Any], block: int):
        self.cell, self.staging, self.keep, self.block = cell, staging, keep, block
        self.by_part = {part.name: part for part in parts}
        self._inputs: dict[str, Any] | None = None
        self._made: dict[int, tuple[list[FileRecord], list[FileRecord]]] = {}

    def own(self, q: int) -> list[FileRecord]:
        """Rank q's own files' records (rank state; a sharded state's shards)."""
        return self._make(q)[1]

    def listed(self, q: int) -> list[FileRecord]:
        """Rank q's records gathered to rank 0 (a leader's rank manifest among them)."""
        listed = list(self._make(q)[0])
        if q % self.block == 0:
            members = [self.own(m) for m in range(q, min(q + self.block, self.cell.world_size))]
            listed.append(write_rank_manifest(self.staging, q, members))
        return listed

    def _make(self, q: int) -> tuple[list[FileRecord], list[FileRecord]]:
        """(listed, own) records of rank q's files, made once."""
        if q in self._made:
            return self._made[q]
        if self._inputs is None:  # rank 0's own calls, before any peer's overwrites them
            labels = ("shard_files.write_rank_files", "optim_files.save", "optim_shards.save")
            self._inputs = {label: self.keep[label][0] for label in labels if label in self.keep}
        model_dir, state, plan, index, _ = self._inputs["shard_files.write_rank_files"]
        if self.cell.mode == "ddp":
            listed = shard_files.write_rank_files(model_dir, state, plan, index, q)  # every rank holds every tensor
            _, tensors, skeleton, _, world_size = self._inputs["optim_files.save"]
            listed += optim_files.save(self.staging, tensors, skeleton, q, world_size)
            own: list[FileRecord] = []
        else:
            listed = []
            mine = plan.mine(q)  # rank q's pieces: a rule's by arithmetic on q, as rank q finds them
            local = {key: torch.empty(piece["shape"], dtype=getattr(torch, plan.tensors[key]["dtype"])) for key, piece in mine}
            own = shard_files.write_rank_files(model_dir, local, plan, index, q)
            if "optim_shards.save" in self._inputs:  # the sharded optimizer's pieces, as rank q writes them
                _, tensors, skeleton, _ = self._inputs["optim_shards.save"]
                mine = skeleton[optim_shards.PLAN].mine(q)
                local = {key: torch.empty(piece["shape"], dtype=tensors[key].dtype) for key, piece in mine}
                own += optim_shards.save(self.staging, local, skeleton, q)
            own += [rec.under(OPTIM_DIR) for rec in self.cell.dcp_peer_records.pop(q, [])]  # none without a DCP optimizer
        _, captured, position = self.by_part["rank_state"].args
        rels = ckpt_parts._write_rank_state(self.staging, q, captured, position)
        self._made[q] = (listed, own + [record(self.staging, rel) for rel in rels])
        return self._made[q]


def simulate_save(cell: Cell, rank: int, state: TrainingState, root: Path, keep: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s save (rank 0 first: it publishes); returns its measurements."""
    PROBE.reset()
    cell.begin(rank, "save")
    ctx = SimContext(cell)
    name = checkpoint_name(0, STEP)
    staging = root / f"{STAGING_PREFIX}{name}"
    config = CheckpointConfig(checkpoint_dir=str(root))
    cell.dcp_target = staging / OPTIM_DIR
    if rank != 0:
        staging.mkdir(parents=True, exist_ok=True)  # rank 0 made it: this rank only writes into it
    out: dict[str, Any] = {}
    with PROBE.measure() as out["parts"]:
        parts = ckpt_parts.checkpoint_parts(
            state,
            scheduler(),
            reason="periodic",
            config=config,
            ctx=ctx,
            group=None,
            root=root,
            buffers=None,
            run_config={},
            global_batch_size=GLOBAL_BATCH * cell.world_size,
            training_rows=[],
            validation={},
        )
    if rank == 0:
        cell.peer_records = PeerFiles(cell, staging, keep, parts, writer.rank_manifest_block())
    with PROBE.measure() as out["write"]:
        written = writer.write_checkpoint(ctx, root, name, parts)
    out["own_file_bytes"] = sum(rec.size for rec in cell.own_records)
    if rank == 0:
        with PROBE.excluded():
            parent = _previous_checkpoint(root, staging, written, cell.world_size)
            meta = manifest_meta(cell.world_size, STEP, parent, optimizer_saved=state.optimizer is not None)
        with PROBE.measure() as out["publish"]:
            final = writer.publish(root, name, written, meta)
        with PROBE.measure() as out["retention"]:  # Checkpointer._after_publish: before the last collective
            LowestVal(root).consider(final, None)
            victims = retention.set_aside(root, retention.plan_prune(root, 1, current=final))
        with PROBE.excluded():
            out["files"] = sum(len(files) for _, _, files in os.walk(final)) - 1  # every file but the manifest
    with PROBE.measure() as out["verdict"]:
        victims = writer.raise_publish_verdict(ctx, name, None, victims if rank == 0 else None)
    if rank == 0:
        out["background"] = _background_deletion(root, victims, written.mine)
    if rank != 0:
        shutil.rmtree(staging)
    out["functions"] = dict(PROBE.functions)
    out["lower_bounds"] = dict(PROBE.lower_bounds)
    out["received"] = dict(PROBE.received)
    return out


def _background_deletion(root: Path, victims: list[str], own: list[FileRecord]) -> dict[str, Any]:
    """Rank 0's share of retention's background deletion (``Checkpointer._delete``): its own files
    of the victim (the same relative paths as this save's: the victim is its hard links), then,
    once the peers deleted theirs (made here, not counted), what is left (``remove_set_aside``, run
    by the next save's job in a real run)."""
    mine = {rec.path for rec in own}
    with PROBE.measure() as out:
        for victim in victims:
            retention.delete_files(root, victim, sorted(mine))
    with PROBE.excluded():
        for victim in victims:
            pruning = root / f"{PRUNING_PREFIX}{victim}"
            for dirpath, _, files in os.walk(pruning):
                for file in files:
                    path = Path(dirpath) / file
                    if str(path.relative_to(pruning)) not in mine and file != MANIFEST:
                        path.unlink()
    with PROBE.measure() as rest:
        retention.remove_set_aside(root)
    out["cpu_s"] += rest["cpu_s"]
    out["wall_s"] += rest["wall_s"]
    out["meta_ops"] = dict(collections.Counter(out["meta_ops"]) + collections.Counter(rest["meta_ops"]))
    out["read"] = dict(collections.Counter(out["read"]) + collections.Counter(rest["read"]))
    return out


def _previous_checkpoint(root: Path, staging: Path, written: writer.Written, world_size: int) -> dict[str, Any]:
    """An older checkpoint of the same files (hard links) with ``LATEST`` on it: the one this save's
    retention removes. Returns its ``parent`` entry for the new manifest."""
    previous = root / checkpoint_name(0, PREVIOUS_STEP)
    for dirpath, _, files in os.walk(staging):
        target = previous / Path(dirpath).relative_to(staging)
        target.mkdir(parents=True, exist_ok=True)
        for file in files:
            os.link(Path(dirpath) / file, target / file)
    meta = manifest_meta(world_size, PREVIOUS_STEP, None)
    write_manifest(previous, written.listed, meta, written.rank_manifests)
    write_pointer(root, LATEST, previous)
    return {"name": previous.name, "checkpoint_id": meta["checkpoint_id"]}
