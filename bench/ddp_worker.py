"""A bench rank: the digits example's DDP step, timed with and without per-step stop agreement.

Started by :mod:`bench.ddp` through ``resilience.launch.launch`` (2 ranks, gloo, env://).
It builds the example's model, optimizer, LR schedule and data exactly as
``examples/digits/train.py`` does (its own functions, its YAML), but runs the step in a plain
loop so each variant differs only in what happens at the step boundary:

* ``none``: nothing;
* ``ours_k1`` / ``ours_k<K>``: ``StopAgreement.update`` every step (cadence 1 and K);
* ``blocking``: a blocking MAX all-reduce of one int every step (Megatron-LM's and NeMo
  AutoModel's per-step preemption check).

Blocks of steps alternate between the variants round after round (rotating the order), so
slow drifts of the shared machine hit every variant alike. Then the default cadence (``auto``)
is measured in many short interleaved rows of three blocks: ``none``, ``noop`` (a call that does
nothing, timed like the real one: the A/A control) and the agreement (the six orders in turn;
one agreement alive across its blocks, as in a real run), the data of the overhead's confidence
interval. Then the same for the watchdog's progress reports (``ProgressReporter.step`` at every
boundary). Then each boundary call timed directly, thousands of times (:mod:`bench.direct_cost`).
Then it measures the stop latency
(rank 0 ``os.kill``s rank 1 with SIGUSR1 at a random moment; steps and seconds until both
ranks have the agreed stop) and the time of one ``Checkpointer.save`` of this run's state.

Rank 0 writes the results as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from bench.common import example_module
from bench.direct_cost import AUTO_INTERVAL_S

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "digits"


class DigitsRun:
    """The example's objects on this rank, and one training step."""

    def __init__(self, rank: int, world: int):
        train = example_module("digits")
        extra = yaml.safe_load((EXAMPLE / "digits.yaml").read_text())
        seed = int(extra["seed"])
        random.seed(seed)
        torch.manual_seed(seed)
        data, _ = train.build_data(seed, float(extra["data"]["test_fraction"]))
        local_batch = int(extra["data"]["global_batch_size"]) // world
        self.sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.loader = StatefulDataLoader(data, batch_size=local_batch, sampler=self.sampler, drop_last=True)
        self.model = train.build_model(int(extra["model"]["hidden"]), float(extra["model"]["dropout"]))
        self.net = DistributedDataParallel(self.model) if world > 1 else self.model
        opt = extra["optimizer"]
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=float(opt["lr"]), weight_decay=float(opt["weight_decay"]))
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, train.warmup_cosine(int(opt["warmup_steps"]), 10**6))
        self._batches = self._forever()

    def _forever(self):
        epoch = 0
        while True:
            self.sampler.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    def step(self) -> float:
        """The example's step body: forward, loss, backward (DDP all-reduce), AdamW, LR, ``item()``."""
        x, y = next(self._batches)
        self.net.train()
        loss = F.cross_entropy(self.net(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.lr_scheduler.step()
        return loss.item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of the DDP agreement benchmark")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before each block")
    parser.add_argument("--big-k", type=int, default=10)
    parser.add_argument("--ab-pairs", type=int, default=100, help="interleaved none/auto block pairs")
    parser.add_argument("--ab-steps", type=int, default=50, help="timed steps per block of the interleaved rows")
    parser.add_argument(
        "--ab-max-seconds", type=float, default=0.0, help="more rows until the interval is narrow, for at most this long (0: exactly --ab-pairs)"
    )
    parser.add_argument("--direct-calls", type=int, default=3000, help="timed boundary calls per measurement of bench.direct_cost (0: none)")
    parser.add_argument("--direct-chunk", type=int, default=50, help="boundaries per chunk of bench.direct_cost")
    parser.add_argument("--direct-interval-s", type=float, default=AUTO_INTERVAL_S, help="bench.direct_cost's agreement_interval_s (default: the library's)")
    parser.add_argument("--latency-trials", type=int, default=5)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--ckpt-dir", required=True)
    args = parser.parse_args(argv)

    from resilience.checkpoint import Checkpointer, TrainingState
    from resilience.config import CheckpointConfig
    from resilience.distributed import DistContext
    from resilience.state.step_scheduler import StepScheduler
    from resilience.stop.agreement import StopAgreement
    from resilience.stop.signals import SignalRecorder
    from resilience.timing import RunTimer, auto_cadence

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # as the example: 2 ranks on 2 cores
    run = DigitsRun(rank, world)
    side = dist.new_group(backend="gloo")  # our collectives' own group, as DistContext.from_env makes it
    counter = [0]
    big_k = args.big_k

    def make_agreement(k: int | str) -> tuple[StopAgreement, Callable[[], int]]:
        """Our agreement at cadence ``k``, and what the loop would propose each boundary (``auto``:
        rank 0's measured step time mapped by resilience.timing.auto_cadence, as the loop does)."""
        if k != "auto":
            return StopAgreement(side, every_steps=int(k)), lambda: 0
        timer = RunTimer()
        agreement = StopAgreement(side, every_steps=1, adaptive=True)

        def propose() -> int:
            timer.boundary()
            return auto_cadence(timer.step_s, AUTO_INTERVAL_S) if rank == 0 and agreement.starts_round(counter[0]) else 0  # as the loop

        return agreement, propose

    def block(variant: str, steps: int) -> tuple[list[float], float]:
        """Per-step times (s), and the total time spent in the step-boundary call itself."""
        agreement, propose = make_agreement(variant.removeprefix("ours_k").removeprefix("ours_")) if variant.startswith("ours") else (None, None)
        flag = torch.zeros(1, dtype=torch.int64)
        times = []
        in_boundary = 0.0
        try:
            for _ in range(steps):
                start = time.perf_counter()
                run.step()
                counter[0] += 1
                mid = time.perf_counter()
                if agreement is not None:
                    agreement.update(counter[0], 0, propose_every_steps=propose())
                elif variant == "blocking":
                    flag.zero_()
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=side)
                end = time.perf_counter()
                in_boundary += end - mid
                times.append(end - start)
        finally:
            if agreement is not None:
                agreement.close()
        return times, in_boundary

    variants = ["none", "ours_k1", f"ours_k{big_k}", "ours_auto", "blocking"]
    per_block: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for variant in order:
            dist.barrier()
            block(variant, args.warmup)
            dist.barrier()
            start = time.perf_counter()
            times, in_boundary = block(variant, args.steps)
            elapsed = time.perf_counter() - start
            per_block[variant].append({"mean_s": elapsed / args.steps, "median_s": statistics.median(times), "boundary_mean_s": in_boundary / args.steps})
        if rank == 0:
            print(f"ddp round {r + 1}/{args.rounds}: " + ", ".join(f"{v} {per_block[v][-1]['mean_s'] * 1e3:.2f} ms" for v in variants), flush=True)

    from bench.ab_pairs import ab_phase, progress_ab_phase

    ab_pairs = ab_phase(run, rank, counter, args.ab_pairs, args.ab_steps, args.warmup, make_agreement, max_s=args.ab_max_seconds)
    progress_pairs = progress_ab_phase(run, rank, counter, args.ab_pairs, args.ab_steps, args.warmup, max_s=args.ab_max_seconds)
    direct = None
    if args.direct_calls > 0:
        from bench.direct_cost import direct_phase

        direct = direct_phase(run, rank, counter, calls=args.direct_calls, chunk=args.direct_chunk, interval_s=args.direct_interval_s)

    # -- stop latency: os.kill of rank `world - 1` by rank 0, at a random moment ---------------
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    rng = random.Random(1234)
    latency: dict[str, list[dict[str, float]]] = {}
    for k in (1, big_k, "auto"):
        trials = latency.setdefault(f"k{k}" if k != "auto" else "auto", [])
        for _ in range(args.latency_trials):
            dist.barrier()
            kill_at: list[float] = []
            timer = None
            with SignalRecorder([signal.SIGUSR1]) as recorder:
                agreement, propose = make_agreement(k)
                if rank == 0:
                    delay = rng.uniform(0.1, 0.3)

                    def fire(delay: float = delay, kill_at: list[float] = kill_at) -> None:
                        time.sleep(delay)
                        kill_at.append(time.monotonic())
                        os.kill(pids[world - 1], signal.SIGUSR1)

                    timer = threading.Thread(target=fire, daemon=True)
                    timer.start()
                first_flag = None
                agreed_step = agreed_at = None
                for _ in range(100000):
                    run.step()
                    counter[0] += 1
                    local = 1 if recorder else 0
                    if local and first_flag is None:
                        first_flag = counter[0]
                    if agreement.update(counter[0], local, propose_every_steps=propose()):
                        agreed_at, agreed_step = time.monotonic(), counter[0]
                        break
                agreement.close()
                if timer is not None:
                    timer.join()
            rows = [None] * world
            dist.all_gather_object(rows, {"agreed_at": agreed_at, "agreed_step": agreed_step, "first_flag": first_flag})
            if rank == 0:
                signalled = rows[world - 1]
                trials.append(
                    {
                        "seconds": max(row["agreed_at"] for row in rows) - kill_at[0],
                        "steps": signalled["agreed_step"] - signalled["first_flag"],
                        "same_step_on_all_ranks": len({row["agreed_step"] for row in rows}) == 1,
                        "every_steps_at_stop": agreement.every_steps,
                    }
                )
        if rank == 0:
            print(f"stop latency k={k}: " + ", ".join(f"{t['seconds'] * 1e3:.1f} ms/{t['steps']} steps" for t in trials), flush=True)

    # -- one save of this run's state, as the loop would write it ------------------------------
    state = TrainingState(model=run.net, optimizer=run.optimizer, lr_scheduler=run.lr_scheduler, dataloader=run.loader)
    scheduler = StepScheduler(num_epochs=1, global_step=counter[0])
    checkpointer = Checkpointer(
        CheckpointConfig(checkpoint_dir=args.ckpt_dir), DistContext(rank=rank, world_size=world, group=side), state=state, scheduler=scheduler
    )
    save_s = []
    for _ in range(args.saves):
        dist.barrier()
        start = time.perf_counter()
        scheduler.global_step += 1
        checkpointer.save()
        save_s.append(time.perf_counter() - start)
    if rank == 0:
        result = {
            "world_size": world,
            "steps_per_block": args.steps,
            "rounds": args.rounds,
            "big_k": big_k,
            "blocks": per_block,
            "ab_pairs": ab_pairs,
            "progress_ab_pairs": progress_pairs,
            "direct": direct,
            "ab_steps_per_block": args.ab_steps,
            "stop_latency": latency,
            "save_s": save_s,
        }
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
