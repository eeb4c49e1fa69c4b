"""Hugging Face interop: what a checkpoint exports loads with ``transformers`` and ``peft`` as is.

Every model here is built from a config (no download); a "pretrained" base is a tiny model saved
with ``save_pretrained`` into a temporary directory and loaded from there, offline.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach the Hub

from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast  # noqa: E402

from resilience import resilient_loop  # noqa: E402
from resilience.checkpoint.formats import model_io  # noqa: E402
from resilience.checkpoint.formats.consolidate import consolidate  # noqa: E402
from resilience.checkpoint.layout import LATEST  # noqa: E402
from resilience.checkpoint.storage.manifest import validate  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # torchdata / DCP single-process notices
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # transformers deprecations inside peft
]

VOCAB = 64


@pytest.fixture(autouse=True)
def offline_and_no_launcher(monkeypatch, no_launcher_environment):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")


def batches(n: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (2, 12), generator=gen) for _ in range(n)]


def train(model, root: Path, *, max_steps: int, ckpt_every_steps=None, tokenizer=None, **checkpoint) -> None:
    """Train ``model`` under resilient_loop for ``max_steps`` steps (AdamW, causal LM loss)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = {
        "step_scheduler": {"num_epochs": 1, "max_steps": max_steps, "ckpt_every_steps": ckpt_every_steps},
        "checkpoint": {"checkpoint_dir": str(root), **checkpoint},
    }
    loop = resilient_loop(cfg, model=model, optimizer=optimizer, dataloader=batches(), tokenizer=tokenizer)
    with loop:
        for step in loop:
            optimizer.zero_grad()
            model(input_ids=step.batch, labels=step.batch).loss.backward()
            optimizer.step()
    assert int(loop.exit_code) == 0


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_tiny_causal_lm_trained_under_resilient_loop_loads_with_from_pretrained_with_equal_logits(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config())  # fp32, config-only weights
    tokenizer = tiny_tokenizer()
    root = tmp_path / "ck"
    train(model, root, max_steps=3, ckpt_every_steps=2, tokenizer=tokenizer)  # save_consolidated: final (default)

    final = root / LATEST
    consolidated = final / "model" / "consolidated"
    names = {p.name for p in consolidated.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    index = json.loads((consolidated / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict()) and index["metadata"]["total_size"] > 0
    validate(final.resolve())  # the bundle is in the manifest: sizes and checksums hold
    manifest = json.loads((final / "manifest.json").read_text())["files"]
    assert "model/consolidated/model-00001-of-00001.safetensors" in manifest and "model/consolidate.sh" in manifest
    # `final`: the periodic checkpoint of step 2 stays sharded, with its helper script
    assert not (root / "epoch_0_step_2" / "model" / "consolidated").exists()
    assert (root / "epoch_0_step_2" / "model" / "consolidate.sh").is_file()

    loaded = AutoModelForCausalLM.from_pretrained(consolidated)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    assert AutoTokenizer.from_pretrained(consolidated)("w1 w2 w3")["input_ids"] == tokenizer("w1 w2 w3")["input_ids"]


def test_tied_embeddings_are_exported_as_save_pretrained_writes_them_and_load_tied_with_from_pretrained(tmp_path):
    torch.manual_seed(0)
    config = tiny_config()
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    root = tmp_path / "ck"
    train(model, root, max_steps=3, ckpt_every_steps=2)
    model_dir = root / LATEST / "model"

    # as save_pretrained writes a tied model: lm_head.weight left out, re-tied from config.json
    reference = tmp_path / "save_pretrained"
    model.save_pretrained(reference)
    expected_keys = set(load_file(str(reference / "model.safetensors")))
    consolidated = model_dir / "consolidated"
    index = json.loads((consolidated / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == expected_keys and "lm_head.weight" not in expected_keys
    assert set(load_file(str(consolidated / "model-00001-of-00001.safetensors"))) == expected_keys
    shard_index = json.loads((model_dir / "shard_index.json").read_text())
    assert shard_index["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}  # stored once in the shards too

    loaded = AutoModelForCausalLM.from_pretrained(consolidated)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))
    assert torch.equal(logits(loaded, ids), logits(model, ids))

    # a model untied by construction gets the stored embedding in its separate lm_head too
    untied_config = tiny_config()
    untied_config.tie_word_embeddings = False
    untied = AutoModelForCausalLM.from_config(untied_config)
    model_io.load_model(root / LATEST, untied)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert torch.equal(untied.lm_head.weight, model.model.embed_tokens.weight)
    assert torch.equal(logits(untied, ids), logits(model, ids))


def test_embeddings_tied_by_hand_against_the_config_are_in_both_bundles_and_load_with_from_pretrained(tmp_path):
    """A Llama whose config says ``tie_word_embeddings=False`` but whose ``lm_head.weight`` was tied
    to the embedding by hand: ``from_pretrained`` would not re-tie it, so both the bundle written
    at save time and a later ``resilience consolidate`` (worker processes, several files) must
    hold ``lm_head.weight`` as a copy, or it would be initialised randomly."""
    torch.manual_seed(0)
    config = tiny_config()
    config.tie_word_embeddings = False
    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(config).save_pretrained(base, max_shard_size="40KB")  # several files
    model = AutoModelForCausalLM.from_pretrained(base)
    model.lm_head.weight = model.model.embed_tokens.weight
    root = tmp_path / "ck"
    train(model, root, max_steps=3)
    model_dir = (root / LATEST).resolve() / "model"
    shard_index = json.loads((model_dir / "shard_index.json").read_text())
    assert shard_index["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}  # stored once in the shards
    validate(model_dir.parent)  # the bundle's copy is in the manifest as written

    later = tmp_path / "later"
    run = subprocess.run(
        [sys.executable, "-m", "resilience", "consolidate", str(model_dir), "--output", str(later), "--nproc", "2", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert run.returncode == 0, run.stderr
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))
    for bundle in (model_dir / "consolidated", later):
        index = json.loads((bundle / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(model.state_dict()), bundle
        assert len(set(index["weight_map"].values())) > 1, "several output files: worker processes ran"
        stored = load_file(str(bundle / index["weight_map"]["lm_head.weight"]))["lm_head.weight"]
        assert torch.equal(stored, model.model.embed_tokens.weight.detach())
        assert index["metadata"]["tied_weights"] == {"lm_head.weight": "model.embed_tokens.weight"}
        loaded = AutoModelForCausalLM.from_pretrained(bundle)
        assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.detach()), bundle
        assert torch.equal(logits(loaded, ids), logits(model, ids)), bundle
    assert shard_index["bundle_omits"] == []  # recorded at save time, for consolidate.sh


def test_bf16_model_trained_in_fp32_is_consolidated_back_to_bf16_with_the_original_file_split(tmp_path):
    torch.manual_seed(0)
    base = tmp_path / "base_bf16"
    AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.bfloat16).save_pretrained(base, max_shard_size="20KB")
    original_index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(original_index.values())) > 1  # the original checkpoint is split into several files

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    root = tmp_path / "ck"
    train(model, root, max_steps=2, save_consolidated="every")
    model_dir = root / LATEST / "model"

    # the shards keep the training dtype, so a resume is exact ...
    shards = {}
    for shard in model_dir.glob("shard-*.safetensors"):
        shards.update(load_file(str(shard)))
    assert {t.dtype for t in shards.values()} == {torch.float32}
    # ... and the bundle is bf16 again, split like the original, values = the trained weights in bf16
    consolidated = model_dir / "consolidated"
    index = json.loads((consolidated / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == len(set(original_index.values()))
    for key in original_index:
        assert index[key] == original_index[key]  # same file names and grouping as the original
    exported = {}
    for name in set(index.values()):
        exported.update(load_file(str(consolidated / name)))
    trained = model.state_dict()
    assert set(exported) == set(trained)
    for key, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16, key
        assert torch.equal(tensor, trained[key].to(torch.bfloat16)), key
    assert json.loads((consolidated / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(consolidated).dtype == torch.bfloat16

    # CAST_DTYPE overrides the original dtypes for ordinary floats
    as_fp32 = consolidate(model_dir, tmp_path / "fp32", cast_dtype="fp32", progress=False)
    assert {t.dtype for t in load_file(str(next(as_fp32.glob("model-*.safetensors")))).values()} == {torch.float32}


def test_a_packed_original_tensor_saved_as_float_is_left_as_float_with_a_warning(tmp_path, caplog):
    torch.manual_seed(0)
    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.bfloat16).save_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # The original checkpoint as a quantized one would have it: one weight packed two 4-bit values a byte.
    packed_key = "model.layers.0.mlp.down_proj.weight"
    original = load_file(str(base / "model.safetensors"))
    original[packed_key] = torch.zeros(32, 32, dtype=torch.uint8)
    save_file(original, str(base / "model.safetensors"), metadata={"format": "pt"})

    staging = tmp_path / "staging"
    staging.mkdir()
    model_io.save_model(staging, model)
    with caplog.at_level(logging.WARNING, logger="resilience.consolidate"):
        out = consolidate(staging / "model", progress=False)
    exported = load_file(str(out / "model-00001-of-00001.safetensors"))
    assert exported[packed_key].dtype == torch.float32  # not re-packed, not cast
    assert torch.equal(exported[packed_key], model.state_dict()[packed_key])
    assert exported["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16  # ordinary: restored
    assert any(packed_key in r.getMessage() and "uint8" in r.getMessage() for r in caplog.records)


def test_lora_adapter_checkpoint_loads_with_auto_peft_model_and_resumes(tmp_path):
    torch.manual_seed(0)
    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(base)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
    root = tmp_path / "ck"
    train(model, root, max_steps=3, tokenizer=tiny_tokenizer())

    model_dir = root / LATEST / "model"
    names = {p.name for p in model_dir.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= names
    assert not any(n.startswith("shard-") or n == "consolidate.sh" or n == "consolidated" for n in names)
    assert json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    adapters = load_file(str(model_dir / "adapter_model.safetensors"))
    assert adapters and all("lora_" in key for key in adapters)
    assert any(key.endswith("lora_B.weight") and tensor.abs().sum() > 0 for key, tensor in adapters.items())  # trained

    loaded = AutoPeftModelForCausalLM.from_pretrained(model_dir)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))
    assert torch.equal(logits(loaded, ids), logits(model, ids))

    # a restart with fresh adapters resumes the trained ones from the checkpoint
    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
    train(fresh, root, max_steps=3)
    assert torch.equal(logits(fresh, ids), logits(model, ids))


def test_a_peft_model_with_a_trainable_parameter_outside_its_adapters_is_refused_at_resilient_loop(tmp_path):
    """Found by a newcomer: a base norm unfrozen by hand beside LoRA was trained, then left out of
    every checkpoint (peft saves the adapters), and came back untrained after a resume, silently.
    modules_to_save is peft's way to keep such a module, and is accepted."""
    from resilience.config import ConfigError

    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_config(tiny_config()), lora)
    model.base_model.model.model.norm.weight.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"a PEFT model is checkpointed as its adapters only.*model\.norm\.weight"):
        train(model, tmp_path / "ck", max_steps=1)
    assert not (tmp_path / "ck" / LATEST).exists()
    kept = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    train(get_peft_model(AutoModelForCausalLM.from_config(tiny_config()), kept), tmp_path / "ck2", max_steps=1)
    assert (tmp_path / "ck2" / LATEST / "model" / "adapter_model.safetensors").exists()


def test_a_tokenizer_is_saved_with_a_torch_save_model_too_and_one_without_save_pretrained_is_refused_early(tmp_path):
    """Found by a newcomer: with model_save_format torch_save the tokenizer was silently not saved,
    and a tokenizers.Tokenizer (no save_pretrained) failed only at the first save."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config())
    train(model, tmp_path / "ck", max_steps=1, tokenizer=tiny_tokenizer(), model_save_format="torch_save")
    sidecars = tmp_path / "ck" / LATEST / "model" / "hf_metadata"
    assert (sidecars / "tokenizer.json").exists() and (sidecars / "config.json").exists()
    assert AutoTokenizer.from_pretrained(sidecars).get_vocab() == tiny_tokenizer().get_vocab()
    train(model, tmp_path / "ck", max_steps=2, tokenizer=tiny_tokenizer(), model_save_format="torch_save")  # resumes beside them
    assert (tmp_path / "ck" / LATEST).resolve().name.endswith("_step_2")
    with pytest.raises(TypeError, match=r"tokenizer: a Tokenizer has no save_pretrained\(\)"):
        train(model, tmp_path / "ck2", max_steps=1, tokenizer=tiny_tokenizer().backend_tokenizer)
