"""Train a tiny Llama-style causal LM on the Python standard library's sources (bytes), sharded
with FSDP2 (``fully_shard`` per decoder layer, then the model), under ``resilient_loop()``.

    resilience run --nproc-per-node 2 examples/llm/train.py checkpoint.checkpoint_dir=/tmp/llm
    resilience run --nproc-per-node 2 examples/llm/train.py device=cuda checkpoint.checkpoint_dir=/tmp/llm  # NCCL + CUDA

The model comes from a ``transformers`` config (no download): 256 byte-level tokens, so no
tokenizer either. On CPU (gloo) two runs with the same config and world size are bitwise
identical, and so is a run that is preempted (SIGUSR1/SIGTERM to any rank) and resumed.
``device: auto`` (the default) uses NCCL and CUDA where a GPU exists. Exits with
``resilience.ExitCode``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from resilience import ConfigError, ExitCode, load_config, resilient_loop

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13


def corpus_files() -> list[Path]:
    """The standard library's top-level ``*.py`` files, sorted by name: the same list, in the
    same order, on every machine with this Python."""
    return sorted(Path(os.path.dirname(os.__file__)).glob("*.py"))


def build_data(seq_len: int, max_bytes: int) -> TensorDataset:
    """Non-overlapping windows of ``seq_len`` bytes (token ids 0..255) from the first ``max_bytes``
    bytes of the concatenated corpus."""
    chunks, total = [], 0
    for path in corpus_files():
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    raw = b"".join(chunks)[:max_bytes]
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
    windows = tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len)
    return TensorDataset(windows)


def build_model(model_cfg: dict, seq_len: int) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` from a config (random init from the torch RNG; no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=int(model_cfg["hidden"]),
        intermediate_size=int(model_cfg["intermediate"]),
        num_hidden_layers=int(model_cfg["layers"]),
        num_attention_heads=int(model_cfg["heads"]),
        num_key_value_heads=int(model_cfg["kv_heads"]),
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",  # plain matmul + softmax: deterministic on CPU and on CUDA
    )
    return LlamaForCausalLM(config)


def shard(model: torch.nn.Module, mesh) -> None:
    """FSDP2: each decoder layer is its own unit (gathered only while it runs), then the rest."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def pick_device(name: str) -> str:
    """``auto`` -> ``cuda`` where a GPU exists, else ``cpu``; ``cpu``/``cuda`` as given."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"device: expected auto, cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda, but torch sees no GPU; use device=cpu or device=auto")
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(Path(__file__).with_name("llm.yaml")))
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. checkpoint.checkpoint_dir=/tmp/ck")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        device = pick_device(str(cfg.extra.get("device", "auto")))
    except ConfigError as exc:  # exit 2: the batch script does not requeue a bad configuration
        print(f"configuration error: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    extra = cfg.extra

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:  # a plain `python train.py`: a process group of one all the same (FSDP2 needs a mesh)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", world_size=world_size, rank=int(os.environ.get("RANK", "0")))
    rank = dist.get_rank()
    mesh = init_device_mesh(device, (world_size,))
    torch.set_num_threads(1)  # 2 ranks on 2 cores; also keeps CPU kernels deterministic
    if device == "cuda":
        # with CUBLAS_WORKSPACE_CONFIG (set below if missing); an op without a deterministic kernel warns
        torch.use_deterministic_algorithms(True, warn_only=True)

    seed = int(extra["seed"])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    data_cfg = extra["data"]
    seq_len = int(data_cfg["seq_len"])
    train = build_data(seq_len, int(data_cfg["max_bytes"]))
    local_batch = int(data_cfg["global_batch_size"]) // world_size
    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    loader = StatefulDataLoader(train, batch_size=local_batch, sampler=sampler, drop_last=True)

    model = build_model(extra["model"], seq_len).to(device)  # the same init on every rank (same seed)
    shard(model, mesh)
    opt_cfg = extra["optimizer"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(opt_cfg["lr"]), weight_decay=float(opt_cfg["weight_decay"]))
    total_steps = cfg.step_scheduler.max_steps or cfg.step_scheduler.num_epochs * len(loader)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(int(opt_cfg["warmup_steps"]), total_steps))

    try:
        loop = resilient_loop(cfg, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=loader)
    except ConfigError as exc:  # every rank finds it before training
        print(f"rank {rank}: configuration error: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    with loop:
        for step in loop:
            (tokens,) = step.batch
            tokens = tokens.to(device)
            model.train()
            loss = model(input_ids=tokens, labels=tokens).loss  # next-byte prediction
            loss.backward()
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            # The loss of this rank's batch; rank 0 logs it (bitwise comparable run to run).
            loop.log(loss=loss.item(), lr=lr)

    if loop.exit_code == ExitCode.DONE and rank == 0:
        print(f"rank 0: done at step {loop.scheduler.global_step} on {device}", flush=True)
    elif loop.exit_code == ExitCode.PREEMPTED:
        print(f"rank {rank}: preempted, saved step {loop.stop_step}, exit {int(loop.exit_code)}", flush=True)
    return int(loop.exit_code)


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (read at CUDA init)
    sys.exit(main())
