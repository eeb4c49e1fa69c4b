"""Tied weights (two keys, one tensor) are stored once with the tie recorded, and come back tied
into a model that ties them and with equal values into one that does not. The Hugging Face bundle
holds a copy of every alias the model does not declare tied (nothing would tie it again).

Real saves through ``resilient_loop``; the shards and the Hugging Face bundle are read back from
disk. The Hugging Face side (``from_pretrained`` of a tied bundle) is in ``test_hf_interop.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from resilience import resilient_loop
from resilience.checkpoint.formats import model_io
from resilience.checkpoint.formats.consolidate import consolidate
from resilience.checkpoint.layout import LATEST
from resilience.checkpoint.storage.durable import record
from resilience.checkpoint.storage.manifest import validate
from resilience.checkpoint.storage.safetensors_file import read_safetensors_header

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # torchdata / DCP single-process notices
    pytest.mark.usefixtures("no_launcher_environment"),
]

VOCAB, DIM = 11, 6


class TinyLM(torch.nn.Module):
    """Embedding, a hidden layer and an output head; ``tied``: the head's weight is the embedding's."""

    def __init__(self, tied: bool = True):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.mid = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def batches(n: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (4, 5), generator=gen) for _ in range(n)]


def train(root: Path, max_steps: int, model: TinyLM | None = None, **checkpoint) -> TinyLM:
    torch.manual_seed(0)
    model = model or TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    cfg = {"step_scheduler": {"num_epochs": 1, "max_steps": max_steps}, "checkpoint": {"checkpoint_dir": str(root), **checkpoint}}
    with resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=batches()) as loop:
        for step in loop:
            ids = step.batch
            loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert int(loop.exit_code) == 0
    return model


def stored_keys(model_dir: Path, pattern: str) -> list[str]:
    keys = []
    for path in sorted(model_dir.glob(pattern)):
        keys += [k for k in read_safetensors_header(path) if k != "__metadata__"]
    return keys


def test_tied_weights_are_stored_once_with_the_tie_recorded_and_an_undeclared_tie_is_copied_into_the_bundle(tmp_path):
    model = train(tmp_path / "ck", max_steps=3)  # save_consolidated: final (default)
    final = (tmp_path / "ck" / LATEST).resolve()
    validate(final)  # digests of what was written, as written
    model_dir = final / "model"
    assert sorted(stored_keys(model_dir, "shard-*.safetensors")) == ["emb.weight", "mid.bias", "mid.weight"]
    index = json.loads((model_dir / "shard_index.json").read_text())
    assert index["aliases"] == {"head.weight": "emb.weight"}
    assert "head.weight" not in index["tensors"] and "head.weight" not in index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for k, t in model.state_dict().items() if k != "head.weight")
    assert index["bundle_omits"] == []  # not a Hugging Face model: nothing would tie it again on loading
    bundle = model_dir / "consolidated"
    assert sorted(stored_keys(bundle, "model-*.safetensors")) == ["emb.weight", "head.weight", "mid.bias", "mid.weight"]
    bundle_index = json.loads((bundle / "model.safetensors.index.json").read_text())
    assert bundle_index["weight_map"]["head.weight"] == bundle_index["weight_map"]["emb.weight"]
    assert bundle_index["metadata"]["tied_weights"] == {"head.weight": "emb.weight"}
    assert bundle_index["metadata"]["total_size"] == sum(t.numel() * 4 for t in model.state_dict().values())
    exported = load_file(str(bundle / bundle_index["weight_map"]["head.weight"]))
    assert torch.equal(exported["head.weight"], model.emb.weight.detach()) and torch.equal(exported["emb.weight"], model.emb.weight.detach())


def test_a_checkpoint_saved_before_bundle_omits_copies_its_aliases_unless_its_config_declares_tied_embeddings(tmp_path):
    train(tmp_path / "ck", max_steps=2, save_consolidated=False)
    model_dir = (tmp_path / "ck" / LATEST).resolve() / "model"
    index_path = model_dir / "shard_index.json"
    index = json.loads(index_path.read_text())
    del index["bundle_omits"]  # as written before the field existed, with a manifest that says so
    index_path.write_text(json.dumps(index))
    manifest_path = model_dir.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["model/shard_index.json"] = record(model_dir.parent, "model/shard_index.json").manifest_entry()
    manifest_path.write_text(json.dumps(manifest))
    out = consolidate(model_dir, tmp_path / "no_config", progress=False)
    assert sorted(stored_keys(out, "model-*.safetensors")) == ["emb.weight", "head.weight", "mid.bias", "mid.weight"]
    (model_dir / "hf_metadata").mkdir()
    (model_dir / "hf_metadata" / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    out = consolidate(model_dir, tmp_path / "tied_config", progress=False)
    assert sorted(stored_keys(out, "model-*.safetensors")) == ["emb.weight", "mid.bias", "mid.weight"]
    assert json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["tied_weights"] == {"head.weight": "emb.weight"}


def test_a_tied_checkpoint_loads_into_a_fresh_untied_model_with_the_stored_tensor_in_both_parameters(tmp_path):
    trained = train(tmp_path / "ck", max_steps=3)
    fresh = TinyLM(tied=False)
    assert not torch.equal(fresh.head.weight, trained.emb.weight)
    model_io.load_model(tmp_path / "ck" / LATEST, fresh)
    assert torch.equal(fresh.emb.weight, trained.emb.weight) and torch.equal(fresh.head.weight, trained.emb.weight)
    assert fresh.head.weight is not fresh.emb.weight, "separate parameters stay separate (documented)"
    tied = TinyLM(tied=True)
    model_io.load_model(tmp_path / "ck" / LATEST, tied)
    assert tied.head.weight is tied.emb.weight and torch.equal(tied.emb.weight, trained.emb.weight)


def test_a_tied_model_resumed_from_its_checkpoint_stays_tied_and_matches_an_uninterrupted_run(tmp_path):
    straight = train(tmp_path / "straight", max_steps=5, save_consolidated=False)
    train(tmp_path / "parts", max_steps=2, save_consolidated=False)
    resumed = train(tmp_path / "parts", max_steps=5, model=TinyLM(), save_consolidated=False)
    assert resumed.head.weight is resumed.emb.weight
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_the_async_save_of_a_tied_model_stores_the_tensor_once_too(tmp_path):
    train(tmp_path / "ck", max_steps=2, is_async=True, save_consolidated=False)
    model_dir = (tmp_path / "ck" / LATEST).resolve() / "model"
    assert sorted(stored_keys(model_dir, "shard-*.safetensors")) == ["emb.weight", "mid.bias", "mid.weight"]
    assert json.loads((model_dir / "shard_index.json").read_text())["aliases"] == {"head.weight": "emb.weight"}
