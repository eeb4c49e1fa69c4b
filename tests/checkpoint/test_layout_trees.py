"""The directory trees NeMo AutoModel's checkpointing guide shows are what a real run writes.

Two real 2-rank runs (gloo) of 20 steps with a checkpoint and a validation at step 20: a tiny
Hugging Face causal LM + tokenizer with safetensors and a consolidated export (the guide's
"Save Additional States" tree, compared exactly up to the documented differences below), and
a plain module with ``model_save_format: torch_save`` (the guide's PyTorch DCP tree, which
elides part of the tree with ``...`` and is compared as a subset).

Documented differences: the per-rank ``.pt`` pickles of the guide
are safe formats here, a rank's data position and RNG in one file (``rank_state/rank_<R>.safetensors``),
and ``step_scheduler.json``; a DDP run's optimizer state (every rank holds it in full) is in our own
files, one per rank (``optim/shard-0000K-of-00002.safetensors``), not DCP's ``__<R>_0.distcp``; each checkpoint also holds its ``manifest.json``, MindSpore's
``common.json`` and the files in ``OUR_EXTRAS``; ``special_tokens_map.json`` is written only by
the ``transformers`` versions that still write it (not 5.x).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from resilience import ExitCode
from resilience.launch import launch

pytestmark = pytest.mark.multiproc

# Verbatim from NeMo AutoModel, docs/guides/checkpointing.md, "Advanced Usage: Save Additional States".
SAVE_ADDITIONAL_STATES_TREE = """
checkpoints/
├── LATEST -> epoch_0_step_20
├── LOWEST_VAL -> epoch_0_step_20
├── epoch_0_step_20
│   ├── config.yaml
│   ├── dataloader
│   │   ├── dataloader_dp_rank_0.pt
│   │   └── dataloader_dp_rank_1.pt
│   ├── losses.json
│   ├── model
│   │   ├── consolidated
│   │   │   ├── config.json
│   │   │   ├── generation_config.json
│   │   │   ├── model-00001-of-00001.safetensors
│   │   │   ├── model.safetensors.index.json
│   │   │   ├── special_tokens_map.json
│   │   │   ├── tokenizer.json
│   │   │   └── tokenizer_config.json
│   │   ├── shard-00001-model-00001-of-00001.safetensors
│   │   └── shard-00002-model-00001-of-00001.safetensors
│   ├── optim
│   │   ├── __0_0.distcp
│   │   └── __1_0.distcp
│   ├── rng
│   │   ├── rng_dp_rank_0.pt
│   │   └── rng_dp_rank_1.pt
│   └── step_scheduler.pt
├── training.jsonl
└── validation.jsonl
"""

# Verbatim from the same guide, "PyTorch DCP" (its "..." elides the rest).
DCP_TREE = """
checkpoints/
├── LATEST -> epoch_0_step_20
├── LOWEST_VAL -> epoch_0_step_20
└── epoch_0_step_20
   ├── config.yaml
   ├── dataloader
   │   ├── dataloader_dp_rank_0.pt
   │   └── dataloader_dp_rank_1.pt
   ├── losses.json
   ├── model
   │   ├── __0_0.distcp
   │   └── __1_0.distcp
   └── optim
       ├── __0_0.distcp
       └── __1_0.distcp
...
"""

RENAMES = [
    # a rank's data position and RNG: one file (its rank state)
    (re.compile(r"^(.*)/dataloader/dataloader_dp_rank_(\d+)\.pt$"), lambda m: f"{m[1]}/rank_state/rank_{int(m[2]):05d}.safetensors"),
    (re.compile(r"^(.*)/rng/rng_dp_rank_(\d+)\.pt$"), lambda m: f"{m[1]}/rank_state/rank_{int(m[2]):05d}.safetensors"),
    (re.compile(r"^(.*)/step_scheduler\.pt$"), lambda m: f"{m[1]}/step_scheduler.json"),
    # DDP's optimizer state (every rank holds it in full): each rank's share in our own file
    (re.compile(r"^(.*)/optim/__(\d+)_0\.distcp$"), lambda m: f"{m[1]}/optim/shard-{int(m[2]) + 1:05d}-of-00002.safetensors"),
]
OPTIONAL = re.compile(r"/special_tokens_map\.json$")
OUR_EXTRAS = re.compile(
    r"^epoch_0_step_20/("
    r"manifest\.json|common\.json|optim/\.metadata|optim/skeleton\.json|model/\.metadata"
    r"|model/shard_index\.json|model/consolidate\.sh|model/hf_metadata(/.*)?|model/consolidated/special_tokens_map\.json"
    r"|rank_manifests/ranks_\d{5}-\d{5}\.json"
    r")$"
)

SCRIPT = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    from torch.utils.data import DistributedSampler, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader
    from resilience import resilient_loop


    def hf_model_and_tokenizer():
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
        vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
        backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
        model = AutoModelForCausalLM.from_config(LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
        return model, tokenizer


    def train(root, mode):
        torch.manual_seed(0)
        if mode == "hf":
            model, tokenizer = hf_model_and_tokenizer()
            data = TensorDataset(torch.randint(3, 64, (80, 8)))
            loss_fn = lambda m, x: m(input_ids=x, labels=x).loss
        else:
            model, tokenizer = torch.nn.Linear(4, 1), None
            data = TensorDataset(torch.randn(80, 4))
            loss_fn = lambda m, x: m(x).pow(2).mean()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = StatefulDataLoader(data, batch_size=2, sampler=DistributedSampler(data, seed=0))
        cfg = {"step_scheduler": {"max_steps": 20, "ckpt_every_steps": 20, "val_every_steps": 20},
               "checkpoint": {"checkpoint_dir": root, "model_save_format": "safetensors" if mode == "hf" else "torch_save",
                              "save_consolidated": mode == "hf"}}
        with resilient_loop(cfg, model=ddp, optimizer=optimizer, dataloader=loader, tokenizer=tokenizer) as loop:
            for step in loop:
                optimizer.zero_grad()
                loss = loss_fn(ddp, step.batch[0])
                loss.backward()
                optimizer.step()
                loop.log(loss=loss.item())
                if step.is_val_step:
                    loop.log_validation(val_loss=loss.item())
        return loop.exit_code


    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    codes = [train(root, mode) for root, mode in zip(sys.argv[1::2], sys.argv[2::2])]
    dist.destroy_process_group()
    sys.exit(max(codes))
""")


def parse_tree(text: str) -> dict[str, str | None]:
    """``tree`` output -> {relative path: symlink target or None}; the first line is the root.
    Depth comes from the column of each branch, so 3- and 4-space indentations both parse."""
    lines = [line for line in text.strip("\n").splitlines()[1:] if "── " in line]
    entries: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in lines:
        column = min(i for i in (line.find("├"), line.find("└")) if i >= 0)
        name = line[column + 4 :].strip()
        target = None
        if " -> " in name:
            name, target = name.split(" -> ")
        while stack and stack[-1][0] >= column:
            stack.pop()
        path = f"{stack[-1][1]}/{name}" if stack else name
        entries[path] = target
        stack.append((column, path))
    return entries


def expected_files(tree: str) -> tuple[dict[str, str | None], set[str]]:
    """(links, file paths) of a seed tree under our names; directories are implied by their files."""
    entries = parse_tree(tree)
    links = {path: target for path, target in entries.items() if target is not None}
    parents = {path.rsplit("/", 1)[0] for path in entries if "/" in path}
    files = set()
    for path in entries:
        if path in links or path in parents or OPTIONAL.search(path):
            continue
        for pattern, rename in RENAMES:
            match = pattern.match(path)
            if match:
                path = rename(match)
                break
        files.add(path)
    return links, files


def actual_tree(root: Path) -> tuple[dict[str, str], set[str]]:
    links, files = {}, set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if full.is_symlink():
                links[rel] = os.readlink(full)
            elif full.is_file():
                files.add(rel)
    return links, files


def run_two_ranks(tmp: Path, *runs: tuple[Path, str]) -> list[int]:
    """One pair of gloo ranks doing each (root, mode) run in turn: one start-up for all."""
    script = tmp / "train_tree.py"
    script.write_text(SCRIPT)
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    args = [str(a) for root, mode in runs for a in (root, mode)]
    with launch([sys.executable, str(script), *args], 2, env=env, failure_grace_s=20.0) as group:
        group.wait(timeout=200)
        return [p.returncode for p in group.procs]


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """Both runs' checkpoint roots: {"hf": ..., "dcp": ...}."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith(("RESILIENCE_", "SLURM_"))}
    try:
        tmp = tmp_path_factory.mktemp("trees")
        roots = {"hf": tmp / "hf" / "checkpoints", "dcp": tmp / "dcp" / "checkpoints"}
        runs = [(roots["dcp"], "dcp")] + ([(roots["hf"], "hf")] if _has_transformers() else [])
        assert run_two_ranks(tmp, *runs) == [ExitCode.DONE, ExitCode.DONE]
        return roots
    finally:
        os.environ.update(saved)


def _has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def test_parse_tree_reads_both_indentations():
    assert parse_tree(DCP_TREE)["epoch_0_step_20/optim/__1_0.distcp"] is None
    assert parse_tree(SAVE_ADDITIONAL_STATES_TREE)["LOWEST_VAL"] == "epoch_0_step_20"
    assert "epoch_0_step_20/model/consolidated/config.json" in parse_tree(SAVE_ADDITIONAL_STATES_TREE)


@pytest.mark.timeout(300)
def test_a_two_rank_safetensors_run_writes_the_save_additional_states_tree(trees):
    if not trees["hf"].exists():
        pytest.skip("transformers is not installed (extra: interop)")
    want_links, want_files = expected_files(SAVE_ADDITIONAL_STATES_TREE)
    links, files = actual_tree(trees["hf"])
    assert links == want_links
    assert want_files <= files, sorted(want_files - files)
    unexplained = sorted(f for f in files - want_files if not OUR_EXTRAS.match(f))
    assert not unexplained, f"files neither the seed tree nor OUR_EXTRAS account for: {unexplained}"


@pytest.mark.timeout(300)
def test_a_two_rank_torch_save_run_writes_the_dcp_tree(trees):
    want_links, want_files = expected_files(DCP_TREE)
    links, files = actual_tree(trees["dcp"])
    assert links == want_links
    assert want_files <= files, sorted(want_files - files)
