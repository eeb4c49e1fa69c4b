"""The Hugging Face side of a checkpoint: model detection, original dtypes, side files, PEFT adapters.

``transformers`` and ``peft`` are optional (extras ``interop``): nothing here imports them unless
the model already is one of their objects (then they are in ``sys.modules``), so plain PyTorch
users never pay for them.

Original dtypes follow NeMo AutoModel's consolidated export: when the model was loaded with
``from_pretrained`` from safetensors whose headers are still readable (a local directory or the
Hugging Face cache), each tensor's dtype *in those headers* is its original dtype, recorded at
save time so a bf16 model trained in fp32 is exported back as bf16. A model built from a config
alone has no original headers; its saved dtypes are kept.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

from resilience.checkpoint.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, HF_CONFIG, HF_INDEX, HF_SINGLE_FILE
from resilience.checkpoint.storage.safetensors_file import ST_DTYPES, read_safetensors_header


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP / DataParallel / ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def is_peft_model(model: torch.nn.Module) -> bool:
    """True for a ``peft.PeftModel`` (possibly wrapped): only its adapters are checkpointed."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(unwrap(model), peft.PeftModel)


def peft_unsaved_trainable(model: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters of a PEFT ``model`` that its adapter checkpoint would not
    hold (peft's ``get_peft_model_state_dict``: the adapters and ``modules_to_save``), such as a base
    model's norm unfrozen by hand; matched by storage, so peft's renaming of keys does not matter."""
    from peft import get_peft_model_state_dict

    inner = unwrap(model)
    saved = {t.untyped_storage().data_ptr() for t in get_peft_model_state_dict(inner).values() if isinstance(t, torch.Tensor)}
    return [name for name, p in inner.named_parameters() if p.requires_grad and p.untyped_storage().data_ptr() not in saved]


def is_hf_model(model: torch.nn.Module) -> bool:
    """True for a ``transformers.PreTrainedModel`` (possibly wrapped)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(unwrap(model), transformers.PreTrainedModel)


def tied_weight_keys(model: torch.nn.Module) -> set[str]:
    """The state-dict keys a Hugging Face model declares tied to another (``lm_head.weight`` with
    ``tie_word_embeddings``): the ones ``save_pretrained`` leaves out and ``from_pretrained``
    ties again. Empty for any other model."""
    if not is_hf_model(model):
        return set()
    inner = unwrap(model)
    declared = getattr(inner, "all_tied_weights_keys", None)  # transformers >= 5: {tied key: source key}
    if isinstance(declared, dict):
        return set(declared)
    config: Any = getattr(inner, "config", None)
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text_config, "tie_word_embeddings", True) is False:
        return set()  # transformers 4 lists the keys per class, whatever the config: nothing is re-tied
    keys: set[str] = set()
    for prefix, module in inner.named_modules():  # transformers 4: per-class lists (or dicts) of names
        names = getattr(module, "_tied_weights_keys", None) or ()
        keys.update(f"{prefix}.{name}" if prefix else str(name) for name in names)
    return keys


def _original_files(model: torch.nn.Module) -> list[Path]:
    """The safetensors files ``model`` was loaded from, when they are still readable."""
    name = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    if not name:
        return []
    names = (HF_INDEX, HF_SINGLE_FILE)
    directory = Path(name)
    if not directory.is_dir():
        snapshot = _cached_snapshot(model, name, names)
        if snapshot is None:
            return []
        directory = snapshot
    index = directory / names[0]
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / f for f in files if (directory / f).is_file()]
    single = directory / names[1]
    return [single] if single.is_file() else []


def _cached_snapshot(model: torch.nn.Module, repo_id: str, names: tuple[str, ...]) -> Path | None:
    """The Hugging Face cache directory holding ``repo_id``'s files (never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    revision = getattr(getattr(model, "config", None), "_commit_hash", None)
    for filename in names:
        try:
            found = try_to_load_from_cache(repo_id, filename, revision=revision)
        except Exception:  # noqa: BLE001 - not a repo id (a moved local path, say): no headers
            return None
        if isinstance(found, str):
            return Path(found).parent
    return None


def original_tensors(model: torch.nn.Module) -> dict[str, dict[str, str]]:
    """``{key: {"dtype": torch dtype name, "file": file name}}`` from the original Hugging Face
    safetensors headers of ``model`` (see the module docstring); ``{}`` when they are unknown."""
    if not is_hf_model(model):
        return {}
    found: dict[str, dict[str, str]] = {}
    for path in _original_files(unwrap(model)):
        try:
            header = read_safetensors_header(path)
        except (OSError, ValueError):
            return {}  # half-readable originals would restore some tensors and not others
        for key, info in header.items():
            if key != "__metadata__":
                found[key] = {"dtype": ST_DTYPES.get(info["dtype"], info["dtype"]), "file": path.name}
    return found


def write_hf_metadata(directory: Path, model: torch.nn.Module, tokenizer: Any = None, *, model_files: bool = True) -> list[str]:
    """Write ``config.json`` and ``generation_config.json`` (a Hugging Face model, ``model_files``)
    and the tokenizer's files (``tokenizer.save_pretrained``) into ``directory``; returns the names
    written, relative to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    before = {p for p in directory.rglob("*") if p.is_file()}
    inner: Any = unwrap(model)  # a transformers/peft model: its own attributes, which nn.Module's typing does not know
    if is_peft_model(inner):
        inner = inner.get_base_model()
    if model_files and is_hf_model(inner):
        config = json.loads(inner.config.to_json_string(use_diff=True))
        config["architectures"] = [type(inner).__name__]  # what save_pretrained records
        (directory / HF_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = getattr(inner, "generation_config", None)
        if generation is not None and inner.can_generate():
            generation.save_pretrained(str(directory))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    after = {p for p in directory.rglob("*") if p.is_file()}
    return sorted(str(p.relative_to(directory)) for p in after - before)


def save_adapter(directory: Path, model: torch.nn.Module) -> list[str]:
    """Write a PEFT model's adapters as ``peft`` does: ``adapter_model.safetensors`` and
    ``adapter_config.json`` in ``directory`` (further adapters in ``directory/<name>/``).

    Returns the paths written, relative to ``directory``.
    """
    inner: Any = unwrap(model)  # a transformers/peft model: its own attributes, which nn.Module's typing does not know
    directory.mkdir(parents=True, exist_ok=True)
    before = {p for p in directory.rglob("*") if p.is_file()}
    # PeftModel.save_pretrained sets inference_mode on the live config and resets it only when the
    # save succeeds: saving from a copy keeps a failed save from changing the training model.
    live = inner.peft_config
    inner.peft_config = copy.deepcopy(live)
    try:
        inner.save_pretrained(str(directory), safe_serialization=True)
    finally:
        inner.peft_config = live
    for readme in directory.rglob("README.md"):  # a generated model card, not checkpoint state
        if readme not in before:
            readme.unlink()
    after = {p for p in directory.rglob("*") if p.is_file()}
    return sorted(str(p.relative_to(directory)) for p in after - before)


def load_adapter(directory: Path, model: torch.nn.Module) -> None:
    """Load adapters written by :func:`save_adapter` into a PEFT model in place.

    Raises:
        ValueError: ``model`` is not a PEFT model, or an adapter tensor has no place in it.
        FileNotFoundError: an adapter of ``model`` has no saved weights.
    """
    if not is_peft_model(model):
        raise ValueError(f"{directory} holds PEFT adapters ({ADAPTER_CONFIG}) but the model is a {type(unwrap(model)).__name__}, not a peft.PeftModel")
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    inner: Any = unwrap(model)  # a transformers/peft model: its own attributes, which nn.Module's typing does not know
    for name in inner.peft_config:
        where = directory if name == "default" else directory / name
        weights = where / ADAPTER_WEIGHTS
        if not weights.is_file():
            raise FileNotFoundError(f"{weights}: no saved weights for adapter {name!r}")
        result = set_peft_model_state_dict(inner, load_file(str(weights)), adapter_name=name)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise ValueError(f"{weights}: tensors with no place in the model: {unexpected[:5]}")
