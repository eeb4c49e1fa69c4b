"""Names on disk: checkpoint directories, staging directories, pointers, the manifest.

::

    checkpoint_dir/
      LATEST -> epoch_1_step_120          relative symlink (LATEST.txt where symlinks fail)
      epoch_1_step_120/
        manifest.json                     written last: the directory is valid only with it
        step_scheduler.json  config.yaml
        model/shard-00001-model-00001-of-00001.safetensors
        optim/.metadata  optim/__0_0.distcp ...  optim/skeleton.json  optim/lr_scheduler.json
        rng/rank_00000.safetensors ...    one per global rank
        dataloader/rank_00000.json ...    one per data-parallel rank
      .staging_epoch_1_step_140/          a save in progress (removed at the next start)
"""

from __future__ import annotations

import re
from pathlib import Path

MANIFEST = "manifest.json"
LATEST = "LATEST"
STAGING_PREFIX = ".staging_"
TRASH_PREFIX = ".trash_"
BAD_MARKER = ".bad"
_NAME = re.compile(r"^epoch_(\d+)_step_(\d+)$")


def checkpoint_name(epoch: int, global_step: int) -> str:
    """``epoch_<E>_step_<S>``: E the 0-based epoch of step S, S the number of optimizer steps done."""
    return f"epoch_{epoch}_step_{global_step}"


def parse_checkpoint_name(name: str) -> tuple[int, int] | None:
    """``(epoch, global_step)`` for a checkpoint directory name, else ``None``."""
    match = _NAME.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under ``root`` (published ones only), newest global step first."""
    found = []
    if root.is_dir():
        for child in root.iterdir():
            parsed = parse_checkpoint_name(child.name)
            if parsed and child.is_dir() and not child.is_symlink():
                found.append((parsed[1], parsed[0], child))
    return [path for _, _, path in sorted(found, reverse=True)]


def rank_file(kind: str, rank: int, suffix: str) -> str:
    """Relative path of a per-rank file, e.g. ``rng/rank_00001.safetensors``."""
    return f"{kind}/rank_{rank:05d}{suffix}"


def model_shard_name(shard: int, num_shards: int, file_index: int = 1, num_files: int = 1) -> str:
    """NeMo AutoModel's shard name: ``shard-0000K-model-0000I-of-0000N.safetensors`` (1-based)."""
    return f"shard-{shard:05d}-model-{file_index:05d}-of-{num_files:05d}.safetensors"
