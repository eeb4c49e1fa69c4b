"""The one rank of ``make gpu-check`` (:mod:`bench.gpu_check`): a tiny Llama (transformers config, no
download) sharded with FSDP2 on one device, NCCL (``--device cuda``) or gloo (``--device cpu``, to
try the check without a GPU), world size 1.

``--mode train``: the LLM example's model and data (``examples/llm``) under ``resilient_loop()``,
with attention dropout (so the steps draw from the device RNG) and one draw of the device RNG per
step logged beside the loss (``training.jsonl``); at the end (exit 0) the final weights, Adam state
and a last draw of the device RNG go to ``final.safetensors`` in the checkpoint directory.

``--mode saves``: a larger model of the same kind, one step for Adam's state, then: the async
save's blocked and total time (pinned staging buffers on CUDA), the state right at the call
compared bitwise with what the checkpoint holds after a step changed the live tensors; one copy of
the same bytes device -> pinned host memory; the sync save against a raw write + fsync of the same
bytes; the stop agreement (gloo, CPU tensors) beside the NCCL group and the CUDA model. Writes JSON
to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import example_module


def build_model(hidden: int, layers: int, seq_len: int, dropout: float) -> torch.nn.Module:
    """The LLM example's ``LlamaForCausalLM`` (eager attention: deterministic kernels) of this size,
    with ``dropout`` in every attention (so training steps draw from the device's RNG)."""
    heads = max(2, hidden // 32)
    model_cfg = {"hidden": hidden, "intermediate": 2 * hidden, "layers": layers, "heads": heads, "kv_heads": heads // 2}
    model = example_module("llm").build_model(model_cfg, seq_len)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = dropout  # read by the attention's forward in training mode
    return model


def setup(device: str):
    """The process group (NCCL on CUDA, else gloo) of world size 1 and a 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.use_deterministic_algorithms(True, warn_only=True)  # with CUBLAS_WORKSPACE_CONFIG (set by the driver)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", world_size=1, rank=0)
    return init_device_mesh(device, (1,))


def _full(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the whole tensor (a ``DTensor``'s full tensor)."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().to("cpu").clone()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every weight and Adam state tensor, whole, on the CPU, by name (``model.<fqn>``, ``optim.<fqn>.<key>``)."""
    out = {f"model.{name}": _full(p) for name, p in model.named_parameters()}
    names = {id(p): name for name, p in model.named_parameters()}
    for p, entries in optimizer.state.items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{names[id(p)]}.{key}"] = _full(value)
    return out


def draw(device: str, n: int = 1) -> torch.Tensor:
    """``n`` draws of the device's RNG (CUDA's on cuda)."""
    return torch.rand(n, device=device)


def train(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    from resilience import resilient_loop

    llm = example_module("llm")
    mesh = setup(args.device)
    torch.manual_seed(1234)
    data = llm.build_data(64, 1 << 18)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=1234, drop_last=True)
    loader = StatefulDataLoader(data, batch_size=16, sampler=sampler, drop_last=True)
    model = build_model(64, 2, 64, dropout=0.1).to(args.device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    config = {
        "step_scheduler": {"num_epochs": 1, "max_steps": args.steps, "ckpt_every_steps": None, "preemption_signal": ["SIGUSR1"], "agreement_every_steps": 1},
        "checkpoint": {"checkpoint_dir": args.ckpt_dir, "save_consolidated": False},
    }
    loop = resilient_loop(config, model=model, optimizer=optimizer, dataloader=loader)
    with loop:
        for step in loop:
            (tokens,) = step.batch
            tokens = tokens.to(args.device)
            model.train()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loop.log(loss=loss.item(), device_draw=draw(args.device).item())
            if args.step_sleep:
                time.sleep(args.step_sleep)  # room for the driver's signal mid-run
    if loop.exit_code == 0:
        state = full_state(model, optimizer)
        state["rng.final_draws"] = draw(args.device, 16).cpu()
        save_file(state, str(Path(args.ckpt_dir) / "final.safetensors"))
    return int(loop.exit_code)  # resilient_loop() destroys the process group at exit


def saves(args: argparse.Namespace) -> int:
    from torch.distributed.fsdp import fully_shard

    from resilience.checkpoint import Checkpointer, TrainingState
    from resilience.config import CheckpointConfig
    from resilience.distributed import DistContext
    from resilience.state.step_scheduler import StepScheduler
    from resilience.stop.agreement import StopAgreement

    mesh = setup(args.device)
    cuda = args.device == "cuda"
    torch.manual_seed(0)

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = build_model(args.hidden, args.layers, 64, dropout=0.0).to(args.device)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    model, optimizer = fresh()
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0)).to(args.device)

    def step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    ctx = DistContext.from_env()
    local = [p.detach().to_local() for p in model.parameters()]
    local += [v.to_local() if hasattr(v, "to_local") else v for p in model.parameters() for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    local = [t.contiguous() for t in local]
    nbytes = sum(t.numel() * t.element_size() for t in local)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "state_bytes": nbytes, "tensors": len(local), "rounds": args.rounds}

    # one device -> pinned host copy of the same bytes, into buffers allocated once
    pinned = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda) for t in local]
    d2h = []
    for _ in range(args.rounds + 1):
        sync()
        t0 = time.perf_counter()
        for buf, t in zip(pinned, local):
            buf.copy_(t, non_blocking=cuda)
        sync()
        d2h.append(time.perf_counter() - t0)
    out["d2h_s"] = d2h[1:]  # the first copy touches the buffers for the first time

    # the async save: blocked (until save() returns) and total (until durable); then the
    # last round's checkpoint against the state at the call, after a step changed the live tensors
    root = Path(args.dir)
    async_ck = Checkpointer(
        CheckpointConfig(checkpoint_dir=str(root / "async"), is_async=True, save_consolidated=False),
        ctx,
        state=TrainingState(model=model, optimizer=optimizer),
        scheduler=StepScheduler(num_epochs=1),
    )
    blocked, total = [], []
    expected = None
    for r in range(args.rounds + 1):
        async_ck.scheduler.global_step = r + 1
        if r == args.rounds:
            expected = full_state(model, optimizer)
        sync()
        t0 = time.perf_counter()
        async_ck.save()
        blocked.append(time.perf_counter() - t0)
        if r == args.rounds:
            step()  # training goes on while the write runs: the checkpoint must hold the state at the call
            sync()
        async_ck.wait()
        total.append(time.perf_counter() - t0)
    out.update(async_blocked_s=blocked[1:], async_total_s=total[1:], async_first_blocked_s=blocked[0])
    async_ck.close()
    back_model, back_optim = fresh()
    Checkpointer(
        CheckpointConfig(checkpoint_dir=str(root / "async")),
        ctx,
        state=TrainingState(model=back_model, optimizer=back_optim),
        scheduler=StepScheduler(num_epochs=1),
    ).load(root / "async" / os.readlink(root / "async" / "LATEST"), TrainingState(model=back_model, optimizer=back_optim))
    got = full_state(back_model, back_optim)
    differ = sorted(k for k in expected if k not in got or not torch.equal(expected[k], got[k]))
    out["async_snapshot_equal"] = not differ and expected.keys() == got.keys()
    out["async_snapshot_differ"] = differ[:5]

    # the sync save against the disk: a raw write + fsync of the same bytes
    sync_ck = Checkpointer(
        CheckpointConfig(checkpoint_dir=str(root / "sync"), save_consolidated=False),
        ctx,
        state=TrainingState(model=model, optimizer=optimizer),
        scheduler=StepScheduler(num_epochs=1),
    )
    raw, ours = [], []
    for r in range(args.rounds):
        path = root / "raw.bin"
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as fh:
            for buf in pinned:
                fh.write(memoryview(buf.reshape(-1).view(torch.uint8).numpy()))
            os.fsync(fh.fileno())
        raw.append(time.perf_counter() - t0)
        path.unlink()
        sync_ck.scheduler.global_step = r + 1
        sync()
        t0 = time.perf_counter()
        sync_ck.save()
        ours.append(time.perf_counter() - t0)
    out.update(disk_write_s=raw, sync_save_s=ours)
    sync_ck.close()

    # the stop agreement (gloo, CPU int64) beside NCCL and the CUDA model: a flag raised after
    # step 2 is agreed at step 3 (cadence 1: the next boundary)
    agreement = StopAgreement(ctx.group, every_steps=1)
    got_codes = [agreement.update(1, 0), agreement.update(2, 1), agreement.update(3, 0)]
    agreement.close()
    out["agreement_codes"] = got_codes
    out["agreement_ok"] = got_codes == [0, 0, 1]
    ctx.close()
    dist.destroy_process_group()
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("train", "saves"), required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--ckpt-dir", help="train: the run's checkpoint directory")
    parser.add_argument("--steps", type=int, default=40, help="train: steps of the run")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="train: seconds of sleep after each step")
    parser.add_argument("--dir", help="saves: scratch directory")
    parser.add_argument("--out", help="saves: the JSON result")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    return train(args) if args.mode == "train" else saves(args)


if __name__ == "__main__":
    sys.exit(main())
