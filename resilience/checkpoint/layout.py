"""Every name on disk: checkpoint root, checkpoint directories, their files, staging and leftovers.

The writers and the readers (``resilience status``, ``verify``, ``consolidate``, the loader) take
names from here only, so this tree is the whole layout::

    checkpoint_dir/                       checkpoint.checkpoint_dir
      LATEST -> epoch_1_step_32           LATEST: relative symlink (LATEST.txt where symlinks fail)
      LOWEST_VAL -> epoch_0_step_20       LOWEST_VAL: the checkpoint with the lowest validation metric
      training.jsonl  validation.jsonl    TRAINING_LOG, VALIDATION_LOG: rank 0's metrics
      .starts.json                        STARTS_FILE: the progress guard's counts of starts
      .held_stop.json                     HELD_STOP_RECORD: resilience run --checkpoint-dir: a stop signal
                                          it delivered after holding it for ranks that never got ready
      epoch_1_step_32/                    checkpoint_name(epoch, global_step)
        manifest.json                     MANIFEST: written last; the directory is valid only with it. It lists
                                          the files any rank may read (and the rank manifests), not each
                                          rank's own files: O(tensors) bytes, not O(ranks)
        rank_manifests/ranks_00000-00063.json ...   RANK_MANIFESTS_DIR, rank_manifest_file(): each rank's own
                                          files (rank state, its shards) for a block of RANK_MANIFEST_BLOCK
                                          ranks, written by the block's first rank (storage/rank_manifests.py)
        .bad                              BAD_MARKER: why it failed to load (it is skipped from then on)
        step_scheduler.json               STEP_SCHEDULER
        config.yaml                       CONFIG: the run's configuration
        common.json  losses.json          COMMON (MindSpore's), LOSSES
        model/                            MODEL_DIR
          shard-00001-model-00001-of-00001.safetensors ...   model_shard_name() (MODEL_SHARD_GLOB): one per rank
                                          and output file; a sharded model's hold each rank's local DTensor shards
          shard_index.json                SHARD_INDEX (MODEL_SHARD_INDEX from the checkpoint directory)
          consolidate.sh                  CONSOLIDATE_SH (MODEL_CONSOLIDATE_SH): writes consolidated/ later
          hf_metadata/                    HF_METADATA (MODEL_HF_METADATA): config.json (HF_CONFIG),
                                          generation_config.json, tokenizer files
          consolidated/                   CONSOLIDATED (MODEL_CONSOLIDATED): the Hugging Face bundle
            model-00001-of-0000N.safetensors ...   hf_file_name() (a one-file original: HF_SINGLE_FILE)
            model.safetensors.index.json  HF_INDEX
            config.json ...               copied from hf_metadata/
            bundle_manifest.json          BUNDLE_MANIFEST: sizes + digests of a bundle built later
          adapter_model.safetensors  adapter_config.json   ADAPTER_WEIGHTS, ADAPTER_CONFIG (PEFT)
          .metadata  __0_0.distcp ...     DCP_METADATA, DCP_SUFFIX: model_save_format torch_save (DCP)
        optim/                            OPTIM_DIR
          shard-00001-of-00002.safetensors ...   optim_shard_name() (OPTIM_SHARD_GLOB): state every rank holds in full
                                          (plain, DDP), each rank writing ~1/N of the tensors
          .metadata  __0_0.distcp ...     DCP's files: sharded (DTensor) state, and checkpoints
                                          written before the optimizer had its own files
          skeleton.json  lr_scheduler.json   SKELETON (structure, and the file of each tensor), LR_SCHEDULER
        rank_state/rank_00000.safetensors ...   RANK_STATE_DIR, rank_state_file(): one per global rank,
                                          its RNG states (tensors) and data position (JSON, header)
        rng/rank_00000.safetensors ...    RNG_DIR, rng_rank_file(): checkpoints written before rank_state/,
        dataloader/rank_00000.json ...    DATALOADER_DIR, dataloader_rank_file(): read, never written
        extra/<name>.json  extra/<name>.safetensors   EXTRA_DIR
      epoch_1_step_20.abandoned-20250501T120410Z/   ABANDONED_INFIX: another timeline's, moved aside
      .staging_epoch_1_step_40/           STAGING_PREFIX: a save in progress (removed at the next start)
      .trash_epoch_1_step_40/             TRASH_PREFIX: the checkpoint a re-save of its step replaces
      .pruning_epoch_0_step_4/            PRUNING_PREFIX: a checkpoint retention is removing

A checkpoint a trainer integration saved (:mod:`resilience.integrations.session`) holds that
trainer's own files instead (a Hugging Face ``Trainer``'s ``model.safetensors``, ``optimizer.pt``,
``trainer_state.json``, ...), plus ``MANIFEST`` and ``CONFIG``; its manifest's ``meta.producer`` names
the trainer. Everything at the root is the same.

A pointer's text form is ``<name>`` + ``POINTER_SUFFIX`` (``LATEST.txt``); tensors are in
``SAFETENSORS_SUFFIX`` files. Directory names (``model``, ``optim``, ``rng``, ...) double as the
labels of a save's parts, which are spelled where the parts are built. The rank state was two
files per rank before (``rng/``, ``dataloader/``): 2 x N files and manifest entries per save.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator
from typing import Protocol, TypeVar

from typing_extensions import Self

# The checkpoint root.
LATEST = "LATEST"
LOWEST_VAL = "LOWEST_VAL"
POINTER_SUFFIX = ".txt"  # a pointer's text form, where symlinks fail
TRAINING_LOG = "training.jsonl"
VALIDATION_LOG = "validation.jsonl"
STARTS_FILE = ".starts.json"
HELD_STOP_RECORD = ".held_stop.json"
STAGING_PREFIX = ".staging_"
TRASH_PREFIX = ".trash_"
PRUNING_PREFIX = ".pruning_"
ABANDONED_INFIX = ".abandoned-"

# A checkpoint directory.
MANIFEST = "manifest.json"
BAD_MARKER = ".bad"
STEP_SCHEDULER = "step_scheduler.json"
CONFIG = "config.yaml"
COMMON = "common.json"
"""MindSpore Transformers' per-checkpoint training info (``CommonInfo``)."""
LOSSES = "losses.json"
"""NeMo AutoModel's per-checkpoint losses (``train_loss``, ``val_loss``), plus the training rows."""
MODEL_DIR = "model"
OPTIM_DIR = "optim"
RANK_STATE_DIR = "rank_state"
RNG_DIR = "rng"  # older checkpoints (read only)
DATALOADER_DIR = "dataloader"  # older checkpoints (read only)
EXTRA_DIR = "extra"
RANK_MANIFESTS_DIR = "rank_manifests"
RANK_MANIFEST_BLOCK = 64
"""Ranks per rank manifest file: a rank reads one file of about 64 ranks' entries at a resume
(~50 KB for a 7B model's FSDP2 shards) and the manifest lists N/64 of them."""
SKELETON = f"{OPTIM_DIR}/skeleton.json"
LR_SCHEDULER = f"{OPTIM_DIR}/lr_scheduler.json"

# Inside model/ (and a Hugging Face directory).
SHARD_INDEX = "shard_index.json"
CONSOLIDATE_SH = "consolidate.sh"
HF_METADATA = "hf_metadata"
CONSOLIDATED = "consolidated"
BUNDLE_MANIFEST = "bundle_manifest.json"
"""Written last into a bundle made after its checkpoint was published (consolidate.sh,
``resilience consolidate``): each file's size and digest, for ``resilience verify``. A bundle
written with the checkpoint (``save_consolidated``) is in the checkpoint's own manifest instead."""
HF_INDEX = "model.safetensors.index.json"
HF_SINGLE_FILE = "model.safetensors"
HF_CONFIG = "config.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DCP_METADATA = ".metadata"  # DCP's own index (a pickle) in model/ (torch_save) and optim/
DCP_SUFFIX = ".distcp"
SAFETENSORS_SUFFIX = ".safetensors"
MODEL_SHARD_GLOB = "shard-*-model-*-of-*.safetensors"
OPTIM_SHARD_GLOB = "shard-*-of-*.safetensors"  # inside OPTIM_DIR: optim_shard_name()


def is_optim_file(rel: str) -> bool:
    """Whether ``rel`` (relative to the checkpoint) is one of the optimizer's own files of state
    every rank holds in full (``optim/shard-0000K-of-0000N.safetensors``), read whole at a load;
    not a sharded optimizer's pieces (``optim/shard-0000K-model-...``, which OPTIM_SHARD_GLOB
    matches too: each rank reads only the pieces overlapping its blocks)."""
    return fnmatch.fnmatch(rel, f"{OPTIM_DIR}/{OPTIM_SHARD_GLOB}") and not fnmatch.fnmatch(rel, f"{OPTIM_DIR}/{MODEL_SHARD_GLOB}")


# The same, relative to the checkpoint directory.
MODEL_SHARD_INDEX = f"{MODEL_DIR}/{SHARD_INDEX}"
MODEL_CONSOLIDATE_SH = f"{MODEL_DIR}/{CONSOLIDATE_SH}"
MODEL_HF_METADATA = f"{MODEL_DIR}/{HF_METADATA}"
MODEL_CONSOLIDATED = f"{MODEL_DIR}/{CONSOLIDATED}"

_NAME = re.compile(r"^epoch_(\d+)_step_(\d+)$")


def needed_to_resume(rel: str) -> bool:
    """Whether a resume reads manifest entry ``rel``: every file but the Hugging Face bundle
    written with the checkpoint (``model/consolidated/``), an export that a user may delete or
    build again in another dtype without touching the training state."""
    return not rel.startswith(MODEL_CONSOLIDATED + "/")


def checkpoint_name(epoch: int, global_step: int) -> str:
    """``epoch_<E>_step_<S>``: E the 0-based epoch of step S, S the number of optimizer steps done."""
    return f"epoch_{epoch}_step_{global_step}"


def parse_checkpoint_name(name: str) -> tuple[int, int] | None:
    """``(epoch, global_step)`` for a checkpoint directory name, else ``None``."""
    match = _NAME.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def checkpoint_counters(name: str) -> tuple[int, int]:
    """``(epoch, global_step)`` of a name known to be a checkpoint's (one :func:`list_checkpoints`
    returned); ``ValueError`` for any other name."""
    parsed = parse_checkpoint_name(name)
    if parsed is None:
        raise ValueError(f"{name!r} is not a checkpoint name (epoch_<E>_step_<S>)")
    return parsed


class Directory(Protocol):
    """What :func:`list_checkpoints` reads of a directory: a ``Path`` or an ``ObjectPath`` (this
    module imports no storage code)."""

    @property
    def name(self) -> str:
        """The last component, as ``Path.name``."""

    def __truediv__(self, other: str) -> Directory: ...

    def is_dir(self) -> bool:
        """As ``Path.is_dir`` (an object prefix with keys under it, for an ``ObjectPath``)."""

    def iterdir(self) -> Iterator[Self]:
        """The entries directly under it, as ``Path.iterdir``."""

    def is_file(self) -> bool:
        """As ``Path.is_file`` (an object, for an ``ObjectPath``)."""

    def is_symlink(self) -> bool:
        """As ``Path.is_symlink`` (never, for an ``ObjectPath``)."""


_D = TypeVar("_D", bound=Directory)


def list_checkpoints(root: _D) -> list[_D]:
    """Checkpoint directories under ``root`` (published ones only), newest global step first. On
    object storage, where a prefix exists as soon as one object lies under it, only those holding
    their manifest (the commit point; one HEAD each)."""
    found = []
    on_store = getattr(root, "store", None) is not None  # an ObjectPath (layout.py imports no storage code)
    committed = (lambda child: (child / MANIFEST).is_file()) if on_store else (lambda child: True)
    if root.is_dir():
        for child in root.iterdir():
            parsed = parse_checkpoint_name(child.name)
            if parsed and child.is_dir() and not child.is_symlink() and committed(child):
                found.append((parsed[1], parsed[0], child))
    return [path for _, _, path in sorted(found, reverse=True)]


def rank_file(kind: str, rank: int, suffix: str) -> str:
    """Relative path of a per-rank file, e.g. ``rng/rank_00001.safetensors``."""
    return f"{kind}/rank_{rank:05d}{suffix}"


def rank_state_file(rank: int) -> str:
    """``rank_state/rank_<R>.safetensors``: global rank R's RNG states and data position, one file
    per rank and save (:func:`~resilience.state.rng.write_rng_state`)."""
    return rank_file(RANK_STATE_DIR, rank, SAFETENSORS_SUFFIX)


def rng_rank_file(rank: int) -> str:
    """``rng/rank_<R>.safetensors``: global rank R's RNG states, in a checkpoint written before
    :func:`rank_state_file` (read, never written)."""
    return rank_file(RNG_DIR, rank, SAFETENSORS_SUFFIX)


def dataloader_rank_file(rank: int) -> str:
    """``dataloader/rank_<R>.json``: rank R's position in its data, in a checkpoint written before
    :func:`rank_state_file` (read, never written)."""
    return rank_file(DATALOADER_DIR, rank, ".json")


def rank_manifest_file(first: int, last: int) -> str:
    """``rank_manifests/ranks_<first>-<last>.json``: the own files of global ranks ``first..last``
    (inclusive), one block of :data:`RANK_MANIFEST_BLOCK`."""
    return f"{RANK_MANIFESTS_DIR}/ranks_{first:05d}-{last:05d}.json"


def extra_files(name: str) -> tuple[str, str]:
    """``(extra/<name>.json, extra/<name>.safetensors)``: registered state ``name``'s JSON and tensors."""
    return f"{EXTRA_DIR}/{name}.json", f"{EXTRA_DIR}/{name}{SAFETENSORS_SUFFIX}"


def model_shard_name(shard: int, num_shards: int, file_index: int = 1, num_files: int = 1) -> str:
    """NeMo AutoModel's shard name: ``shard-0000K-model-0000I-of-0000N.safetensors`` (1-based)."""
    return f"shard-{shard:05d}-model-{file_index:05d}-of-{num_files:05d}.safetensors"


def optim_shard_name(shard: int, num_shards: int) -> str:
    """``shard-0000K-of-0000N.safetensors`` (1-based): the optimizer state file rank K-1 of N writes
    (inside ``OPTIM_DIR``)."""
    return f"shard-{shard:05d}-of-{num_shards:05d}{SAFETENSORS_SUFFIX}"


def hf_file_name(index: int, count: int) -> str:
    """Hugging Face's sharded weight file name, ``model-0000I-of-0000N.safetensors`` (1-based)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def pointer_text_name(name: str) -> str:
    """The text form of pointer ``name`` (``LATEST.txt``), written where symlinks fail."""
    return f"{name}{POINTER_SUFFIX}"
