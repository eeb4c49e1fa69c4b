"""``python -m bench.scale``: the save and resume of a 7B-shaped state at N ranks, one rank at a time.

    python -m bench.scale                          # N = 8, 64, 512, 1024, 8192; ddp and fsdp2 (~30 min here)
    python -m bench.scale --quick                  # N = 16, 64, in this process (the test suite's)
    python -m bench.scale --ranks 1024 --modes fsdp2

Each (mode, N) cell runs in a process of its own (``bench.scale.cell``) under ``--cell-limit-s``;
a cell stopped there keeps what it measured, the rest marked as lower bounds. Writes
``bench/results/scale.json`` (``--out``; the run's conditions beside it in ``scale.meta.json``,
every cell's raw measurements, with all the functions' CPU, in ``scale.cells.json``)
after every cell and prints the tables. See ``bench/scale/__init__.py`` for what is real and what
is simulated, and bench/README.md for the figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_WORKDIR, REPO
from bench.scale import figures
from bench.scale.llama import MODES

FULL_RANKS = (8, 64, 512, 1024, 8192)
# Not N = 8: its FSDP2 resume materialises each simulated rank's live shards, 1/8 of 81 GB, and
# faulting those pages in was 44 s of system time in a 48 s run of that cell alone. Not 128: a
# DDP rank's own files there are lumpier than 1/N allows (the 0.5 GB embedding and its moments
# land whole on one rank).
QUICK_RANKS = (16, 64)


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"N = {QUICK_RANKS} in this process (no cell time limit)")
    parser.add_argument("--ranks", default=None, help=f"comma-separated N (default {','.join(map(str, FULL_RANKS))})")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "scale.json"), help="where the JSON goes")
    parser.add_argument("--dir", default=str(DEFAULT_WORKDIR), help="scratch directory for the sparse checkpoints (default bench/tmp)")
    parser.add_argument("--cell-limit-s", type=float, default=1800.0, help="wall seconds a cell may run (default 1800)")
    parser.add_argument("--cap-s", type=float, default=60.0, help="wall seconds the digest-share planning may run, then a lower bound (default 60)")
    parser.add_argument("--dcp-max-ranks", type=int, default=1024, help="largest N whose fsdp2 optimizer goes through DCP's coordinator here (default 1024)")
    args = parser.parse_args(argv)
    try:
        args.ranks = sorted({int(n) for n in args.ranks.split(",")}) if args.ranks else list(QUICK_RANKS if args.quick else FULL_RANKS)
    except ValueError:
        parser.error(f"--ranks: expected numbers separated by commas (8,64), got {args.ranks!r}")
    if min(args.ranks) < 2:
        parser.error("--ranks: every N must be at least 2 (rank 1 is simulated beside rank 0)")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or not args.modes:
        parser.error(f"--modes: unknown {unknown}; accepted: {', '.join(MODES)}")
    return args


def _run_cell(args: argparse.Namespace, mode: str, n: int, workdir: Path, log: Any) -> dict[str, Any]:
    """One cell's measurements (its own process unless ``--quick``)."""
    out = workdir / f"cell-{mode}-{n}.json"
    started = time.perf_counter()
    if args.quick:
        from bench.scale import cell

        doc = cell.run_cell(mode, n, workdir, out, args.cap_s, args.dcp_max_ranks, log=log)
    else:
        command = [sys.executable, "-m", "bench.scale.cell", "--mode", mode, "--ranks", str(n), "--dir", str(workdir), "--out", str(out)]
        command += ["--cap-s", str(args.cap_s), "--dcp-max-ranks", str(args.dcp_max_ranks)]
        error = None
        try:
            proc = subprocess.run(command, cwd=REPO, timeout=args.cell_limit_s, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                error = f"exit {proc.returncode}: " + " | ".join(proc.stderr.strip().splitlines()[-3:])
            for line in proc.stderr.splitlines():
                if line.startswith("scale:"):
                    log(line)
        except subprocess.TimeoutExpired:
            error = f"ran past the cell time limit of {args.cell_limit_s:.0f} s"
        doc = json.loads(out.read_text()) if out.exists() else {"runs": {}, "stage": "start"}
        if error:
            doc["error"] = error
            log(f"scale: {mode} N={n}: {error}")
    doc["wall_s"] = time.perf_counter() - started
    return doc


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)

    def log(line: str) -> None:
        print(line if line.startswith("scale:") else f"scale: {line}", file=sys.stderr, flush=True)

    meta = {
        "started_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else argv,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
        "cell_limit_s": None if args.quick else args.cell_limit_s,
        "cap_s": args.cap_s,
        "dcp_max_ranks": args.dcp_max_ranks,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict[str, Any]]] = {mode: {} for mode in args.modes}
    raw: dict[str, dict[str, Any]] = {mode: {} for mode in args.modes}  # every cell's measurements, for scale.cells.json
    failed = False
    with tempfile.TemporaryDirectory(prefix="scale-", dir=args.dir) as tmp:
        for mode in args.modes:
            with_optimizer: tuple[int, dict[str, Any]] | None = None
            for n in args.ranks:
                doc = _run_cell(args, mode, n, Path(tmp), log)
                fig = figures.cell_figures(doc)
                if doc.get("optimizer", True) and doc.get("stage") == "done":
                    with_optimizer = (n, doc)
                elif not doc.get("optimizer", True) and with_optimizer is not None:
                    figures.add_optimizer_part(fig, doc, with_optimizer[1], with_optimizer[0])
                failed = failed or "error" in doc
                results[mode][str(n)] = fig
                raw[mode][str(n)] = doc
                out.write_text(json.dumps(results, indent=1) + "\n")
                out.with_name(out.stem + ".cells.json").write_text(json.dumps(raw) + "\n")
    meta["loadavg_at_end"] = os.getloadavg()
    out.with_name(out.stem + ".meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"## Scale: one save and one resume of a Llama-2-7B-shaped state ({meta['started_at']}, {meta['cpus']} CPUs)\n")
    print(figures.table(results))
    for n in args.ranks[-2:]:
        print(f"\nWhere the CPU goes at N = {n}:\n")
        print(figures.functions_table(results, str(n)))
    print(f"\nJSON: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
