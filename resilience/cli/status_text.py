"""The text of ``resilience status``: the checkpoint table, the pointers, the resume pick and the
restart guard, from the document :func:`resilience.cli.status.inspect_root` returns."""

from __future__ import annotations

from typing import Any


def human_size(size: int | None) -> str:
    """``size`` bytes as ``"812 B"``, ``"12.3 KiB"``, ``"4.0 GiB"`` (powers of 1024); ``"-"`` for None."""
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _format_metric(metric: Any) -> str:
    if not isinstance(metric, dict) or "key" not in metric:
        return "-"
    value = metric.get("value")
    shown = f"{value:.6g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else ("-" if value is None else str(value))
    return f"{metric['key']}={shown}"


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """Plain text columns two spaces apart; columns in ``right`` right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = []
    for row in [headers, *rows]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


def _format_model(entry: dict[str, Any]) -> str:
    if entry["model_format"] is None:
        return "-"
    return f"{entry['model_format']} {entry['model_weights']}" + (" +HF" if entry["hf_bundle"] else "")


def format_status(doc: dict[str, Any]) -> str:
    """The terminal form of an :func:`inspect_root` document."""
    checks = "sizes and digests checked" if doc["deep"] else "sizes checked; --deep also checks digests"
    lines = [f"Checkpoints in {doc['root']} ({checks})", ""]
    if doc["checkpoints"]:
        rows = [
            [
                e["name"],
                "-" if e["global_step"] is None else str(e["global_step"]),
                "-" if e["epoch"] is None else str(e["epoch"]),
                e["saved_at"] or "-",
                human_size(e["size_bytes"]),
                e["state"],
                "-" if e["world_size"] is None else str(e["world_size"]),
                _format_model(e),
                ",".join(e["pointers"]) or "-",
                _format_metric(e["val_metric"]),
            ]
            for e in doc["checkpoints"]
        ]
        lines += _table(["NAME", "STEP", "EPOCH", "SAVED (UTC)", "SIZE", "STATE", "RANKS", "MODEL", "POINTERS", "VAL METRIC"], rows, right={1, 2, 4, 6})
        producers: dict[str, list[str]] = {}
        for e in doc["checkpoints"]:
            if e.get("producer"):
                producers.setdefault(e["producer"], []).append(e["name"])
        for producer, names in producers.items():
            count = f"{len(names)} checkpoint{'s' if len(names) != 1 else ''}"
            lines.append(f"Written by {producer} ({count}): its own checkpoint files with our manifest, resumed by its integration (resilience.integrations)")
        problems = []
        for e in doc["checkpoints"]:
            if e["marked_bad"] is not None:
                problems.append(f"  {e['name']}: marked bad: {e['marked_bad']}")
            if e["problem"]:
                problems.append(f"  {e['name']}: {e['problem']}")
        if problems:
            lines += ["", "Problems:", *problems]
    else:
        lines.append("(no checkpoints)")
    if doc["pointers"]:
        width = max(len(n) for n in doc["pointers"])
        lines += ["", "Pointers:"]
        for name, p in doc["pointers"].items():
            target = p["target"] or "?"
            lines.append(f"  {name.ljust(width)} -> {target} ({p['form']})" + (f": {p['error']}" if p["error"] else ""))
    resume = doc["resume"]
    lines += ["", f"Resume would pick: {resume['checkpoint'] or 'fresh start'}", f"  why: {resume['reason']}"]
    guard = doc.get("restart_guard")
    if guard is not None:
        # The guard counts a start that never reported how it ended as failed; so does this line.
        failed = guard["failed"] + int(guard["running"])
        last = ", counting the last start, which has not reported how it ended (still running, or crashed or killed)" if guard["running"] else ""
        lines.append(
            f"  starts in a row from {guard['resume_point'] or 'a fresh start'}: {guard['starts']} "
            f"(failed: {failed}{last}, limit {guard['limit']}; preempted cleanly before saving anything "
            f"new: {guard['preempted']}, limit {guard['preemption_limit']}"
            + (f"; exited 76 (NO_PROGRESS) at once: {guard['refused']}" if guard.get("refused") else "")
            + ")"
        )
        if guard["resume_point"] != resume["checkpoint"]:  # a checkpoint saved since: progress
            lines.append(f"  the next start resumes from {resume['checkpoint'] or 'a fresh start'} instead, so it starts a new count")
        if guard["next_start_exits_no_progress"]:
            lines.append(f"  the next start exits 76 (NO_PROGRESS) at once: {guard['why']}; fix the cause, then delete {guard['file']}")
    held = doc.get("held_stop")
    if held is not None:
        lines += [
            "",
            f"Stop signal held by resilience run: {', '.join(held['signals'])} held {held['held_s']:g} s for ranks {held['ranks']}, "
            "which never became ready (no resilient_loop(), no handler of their own), then delivered to them "
            f"at {held['at_utc']}; the ranks exited with {held['exit_codes']}, exit code {held['exit_code']}",
        ]
    return "\n".join(lines)
