"""``python -m bench`` (``make bench``): every benchmark of issue 7, a markdown table, and JSON.

    python -m bench                    # ~1 GiB fp32 model + Adam state (3 GiB), 5 rounds
    python -m bench --size 256M --repeat 3
    python -m bench --quick            # a tiny smoke run (the test suite's)
    python -m bench --only save,load   # some sections: save, load, rss, async, agreement, exit, watchdog, goodput, restart, sharded
    python -m bench --load             # twice: quiet, then beside a CPU-bound neighbour (loaded.*)
    python -m bench --load-only        # only the pass beside the neighbour, merged into --out

Progress goes to stderr; the table (and the breakdown of our save and load) to stdout; the
figures, with their rounds, 95 % intervals, raw times (s) and sizes (bytes) beside them, to
``bench/results/latest.json`` (``--out``); the pass beside a busy neighbour under the same keys
prefixed ``loaded.``. Targets are printed with PASS/MISS; nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

SECTIONS = ("save", "load", "rss", "async", "agreement", "exit", "watchdog", "goodput", "restart", "sharded")


def _args(argv: list[str] | None) -> argparse.Namespace:
    from bench.common import DEFAULT_WORKDIR, REPO, parse_size

    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--size", default=None, help="fp32 model size, bytes or with K/M/G (default 1G; the Adam state adds 2x)")
    parser.add_argument("--repeat", type=int, default=None, help="rounds per figure (default 5, --quick 1)")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run: 4M model, 1 round, short DDP blocks")
    parser.add_argument("--dir", default=str(DEFAULT_WORKDIR), help="scratch directory on the filesystem to measure (default bench/tmp)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "latest.json"), help="where the JSON goes")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections to run ({','.join(SECTIONS)})")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the timed phases of our save and load")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--load", action="store_true", help="run every section twice: quiet, then beside one CPU-busy process (keys loaded.*)")
    load.add_argument("--load-only", action="store_true", help="only the pass beside the busy process; its loaded.* keys replace those in --out")
    parser.add_argument("--goodput-periods", default=None, help="seconds between preemptions, comma-separated (default 10,30; --quick 3)")
    parser.add_argument("--goodput-preemptions", type=int, default=None, help="preemptions per period (default 3; --quick 1)")
    args = parser.parse_args(argv)
    try:
        args.goodput_periods = tuple(float(x) for x in (args.goodput_periods or ("3" if args.quick else "10,30")).split(",") if x.strip())
    except ValueError:
        parser.error(f"--goodput-periods: expected seconds separated by commas (10,30), got {args.goodput_periods!r}")
    if not args.goodput_periods or min(args.goodput_periods) <= 0:
        parser.error("--goodput-periods: expected at least one period > 0 s")
    if args.goodput_preemptions is None:
        args.goodput_preemptions = 1 if args.quick else 3
    if args.goodput_preemptions < 1:
        parser.error(f"--goodput-preemptions: must be >= 1, got {args.goodput_preemptions}")
    try:
        args.size = parse_size(args.size or ("4M" if args.quick else "1G"))
    except ValueError as exc:
        parser.error(str(exc))
    if args.repeat is None:
        args.repeat = 1 if args.quick else 5
    if args.repeat < 1:
        parser.error(f"--repeat: must be >= 1, got {args.repeat}")
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.only) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown sections {unknown}; accepted: {', '.join(SECTIONS)}")
    if "load" in args.only and "save" not in args.only:
        args.only.insert(0, "save")  # the load reads what the save benchmark wrote
    return args


def run_pass(args: argparse.Namespace, argv: list[str] | None, log: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """Every section of ``args.only`` once: ``(results, meta, failed)`` (raw results per section)."""
    import torch

    from bench.common import build_state, filesystem_of, human_bytes, nbytes, remove, state_tensors

    only = list(args.only)
    run_dir = Path(args.dir).absolute() / f"run-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    mount, fstype = filesystem_of(run_dir)
    if fstype in ("tmpfs", "ramfs"):
        log(f"WARNING: {run_dir} is on {fstype}: the disk figures measure memory, not a disk; pass --dir on a real disk")
    meta: dict[str, Any] = {
        "started_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else argv,
        "quick": args.quick,
        "repeat": args.repeat,
        "model_bytes_requested": args.size,
        "dir": str(run_dir),
        "filesystem": {"mount": mount, "type": fstype},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_start": os.getloadavg(),
        "sections": {},
    }
    results: dict[str, Any] = {}
    failed = False
    started = time.perf_counter()

    def section(name: str, fn: Callable[[], Any]) -> None:
        nonlocal failed
        if name not in only:
            return
        t0 = time.perf_counter()
        load0 = os.getloadavg()[0]
        log(f"--- {name} --- (load average {load0:.1f})")
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one broken section must not lose the others
            failed = True
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"{name} FAILED:\n{traceback.format_exc()}")
        seconds = time.perf_counter() - t0
        meta["sections"][name] = {"seconds": seconds, "loadavg_1min_at_start": load0, "loadavg_1min_at_end": os.getloadavg()[0]}
        log(f"{name}: {seconds:.1f} s")

    try:
        model = optimizer = None
        if set(only) & {"save", "load", "rss", "async"}:
            log(f"building a {human_bytes(args.size)} fp32 model and its Adam state ...")
            model, optimizer = build_state(args.size)
            tensors = state_tensors(model, optimizer)
            meta.update(model_bytes=sum(p.numel() * 4 for p in model.parameters()), state_bytes=nbytes(tensors), state_tensors=len(tensors))
            log(f"state: {human_bytes(meta['state_bytes'])} in {len(tensors)} tensors ({meta['model_bytes']} bytes of weights); work dir {run_dir} ({fstype})")
            del tensors
        from bench import ddp, storage

        section("save", lambda: storage.bench_save(run_dir, model, optimizer, args.repeat, log))
        section(
            "load",
            lambda: (
                storage.bench_load(run_dir, model, optimizer, args.repeat, log) if "error" not in results.get("save", {}) else _raise("the save section failed")
            ),
        )
        if model is not None and not args.no_breakdown and "save" in only:
            only.append("breakdown")
            section("breakdown", lambda: storage.breakdown(run_dir, model, optimizer))
        for name in ("raw.bin", "ours", "torch_save.pt", "dcp", "state.safetensors"):
            remove(run_dir / name)
        # Peak memory barely varies between runs, and each costs a full save: at most 3 rounds.
        section("rss", lambda: storage.bench_peak_rss(run_dir, model, optimizer, min(args.repeat, 3), log))
        if "async" in only:
            from bench import async_save

            section("async", lambda: async_save.bench_async(run_dir, model, optimizer, args.repeat, log))
        model = optimizer = None  # free them before the agreement runs (the lambdas above have run)
        quick = args.quick
        section(
            "agreement",
            lambda: ddp.bench_agreement(
                run_dir,
                rounds=1 if quick else max(2 * args.repeat, 4),
                steps=20 if quick else 300,
                big_k=10,
                latency_trials=1 if quick else max(args.repeat, 3),
                saves=1 if quick else 3,
                timeout_s=120 if quick else 900,
                log=log,
                ab_pairs=3 if quick else 100,
                ab_steps=10 if quick else 50,
                ab_max_s=0.0 if quick else 300.0,
                direct_calls=200 if quick else 3000,
                direct_chunk=20 if quick else 50,
            ),
        )
        section(
            "exit",
            lambda: ddp.bench_exit(
                run_dir,
                trials=1 if quick else max(1, min(args.repeat, 3)),
                modes=("one",) if quick else ("all", "one"),
                after_steps=20,
                timeout_s=120,
                log=log,
                teardown_cases=("plain",) if quick else ("plain", "gc_freeze", "os_exit"),
            ),
        )
        if "watchdog" in only:
            from bench import watchdog

            section(
                "watchdog",
                lambda: watchdog.bench_watchdog(
                    run_dir, timeout_s=1.5 if quick else 5.0, trials=1 if quick else max(args.repeat, 3), run_timeout_s=300, log=log, nproc=1 if quick else 2
                ),
            )
        if "goodput" in only:
            from bench import goodput

            section(
                "goodput",
                lambda: goodput.bench_goodput(
                    run_dir, periods=args.goodput_periods, preemptions=args.goodput_preemptions, timeout_s=300 if quick else 900, log=log
                ),
            )
        if "restart" in only:
            from bench import restart

            # restart -> first step of the digits example on 2 ranks, phase by phase (issue 27, item 3)
            section("restart", lambda: restart.bench_restart(run_dir, trials=1 if quick else max(args.repeat, 3), timeout_s=300, log=log))
        if "sharded" in only:
            from bench import sharded_save

            # FSDP2 over 2 ranks, each holding and writing half of a state of the same size as above.
            section("sharded", lambda: sharded_save.bench_sharded_save(run_dir, args.size, args.repeat, timeout_s=180 if quick else 1800, log=log))
    finally:
        remove(run_dir)
        try:
            run_dir.parent.rmdir()  # only when empty: another run may be using it
        except OSError:
            pass

    meta["seconds"] = time.perf_counter() - started
    meta["loadavg_at_end"] = os.getloadavg()
    return results, meta, failed


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    from bench import report
    from bench.neighbour import busy_neighbour

    def log(message: str) -> None:
        print(f"bench: {message}", file=sys.stderr, flush=True)

    _remove_stale_runs(Path(args.dir).absolute())
    out = Path(args.out)
    doc: dict[str, Any] = {"meta": {}, "details": {}}
    if args.load_only and out.exists():  # merge: keep the quiet pass, replace the loaded one
        doc = {k: v for k, v in json.loads(out.read_text()).items() if not k.startswith(report.LOADED_PREFIX)}
        doc.setdefault("meta", {}).pop("loaded", None)
        doc.setdefault("details", {}).pop("loaded", None)
    failed = False
    for loaded in [True] if args.load_only else [False, True] if args.load else [False]:
        if loaded:
            log("=== the same sections beside one CPU-busy process (keys loaded.*) ===")
            with busy_neighbour() as neighbour:
                results, meta, broke = run_pass(args, argv, log)
            meta["neighbour"] = neighbour
        else:
            results, meta, broke = run_pass(args, argv, log)
        failed = failed or broke
        fig = report.figures(results)
        details = {name: _jsonable(value) for name, value in results.items()}
        if loaded:
            doc.update(report.prefixed(fig))
            doc["meta"]["loaded"], doc["details"]["loaded"] = meta, details
        else:
            doc.update(fig)
            doc["meta"] = {**meta, **({"loaded": doc["meta"]["loaded"]} if "loaded" in doc["meta"] else {})}
            doc["details"] = details
        _print(fig, meta, results, args.repeat, loaded)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n")  # after each pass: a broken second one keeps the first
    print(f"\nJSON: {out}")
    return 1 if failed else 0


def _print(fig: dict[str, Any], meta: dict[str, Any], results: dict[str, Any], repeat: int, loaded: bool) -> None:
    """The markdown table of one pass (and the breakdown of our save and load)."""
    from bench import table
    from bench.common import human_bytes

    state = meta.get("state_bytes")
    title = f"State: {human_bytes(state)} fp32 in {meta.get('state_tensors')} tensors (model + Adam)" if state else "State: n/a"
    fs = meta["filesystem"]
    beside = ", beside one CPU-busy process (JSON keys loaded.*)" if loaded else ""
    print(f"## Benchmarks{beside} ({meta['started_at']}, {meta['cpus']} CPUs, torch {meta['torch']}, {fs['type']} at {fs['mount']})\n")
    print(
        f"{title}; medians of {repeat} round(s), each ratio paired with its anchor in the same round, 95 % intervals in brackets "
        f"with their coverage; load average {meta['loadavg_at_start'][0]:.1f} at the start, {meta['loadavg_at_end'][0]:.1f} at the end.\n"
    )
    print(table.table(fig, meta))
    if isinstance(results.get("breakdown"), dict) and "save" in results["breakdown"]:
        print("\nWhere our save and load spend their time (one run, phases nest):\n")
        print(table.breakdown_table(results["breakdown"]))
    print()


def _remove_stale_runs(workdir: Path) -> None:
    """Delete ``run-<pid>`` scratch directories of benchmark runs that were killed (their pid is
    gone), so an interrupted run does not leave gigabytes behind."""
    from bench.common import remove

    if not workdir.is_dir():
        return
    for child in workdir.glob("run-*"):
        try:
            pid = int(child.name[4:])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            remove(child)
        except PermissionError:
            pass


def _raise(message: str):
    raise RuntimeError(message)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


if __name__ == "__main__":
    sys.exit(main())
