"""What a sharded safetensors ``model/`` directory holds, read without loading a tensor.

``shard_index.json`` (written with the shards) gives every key's shard, output file index, dtype,
shape and original dtype, the tied keys stored once (``aliases``) and the aliases a Hugging Face
bundle leaves out (``bundle_omits``); a checkpoint written before it existed is read from the
shards' safetensors headers. Consolidation (:mod:`resilience.checkpoint.formats.consolidate`) and the
model loader (:mod:`resilience.checkpoint.formats.model_io`) read a model directory through here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from resilience.checkpoint.formats.shard_files import overlapping
from resilience.checkpoint.formats.shard_rule import Rule
from resilience.checkpoint.layout import (
    ADAPTER_CONFIG,
    DCP_METADATA,
    HF_CONFIG,
    HF_METADATA,
    MODEL_DIR,
    MODEL_SHARD_GLOB,
    SHARD_INDEX,
)
from resilience.checkpoint.storage.safetensors_file import ST_DTYPES, read_safetensors_header


class ConsolidateError(ValueError):
    """A directory cannot be consolidated; the message says which and why."""


def read_layout(model_dir: Path) -> dict[str, dict[str, Any]]:
    """``{key: {"shard", "file_index", "num_files", "dtype", "shape", "original_dtype", "pieces"}}``
    of the sharded safetensors in ``model_dir``, from ``shard_index.json`` (or, for a checkpoint
    written before it existed, from the shards' headers). ``shape`` is the global shape;
    ``pieces`` lists where the tensor is stored (``{"file", "offsets", "shape"}``, see
    :mod:`~resilience.checkpoint.formats.shard_files`); ``shard`` names the file of a tensor stored
    whole, and is ``None`` for one stored in pieces (a sharded model's).

    Raises:
        ConsolidateError: ``model_dir`` holds no sharded safetensors model (PEFT adapters, DCP).
    """
    layout, _ = read_index(model_dir, expand=True)
    return layout


def read_index(model_dir: Path, *, expand: bool = False) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """``(layout, aliases)`` of ``model_dir`` from one parse of ``shard_index.json`` (see
    :func:`read_layout` and :func:`read_aliases`). Without ``expand`` a tensor stored by its
    sharding rule (version 3) has ``"rule"`` (a :class:`Rule`) and no ``"pieces"``: a loader
    asks :func:`~resilience.checkpoint.formats.shard_files.overlapping` for the pieces it needs.

    Raises:
        ConsolidateError: ``model_dir`` holds no sharded safetensors model (PEFT adapters, DCP).
    """
    index_path = model_dir / SHARD_INDEX
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        return layout_of(index, expand=expand), _aliases(index)
    return _layout_from_headers(model_dir), {}


def layout_of(index: dict[str, Any], *, expand: bool = False) -> dict[str, dict[str, Any]]:
    """The layout (see :func:`read_index`) of a ``shard_index.json`` document ``index``."""
    layout = {}
    for key, info in index["tensors"].items():
        entry = {**info, "shard": index["weight_map"].get(key), "num_files": index["num_files"]}
        if "rule" in info:
            entry["rule"] = Rule.from_json(info["rule"])
            if expand:
                entry["pieces"] = overlapping(entry)
        elif "pieces" not in info:  # version 1: every key whole, in its weight_map file
            entry["pieces"] = [{"file": index["weight_map"][key], "offsets": [0] * len(info["shape"]), "shape": info["shape"]}]
        layout[key] = entry
    return layout


def _layout_from_headers(model_dir: Path) -> dict[str, dict[str, Any]]:
    """The layout of a checkpoint written before ``shard_index.json`` existed."""
    shards = shard_files(model_dir)
    layout = {}
    for shard in shards:
        _, _, _, file_index, _, num_files = shard.stem.split("-")
        header = read_safetensors_header(shard)
        originals = json.loads(header.get("__metadata__", {}).get("original_dtypes", "{}"))
        for key, info in header.items():
            if key != "__metadata__":
                layout[key] = {
                    "shard": shard.name,
                    "file_index": int(file_index),
                    "num_files": int(num_files),
                    "dtype": ST_DTYPES.get(info["dtype"], info["dtype"]),
                    "shape": info["shape"],
                    "original_dtype": originals.get(key),
                    "pieces": [{"file": shard.name, "offsets": [0] * len(info["shape"]), "shape": info["shape"]}],
                }
    return layout


def shard_files(model_dir: Path) -> list[Path]:
    """The ``shard-*-model-*-of-*.safetensors`` files of ``model_dir``, sorted by name.

    Raises:
        ConsolidateError: there are none; the message says what ``model_dir`` holds instead
            (PEFT adapters, a DCP model, nothing).
    """
    shards = sorted(model_dir.glob(MODEL_SHARD_GLOB))
    if shards:
        return shards
    if (model_dir / ADAPTER_CONFIG).is_file():
        raise ConsolidateError(f"{model_dir} holds PEFT adapters: they are already a Hugging Face bundle (load it with peft)")
    if (model_dir / DCP_METADATA).is_file():
        raise ConsolidateError(f"{model_dir} holds a DCP model (model_save_format: torch_save); consolidation needs model_save_format: safetensors")
    raise ConsolidateError(f"{model_dir}: no {MODEL_SHARD_GLOB} files")


def read_aliases(model_dir: Path) -> dict[str, str]:
    """``{alias: canonical}``: the tied keys stored once (``shard_index.json``'s ``aliases``);
    ``{}`` for a checkpoint without them (no ties, or written before they were recorded)."""
    try:
        return _aliases(json.loads((model_dir / SHARD_INDEX).read_text()))
    except (OSError, ValueError):
        return {}


def _aliases(index: Any) -> dict[str, str]:
    aliases = index.get("aliases") if isinstance(index, dict) else None
    return {str(k): str(v) for k, v in aliases.items()} if isinstance(aliases, dict) else {}


def read_bundle_omits(model_dir: Path, aliases: dict[str, str]) -> set[str]:
    """The aliases the bundle leaves out: those the model declares tied, so that
    ``from_pretrained`` ties them again (``shard_index.json``'s ``bundle_omits``, recorded at save
    time from :func:`hf_export.tied_weight_keys`). Every other alias of ``aliases`` is exported as
    a copy of its canonical tensor.

    A checkpoint saved before ``bundle_omits`` was recorded: all its aliases are left out when its
    ``hf_metadata/config.json`` says ``tie_word_embeddings: true`` (the Hugging Face models those
    checkpoints tied), none otherwise (no config, ``false``, or unreadable), so a bundle may hold
    a redundant copy but never lacks a weight that ``from_pretrained`` would initialise randomly.
    """
    try:
        index = json.loads((model_dir / SHARD_INDEX).read_text())
    except (OSError, ValueError):
        index = {}
    omits = index.get("bundle_omits") if isinstance(index, dict) else None
    if isinstance(omits, list):
        return {str(key) for key in omits} & set(aliases)
    try:
        config = json.loads((model_dir / HF_METADATA / HF_CONFIG).read_text())
    except (OSError, ValueError):
        return set()
    return set(aliases) if isinstance(config, dict) and config.get("tie_word_embeddings") is True else set()


def with_alias_copies(layout: dict[str, dict[str, Any]], aliases: dict[str, str], omits: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``layout`` plus an entry per alias the bundle holds as a copy (every alias not in
    ``omits``): its canonical key's entry (same dtype, shape, output file) with ``"source"``, the
    key whose tensor it copies. Entries of ``layout`` itself are their own source.

    Raises:
        ConsolidateError: an alias's canonical key is not in ``layout``.
    """
    out = dict(layout)
    for alias, canonical in sorted(aliases.items()):
        if alias in omits:
            continue
        if canonical not in layout:
            raise ConsolidateError(f"{SHARD_INDEX} ties {alias} to {canonical}, which is not saved")
        out[alias] = {**layout[canonical], "source": canonical}
    return out


def resolve_model_dir(directory: Path) -> Path:
    """``directory`` itself, or ``directory/model`` when given a checkpoint directory."""
    directory = Path(directory)
    if (directory / MODEL_DIR).is_dir() and not (directory / SHARD_INDEX).exists():
        return directory / MODEL_DIR
    return directory
