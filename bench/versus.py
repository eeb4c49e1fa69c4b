"""The replicated save, load and async save of this checkout against another commit's, on one machine.

    python -m bench.versus fa22db3               # 8 rounds, 1 GiB model (+ Adam: 3 GiB of state)
    python -m bench.versus fa22db3 --load        # the same beside one CPU-busy process
    python -m bench.versus fa22db3 --rounds 12 --size 256M

"No worse than the last run" compared across two full ``make bench`` runs reads the machine as much
as the code: the same code's ``load_vs_disk`` read 4.54 on one VM and 1.30 on the next. This bench
times both versions in the same run instead. Each round starts one process per version (in turn
order: the base first in rounds 1, 3, 5, ..., the head in the others), which builds the same state and times,
cold and fsync'd like ``python -m bench``: the sync save (``Checkpointer.save``), the load of it
(``Checkpointer.load``, every digest checked) and the async save's blocked time (median of
``--async-rounds``), each next to its anchor in the same process (the raw write + fsync, the raw
cold read, one memcpy of the state). The figure per operation is ``head seconds / base seconds``
paired by round: its median with the distribution-free interval of ``bench.stats`` (below 1: the
head is faster). The base's ``resilience`` package comes from ``git archive <rev>``; everything
else (``bench``, torch, the venv) is this checkout's.

Each version against its own anchor is printed too, but for the load it is not comparable between
versions: the raw cold read follows that version's save in the same process, and after an
``O_DIRECT`` save it ran ~1.6x slower than after a buffered one on the bench VM (its page cache is
built from pages the host has taken back). Both versions' loads follow the same raw read, so the
paired head/base figure is the one to read.

Writes ``bench/results/versus.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_WORKDIR, REPO, parse_size
from bench.stats import median_interval

# operation -> its anchor, both in seconds per round of the worker
PAIRS = {"save_s": "disk_write_s", "load_s": "disk_read_s", "async_blocked_s": "memcpy_s"}
# Each version against its anchor the way ``python -m bench`` reports it: the save and the load as
# a rate (anchor seconds / ours: ``save_vs_disk``), the async save as a time (ours / anchor:
# ``async_block_vs_memcpy``).
AS_TIME = {"async_blocked_s"}
# An interval of fewer rounds covers less (5 rounds: 94 %, 2: 50 %): its verdict is "undecided".
VERDICT_CONFIDENCE = 0.95


def _worker(work: Path, size: int, async_rounds: int) -> dict[str, Any]:
    """One version's figures, in this process (``resilience`` is whatever ``sys.path`` finds)."""
    # The venv's editable install appends a finder that maps any missing ``resilience.<name>`` to
    # the working tree: without it, a module the base lacks fails to import instead of mixing code.
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    import torch

    import resilience
    from bench.async_save import _prune, fault_in
    from bench.common import build_state, drop_cache, median, remove, state_tensors, timed, touch_memory
    from bench.storage import find_ours, load_ours, ours_checkpointer, read_raw, save_ours, write_raw
    from resilience.checkpoint import TrainingState

    model, optimizer = build_state(size)
    tensors = state_tensors(model, optimizer)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    raw, ours, async_root = work / "raw.bin", work / "ours", work / "async"
    out: dict[str, Any] = {"resilience": str(Path(resilience.__file__).parent), "state_bytes": state_bytes}
    # Untimed: the first big write of a process runs slower here (bench.storage.bench_save).
    touch_memory(state_bytes)
    write_raw(raw, tensors)
    drop_cache([raw])

    def cold(fn: Callable[[], object], paths: list[Path]) -> float:
        os.sync()
        drop_cache([p for p in paths if p.exists()])
        touch_memory(state_bytes)
        return timed(fn)[0]

    remove(raw)
    out["disk_write_s"] = cold(lambda: write_raw(raw, tensors), [])
    out["save_s"] = cold(lambda: save_ours(ours, model, optimizer, 1), [raw])
    directory = find_ours(ours)
    out["disk_read_s"] = cold(lambda: read_raw(raw, tensors), [raw, ours])
    out["load_s"] = cold(lambda: load_ours(directory, model, optimizer), [raw, ours])
    remove(raw)
    remove(ours)

    staging = [torch.empty_like(t) for t in tensors]
    for s, t in zip(staging, tensors):
        s.copy_(t)
    ckpt = ours_checkpointer(async_root, TrainingState(model=model, optimizer=optimizer), is_async=True)
    blocked, memcpy = [], []
    for r in range(async_rounds + 1):  # round 0 untimed: the first save allocates the staging buffers
        fault_in(staging)
        memcpy.append(timed(lambda: [s.copy_(t) for s, t in zip(staging, tensors)])[0])
        ckpt.scheduler.global_step = r + 1
        buffers = getattr(getattr(ckpt, "_buffers", None), "_buffers", None)  # private, and absent in older versions
        if buffers:
            fault_in(buffers.values())
        blocked.append(timed(ckpt.save)[0])
        ckpt.wait()
        _prune(async_root)
        drop_cache([async_root])
    remove(async_root)
    out["staging_faulted"] = bool(buffers)  # False: this version's staging buffers were not touched before each save
    out["modules"] = sorted(
        {str(Path(m.__file__).resolve()) for n, m in sys.modules.items() if n.split(".")[0] == "resilience" and getattr(m, "__file__", None)}
    )
    out["async_blocked_s"], out["memcpy_s"] = median(blocked[1:]), median(memcpy[1:])
    return out


def _extract(rev: str, into: Path) -> Path:
    """``resilience/`` of ``rev`` under ``into`` (``git archive``): a directory to put first on ``sys.path``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev, "resilience"], capture_output=True, check=False)
    if archive.returncode:
        raise SystemExit(f"bench.versus: git archive {rev!r} failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        try:
            tar.extractall(into / "base", filter="data")
        except TypeError:  # Python before 3.10.12 / 3.11.4: no filters (the archive is this repository's own)
            tar.extractall(into / "base")
    return into / "base"


def _run_worker(path_first: Path, work: Path, size: int, async_rounds: int, timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(path_first), str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "bench.versus", "--worker", "--dir", str(work), "--size", str(size), "--async-rounds", str(async_rounds)]
    proc = subprocess.run(cmd, env=env, cwd=str(path_first), capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode:
        raise RuntimeError(f"worker for {path_first} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _vs_anchor(version: dict[str, Any], op: str, anchor: str) -> float:
    return version[op] / version[anchor] if op in AS_TIME else version[anchor] / version[op]


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per operation: head/base seconds paired by round (below 1: the head is faster), and each
    version's ratio to its anchor as ``python -m bench`` reports it (:data:`AS_TIME`)."""
    out: dict[str, Any] = {}
    for op, anchor in PAIRS.items():
        ratio = median_interval([r["head"][op] / r["base"][op] for r in rounds])
        lo, hi = ratio["ci_low"], ratio["ci_high"]
        if (ratio["confidence"] or 0) < VERDICT_CONFIDENCE:
            verdict = "undecided"
        else:
            verdict = "faster" if hi < 1 else "slower" if lo > 1 else "level"
        out[op] = {
            "head_over_base": ratio,
            "verdict": verdict,
            "base_vs_anchor": median_interval([_vs_anchor(r["base"], op, anchor) for r in rounds]),
            "head_vs_anchor": median_interval([_vs_anchor(r["head"], op, anchor) for r in rounds]),
        }
    return out


def _table(summary: dict[str, Any], base: str) -> str:
    def ci(m: dict[str, Any]) -> str:
        if m["ci_low"] is None:
            return f"{m['median']:.2f}"
        return f"{m['median']:.2f} [{m['ci_low']:.2f}, {m['ci_high']:.2f}]"

    lines = [f"| operation | head / {base} seconds (paired) | coverage | verdict | {base} vs its anchor | head vs its anchor |", "|---|---|---|---|---|---|"]
    for op, s in summary.items():
        paired = s["head_over_base"]
        coverage = f"{paired['confidence']:.0%}" if paired["confidence"] is not None else "-"
        lines.append(f"| {op} | {ci(paired)} | {coverage} | {s['verdict']} | {ci(s['base_vs_anchor'])} | {ci(s['head_vs_anchor'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.versus", description=__doc__.splitlines()[0])
    parser.add_argument("base", nargs="?", help="the commit to compare with (anything git rev-parse takes)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=8,
        help="rounds, one process per version each, in alternating order (default 8; below 9 the interval is their range, below 6 under 95 %%: undecided)",
    )
    parser.add_argument("--size", default="1G", help="fp32 model size, bytes or with K/M/G (default 1G; the Adam state adds 2x)")
    parser.add_argument("--async-rounds", type=int, default=3, help="async saves timed per process (default 3; their median counts)")
    parser.add_argument("--load", action="store_true", help="run beside one CPU-busy process")
    parser.add_argument("--dir", default=str(DEFAULT_WORKDIR), help="scratch directory on the filesystem to measure (default bench/tmp)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "versus.json"), help="where the JSON goes")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per worker process before it counts as hung (default 900)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        parser.error(str(exc))
    if args.worker:
        print(json.dumps(_worker(Path(args.dir), size, args.async_rounds)))
        return 0
    if not args.base:
        parser.error("the base commit is required (for example: python -m bench.versus fa22db3)")
    if args.rounds < 2 or args.async_rounds < 1:
        parser.error(f"--rounds must be >= 2 and --async-rounds >= 1, got {args.rounds} and {args.async_rounds}")
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--short", f"{args.base}^{{commit}}"], capture_output=True, text=True, check=False)
    if rev.returncode:
        parser.error(f"base: git rev-parse {args.base!r} failed: {rev.stderr.strip()}")
    base = rev.stdout.strip()
    head = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False).stdout.strip()

    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="versus-", dir=root) as tmp:
        tmp_path = Path(tmp)
        paths = {"base": _extract(base, tmp_path), "head": REPO}
        rounds: list[dict[str, dict[str, Any]]] = []

        def run_all() -> None:
            for r in range(args.rounds):
                row: dict[str, dict[str, Any]] = {}
                for name in ("base", "head") if r % 2 == 0 else ("head", "base"):
                    work = tmp_path / f"work-{name}"
                    work.mkdir(exist_ok=True)
                    row[name] = _run_worker(paths[name], work, size, args.async_rounds, args.timeout)
                    want = (paths[name] / "resilience").resolve()
                    stray = [m for m in row[name]["modules"] if not Path(m).is_relative_to(want)]
                    if Path(row[name]["resilience"]) != want or stray:
                        raise RuntimeError(f"the {name} worker imported {row[name]['resilience']} and {stray[:3]}, not only {want}")
                if row["base"]["staging_faulted"] != row["head"]["staging_faulted"]:
                    print("versus: WARNING: only one version's async staging buffers were touched before its saves (a private attribute moved)", flush=True)
                rounds.append(row)
                parts = "  ".join(f"{op} {row['head'][op] / row['base'][op]:.2f}" for op in PAIRS)
                print(f"versus round {r + 1}/{args.rounds}: head/{base} {parts}", flush=True)

        started = time.time()
        neighbour: dict[str, Any] | None = None
        if args.load:
            from bench.neighbour import busy_neighbour

            with busy_neighbour() as neighbour:
                run_all()
        else:
            run_all()

    summary = summarize(rounds)
    result = {"base": base, "head": head, "size": size, "loaded": args.load, "neighbour": neighbour, "seconds": time.time() - started}
    result.update(rounds=rounds, summary=summary)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(_table(summary, base))
    print(f"bench.versus: {args.out}")
    return 1 if any(s["verdict"] == "slower" for s in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
