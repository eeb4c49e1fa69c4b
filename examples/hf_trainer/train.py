"""A Hugging Face ``Trainer`` script made preemption-safe with ``resilience.integrations.transformers.train``.

    resilience run -n 2 examples/hf_trainer/train.py                                  # 2 CPU ranks (gloo)
    resilience run -n 2 examples/hf_trainer/train.py checkpoint.checkpoint_dir=/tmp/hf training.num_train_epochs=3
    python examples/hf_trainer/train.py                                               # one process

A tiny GPT-2 built from a config (byte tokens: no download, no tokenizer) learns the Python
standard library's sources. ``kill -USR1`` to any rank (or to ``resilience run``) stops every rank
after the same step, saves it (the Trainer's own checkpoint files, published atomically under
``checkpoint.checkpoint_dir``) and exits 75; the same command then resumes from ``LATEST`` and ends
as an uninterrupted run would, bitwise. ``trainer.train()`` is the Trainer's own throughout.

Arguments: an optional YAML file (default: ``hf_trainer.yaml`` beside this script), then dotted
overrides (``section.key=value``). Exits with ``resilience.ExitCode``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset

from resilience import ConfigError, ExitCode, load_config
from resilience.integrations.transformers import train

HERE = Path(__file__).resolve().parent


class ByteWindows(Dataset):
    """``count`` windows of ``seq_len`` bytes of the standard library's ``*.py`` sources, from window
    ``first`` on, as causal-LM samples (``labels`` = ``input_ids``; the model shifts them)."""

    def __init__(self, seq_len: int, first: int, count: int):
        stdlib = sorted(Path(os.path.dirname(os.__file__)).glob("*.py"))  # the same files on every machine with this Python
        need, chunks = (first + count) * seq_len, []
        for path in stdlib:
            chunks.append(path.read_bytes())
            if sum(map(len, chunks)) >= need:
                break
        raw = b"".join(chunks)[first * seq_len : need]
        self.windows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64).view(count, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


def build_trainer(cfg, callbacks=()):
    """The model, the data and the ``Trainer`` from the config's ``model``, ``data`` and ``training`` sections."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    model_cfg, data_cfg, training = cfg.extra["model"], cfg.extra["data"], dict(cfg.extra["training"])
    seq_len = int(model_cfg["seq_len"])
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        training.pop("ddp_backend", None)  # one plain process: accelerate would look for a process group
    args = TrainingArguments(output_dir=cfg.checkpoint.checkpoint_dir, **training)  # output_dir: our checkpoint root
    torch.manual_seed(args.seed)  # the initial weights: the same on every rank and every start
    config = GPT2Config(
        vocab_size=256,
        n_positions=seq_len,
        n_embd=int(model_cfg["n_embd"]),
        n_layer=int(model_cfg["n_layer"]),
        n_head=int(model_cfg["n_head"]),
        bos_token_id=None,
        eos_token_id=None,
    )
    model = GPT2LMHeadModel(config)
    train_data = ByteWindows(seq_len, 0, int(data_cfg["train_samples"]))
    eval_data = ByteWindows(seq_len, int(data_cfg["train_samples"]), int(data_cfg["eval_samples"]))
    return Trainer(model=model, args=args, train_dataset=train_data, eval_dataset=eval_data, callbacks=list(callbacks))


def main(argv: list[str], callbacks=()) -> int:
    torch.set_num_threads(1)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("resilience").setLevel(logging.INFO)  # which checkpoint a start resumes from
    path = argv[0] if argv and not argv[0].count("=") else HERE / "hf_trainer.yaml"
    overrides = argv[1:] if argv and not argv[0].count("=") else argv
    try:
        cfg = load_config(path, overrides)
        trainer = build_trainer(cfg, callbacks)
        code = train(trainer, cfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    print(f"rank {trainer.args.process_index}: exit {int(code)}", flush=True)
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
