"""``make gpu-check`` (``python -m bench.gpu_check``): what only a CUDA device can show, in under 5 minutes.

On one CUDA device, with NCCL (world size 1) and a tiny Llama sharded with FSDP2
(:mod:`bench.gpu_worker`):

1. **preempted and resumed bitwise**: an uninterrupted run, and a run that gets SIGUSR1 mid-run
   (the stop agreement on its gloo group beside NCCL, the save with CUDA tensors, exit 75) and is
   started again (resume from ``LATEST``, the CUDA RNG restored); per step the loss and one draw of
   the CUDA RNG (attention dropout makes the steps draw from it too), and at the end every weight,
   every Adam state tensor and 16 more CUDA draws, compared bitwise;
2. **the async save's blocked time** with pinned staging against one device-to-host copy of the
   same bytes into pinned memory, and the checkpoint it wrote against the state at the call (a
   step changed the live tensors while it was written);
3. **the sync save** against a raw write + ``fsync`` of the same bytes;
4. **the stop agreement** (gloo, CPU tensors) in the same process as NCCL and the CUDA model.

Prints a table; exits 0 when everything matched, 1 on any mismatch or failed run, and 3 (after
saying so) when torch sees no CUDA device (a CPU-only torch build, or no GPU). Timings are
reported, never judged. ``--device cpu`` runs the same steps with gloo on the CPU, to try the
check where there is no GPU (no pinned memory, the CPU RNG instead of CUDA's).

    make gpu-check                                   # = python -m bench.gpu_check
    python -m bench.gpu_check --device cpu --hidden 256 --layers 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

NO_CUDA = 3
REPO = Path(__file__).resolve().parents[1]


def _rows(ckpt: Path) -> list[dict]:
    path = ckpt / "training.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {
        "PYTHONPATH": str(REPO) + (os.pathsep + path if path else ""),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),  # deterministic cuBLAS, read at CUDA init
        "PYTHONUNBUFFERED": "1",
    }


def run_worker(args: list[str], *, timeout_s: float, signal_at: int | None = None, ckpt: Path | None = None) -> tuple[int, int | None]:
    """One worker rank (``resilience.launch.launch``, world size 1); with ``signal_at``, SIGUSR1 once
    ``ckpt/training.jsonl`` shows that step. Returns (exit code, the step the signal was sent at)."""
    from resilience.launch import launch

    cmd = [sys.executable, "-u", "-m", "bench.gpu_worker", *args]
    deadline = time.monotonic() + timeout_s
    sent = None
    with launch(cmd, 1, env=_env(), failure_grace_s=10.0) as group:
        while (code := group.poll()) is None:
            if time.monotonic() > deadline:
                group.terminate(5.0)
                raise TimeoutError(f"{' '.join(args)}: not done within {timeout_s:g} s")
            if signal_at is not None and sent is None and ckpt is not None:
                rows = _rows(ckpt)
                if rows and rows[-1]["global_step"] >= signal_at:
                    group.send_signal(signal.SIGUSR1)
                    sent = rows[-1]["global_step"]
            time.sleep(0.005)
    return code, sent


def compare_runs(resumed: Path, reference: Path) -> list[tuple[str, bool, str]]:
    """The checks of part 1: per-step rows, and the final state file, bitwise."""
    from safetensors.torch import load_file

    a, b = _rows(resumed), _rows(reference)
    same_steps = [r["global_step"] for r in a] == [r["global_step"] for r in b] and bool(a)
    checks = [("steps logged once each, the same sequence", same_steps, f"{len(a)} / {len(b)} rows")]
    for key in ("loss", "device_draw"):
        same = len(a) == len(b) and all(x[key] == y[key] for x, y in zip(a, b))
        first = next((x["global_step"] for x, y in zip(a, b) if x[key] != y[key]), None)
        checks.append((f"per-step {key}", same, "identical" if same else f"first differs at step {first}"))
    fa, fb = load_file(str(resumed / "final.safetensors")), load_file(str(reference / "final.safetensors"))
    for prefix, what in (("model.", "final weights"), ("optim.", "final Adam state"), ("rng.", "16 device RNG draws after the end")):
        keys = sorted(k for k in fb if k.startswith(prefix))
        differ = [k for k in keys if k not in fa or not torch_equal(fa[k], fb[k])]
        same = bool(keys) and not differ and {k for k in fa if k.startswith(prefix)} == set(keys)
        checks.append((what, same, f"{len(keys)} tensors" + (f"; differ: {differ[:3]}" if differ else "")))
    return checks


def torch_equal(a, b) -> bool:
    """Bitwise: same dtype and shape, equal bytes (NaNs compare as bits)."""
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _med(values: list[float]) -> float:
    return statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (the check); cpu tries the same steps without a GPU")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one, removed at the end)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--signal-at", type=int, default=16, help="the step after which SIGUSR1 is sent")
    parser.add_argument("--hidden", type=int, default=1024, help="the saves' model: hidden size (default ~0.3 GB of weights + 0.6 GB of Adam state)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per worker run")
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none (a CPU-only build)'}"
        print(f"gpu-check: no CUDA device available ({build}); nothing checked. Run it on a machine with a GPU and a CUDA build of torch.", file=sys.stderr)
        return NO_CUDA
    started = time.monotonic()
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    results: list[tuple[str, bool | None, str]] = []
    timings: dict = {}
    try:
        dev = ["--device", args.device]
        reference, resumed = work / "reference", work / "preempted"
        train = [*dev, "--mode", "train", "--steps", str(args.steps), "--step-sleep", "0.02"]
        code, _ = run_worker([*train, "--ckpt-dir", str(reference)], timeout_s=args.timeout)
        results.append(("uninterrupted run exits 0", code == 0, f"exit {code}"))
        code, sent = run_worker([*train, "--ckpt-dir", str(resumed)], timeout_s=args.timeout, signal_at=args.signal_at, ckpt=resumed)
        latest = os.readlink(resumed / "LATEST") if (resumed / "LATEST").is_symlink() else None
        stopped = code == 75 and sent is not None and latest is not None
        results.append(("SIGUSR1 mid-run: agreed stop, saved, exit 75", stopped, f"signal after step {sent}, exit {code}, saved {latest}"))
        code, _ = run_worker([*train, "--ckpt-dir", str(resumed)], timeout_s=args.timeout)
        results.append(("started again: resumed from LATEST, exit 0", code == 0, f"exit {code}"))
        if all(ok for _, ok, _ in results):
            results += compare_runs(resumed, reference)
        out = work / "saves.json"
        sizes = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--rounds", str(args.rounds)]
        code, _ = run_worker([*dev, "--mode", "saves", "--dir", str(work / "saves"), "--out", str(out), *sizes], timeout_s=args.timeout)
        if code != 0 or not out.exists():
            results.append(("saves worker", False, f"exit {code}"))
        else:
            timings = json.loads(out.read_text())
            differ = ", ".join(timings["async_snapshot_differ"]) or "bitwise equal"
            results.append(("async save's checkpoint = the state at the call (a step ran during the write)", timings["async_snapshot_equal"], differ))
            codes = f"update() gave {timings['agreement_codes']} (expected [0, 0, 1])"
            results.append(("stop agreement (gloo) beside NCCL and the CUDA model", timings["agreement_ok"], codes))
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    _print(results, timings, args.device, time.monotonic() - started)
    return 0 if results and all(ok is not False for _, ok, _ in results) else 1


def _print(results: list[tuple[str, bool | None, str]], t: dict, device: str, seconds: float) -> None:
    print(f"## gpu-check ({t.get('device', device)}, {seconds:.0f} s)\n")
    print("| check | result | detail |\n|---|---|---|")
    for what, ok, detail in results:
        print(f"| {what} | {'PASS' if ok else 'MISMATCH' if ok is False else '—'} | {detail} |")
    if t:
        gb = t["state_bytes"] / 1e9
        blocked, d2h, total = _med(t["async_blocked_s"]), _med(t["d2h_s"]), _med(t["async_total_s"])
        sync, raw = _med(t["sync_save_s"]), _med(t["disk_write_s"])
        print(f"\nTimings, {gb:.2f} GB of weights + Adam state in {t['tensors']} tensors, medians of {t['rounds']} rounds:\n")
        first = t["async_first_blocked_s"] * 1e3
        rows = [
            ("figure", "ours", "anchor", "ratio"),
            ("---", "---", "---", "---"),
            (
                "async save, time the caller is blocked (pinned staging)",
                f"{blocked * 1e3:.1f} ms (first save {first:.1f} ms; until durable {total:.3f} s)",
                f"one device-to-host copy into pinned memory {d2h * 1e3:.1f} ms ({gb / d2h:.1f} GB/s)",
                f"{blocked / d2h:.2f}x",
            ),
            (
                "sync save",
                f"{sync:.3f} s ({gb / sync:.2f} GB/s)",
                f"raw write + fsync of the same bytes {raw:.3f} s ({gb / raw:.2f} GB/s)",
                f"{raw / sync:.2f} of the disk",
            ),
        ]
        print("\n".join("| " + " | ".join(row) + " |" for row in rows))


if __name__ == "__main__":
    sys.exit(main())
