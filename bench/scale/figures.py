"""The figures of ``bench/results/scale.json`` from the cells' measurements, and their markdown table."""

from __future__ import annotations

from typing import Any

from bench.common import human_bytes

KEYS = (
    "save_plan_s",
    "resume_plan_s",
    "rank0_publish_s",
    "rank0_meta_ops",
    "index_bytes_per_rank",
    "resume_read_bytes_per_rank",
    "replicated_bytes",
    "own_file_bytes",
    "collective_bytes_per_rank",
)
"""The figures the issue asks for, per mode and N (seconds of one rank's CPU; bytes)."""

OPTIMIZER_FUNCTIONS = ("dcp_io.save_tensors (DCP save)", "optim_io._split", "optim_files.replicated (gather)")
OPTIMIZER_LOAD = "optim_io.load_optimizer"


def _cpu(run: dict[str, Any], *phases: str) -> float:
    return sum(run[p]["cpu_s"] for p in phases if p in run)


def _ops(run: dict[str, Any], *phases: str) -> int:
    return sum(sum(run[p]["meta_ops"].values()) for p in phases if p in run)


def _read(run: dict[str, Any], categories: tuple[str, ...] | None = None) -> int:
    phases = [v for v in run.values() if isinstance(v, dict) and "read" in v and "cpu_s" in v]
    return sum(n for phase in phases for cat, n in phase["read"].items() if categories is None or cat in categories)


def _top(functions: dict[str, float], n: int = 6) -> dict[str, float]:
    return {name: round(s, 4) for name, s in sorted(functions.items(), key=lambda kv: -kv[1])[:n]}


def cell_figures(doc: dict[str, Any]) -> dict[str, Any]:
    """Figures of one cell (``bench.scale.cell`` output); ``None`` for what it did not reach."""
    runs = doc.get("runs", {})
    s0, s1, r0, r1 = (runs.get(k) for k in ("save.0", "save.1", "resume.0", "resume.1"))
    save_phases = ("parts", "write", "verdict")
    fig: dict[str, Any] = dict.fromkeys(KEYS)
    index = ("index", "dcp_metadata")
    if s1:
        fig["save_plan_s"] = _cpu(s1, *save_phases)
        fig["own_file_bytes"] = s1["own_file_bytes"]
        fig["collective_bytes_per_rank"] = sum(s1["received"].values())
    if s0:
        fig["rank0_save_plan_s"] = _cpu(s0, *save_phases)
        fig["rank0_publish_s"] = _cpu(s0, "publish", "retention")
        fig["rank0_publish_wall_s"] = sum(s0[p]["wall_s"] for p in ("publish", "retention"))
        # critical path: files durable -> the last collective (publish, LOWEST_VAL, retention's choice);
        # background: rank 0's share of the deletion after it (its own files, then what is left)
        fig["rank0_critical_meta_ops"] = _ops(s0, "publish", "retention")
        fig["rank0_background_meta_ops"] = _ops(s0, "background")
        fig["rank0_meta_ops"] = _ops(s0, "publish", "retention", "background")
        fig["rank0_meta_ops_by_call"] = _by_call(s0, "publish", "retention", "background")
        fig["rank0_background_s"] = _cpu(s0, "background")
        fig["rank0_collective_bytes"] = sum(s0["received"].values())
        fig["files"] = s0["files"]
    if r1:
        fig["resume_plan_s"] = _cpu(r1, "choose", "load")
        fig["resume_read_bytes_per_rank"] = _read(r1)
        fig["replicated_bytes"] = _read(r1, ("index", "dcp_metadata", "replicated")) + r1.get("streamed_bytes", 0)
        fig["resume_collective_bytes_per_rank"] = sum(r1["received"].values())
    if r0:
        fig["rank0_resume_plan_s"] = _cpu(r0, "choose", "load")
        fig["rank0_resume_meta_ops"] = _ops(r0, "choose", "load")
        fig["rank0_choose_meta_ops"] = _ops(r0, "choose")  # its share of the size checks, the pointer, the manifest
    if s0 and s1 and r0 and r1:
        fig["index_bytes_per_rank"] = max(_read(s0, index) + _read(r0, index), _read(s1, index) + _read(r1, index))
    fig["functions"] = {k: _top(v["functions"]) for k, v in runs.items()}
    lower = {k: v for run in runs.values() for k, v in run.get("lower_bounds", {}).items()}
    fig["lower_bound"] = sorted({"resume_plan_s", "rank0_resume_plan_s"} if lower else set())
    if lower:
        fig["capped"] = {name: round(s, 2) for name, s in lower.items()}
    if doc.get("stage") != "done":
        fig["incomplete"] = f"stopped in {doc.get('stage')!r}: {doc.get('error', 'ran past the cell time limit')}"
        fig["lower_bound"] = sorted(set(fig["lower_bound"]) | {k for k in KEYS if fig[k] is not None})
    fig["optimizer"] = doc.get("optimizer", True)
    fig["wall_s"] = doc.get("wall_s")
    return fig


def _by_call(run: dict[str, Any], *phases: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in phases:
        for name, n in run.get(p, {}).get("meta_ops", {}).items():
            out[name] = out.get(name, 0) + n
    return out


def add_optimizer_part(fig: dict[str, Any], doc: dict[str, Any], source: dict[str, Any], source_n: int) -> None:
    """For a cell run without its (DCP) optimizer: add the optimizer's part measured in ``source``
    (the same mode at ``source_n`` ranks, with it) to every figure it enters, as a lower bound."""
    runs = source["runs"]
    s0, s1, r0, r1 = (runs[k] for k in ("save.0", "save.1", "resume.0", "resume.1"))

    def part(run: dict[str, Any], names: tuple[str, ...]) -> float:
        return sum(run["functions"].get(name, 0.0) for name in names)

    adds = {
        "save_plan_s": part(s1, OPTIMIZER_FUNCTIONS),
        "rank0_save_plan_s": part(s0, OPTIMIZER_FUNCTIONS),
        "resume_plan_s": part(r1, (OPTIMIZER_LOAD,)),
        "rank0_resume_plan_s": part(r0, (OPTIMIZER_LOAD,)),
        "index_bytes_per_rank": _read(r1, ("dcp_metadata",)),
        "replicated_bytes": _read(r1, ("dcp_metadata",)),
        "resume_read_bytes_per_rank": _read(r1, ("dcp_metadata",)),
        "collective_bytes_per_rank": s1["received"].get("dcp", 0),
        "rank0_collective_bytes": s0["received"].get("dcp", 0),
        "resume_collective_bytes_per_rank": r1["received"].get("dcp", 0),
    }
    for key, value in adds.items():
        if fig.get(key) is not None:
            fig[key] += value
    fig["optimizer_part_from_n"] = source_n
    # without the optimizer's files (one DCP file per rank) the file counts are lower too
    fewer_files = {"own_file_bytes", "files", "rank0_publish_s", "rank0_meta_ops", "rank0_resume_meta_ops"}
    fewer_files |= {"rank0_critical_meta_ops", "rank0_background_meta_ops"}
    fig["lower_bound"] = sorted(set(fig["lower_bound"]) | set(adds) | fewer_files)


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The markdown table of ``scale.json``'s figures (``>=``: a lower bound)."""
    head = (
        "| mode | N | files | save plan s (rank 1 / rank 0) | resume plan s (rank 1 / rank 0) | rank-0 publish + retention s "
        "| rank-0 metadata ops (save: critical path + own deletion share / resume) | index bytes read per rank | resume read per rank (of it replicated) "
        "| own files per rank | save collectives received per rank |"
    )
    lines = [head, "|" + "---|" * 11]
    for mode, cells in results.items():
        for n, fig in cells.items():
            low = set(fig.get("lower_bound", []))

            def v(key: str, fmt: Any = None, fig: dict[str, Any] = fig, low: set[str] = low) -> str:
                value = fig.get(key)
                if value is None:
                    return "n/a"
                text = fmt(value) if fmt else (f"{value:.3g}" if isinstance(value, float) else str(value))
                return (">= " if key in low else "") + text

            lines.append(
                f"| {mode} | {n} | {v('files')} | {v('save_plan_s')} / {v('rank0_save_plan_s')} "
                f"| {v('resume_plan_s')} / {v('rank0_resume_plan_s')} "
                f"| {v('rank0_publish_s')} | {v('rank0_critical_meta_ops')} + {v('rank0_background_meta_ops')} / {v('rank0_resume_meta_ops')} "
                f"| {v('index_bytes_per_rank', human_bytes)} "
                f"| {v('resume_read_bytes_per_rank', human_bytes)} ({v('replicated_bytes', human_bytes)}) | {v('own_file_bytes', human_bytes)} "
                f"| {v('collective_bytes_per_rank', human_bytes)} |"
            )
    return "\n".join(lines)


def functions_table(results: dict[str, dict[str, dict[str, Any]]], n: str) -> str:
    """Where the CPU goes at ``n`` ranks: the costliest library (and DCP) functions per run (inclusive, nested)."""
    lines = ["| mode | run | functions (CPU s, inclusive: nested ones are inside their callers) |", "|---|---|---|"]
    for mode, cells in results.items():
        fig = cells.get(n)
        if not fig:
            continue
        for run, functions in fig.get("functions", {}).items():
            listed = "; ".join(f"{name} {s:.3g}" for name, s in functions.items())
            lines.append(f"| {mode} | {run} | {listed} |")
    return "\n".join(lines)
