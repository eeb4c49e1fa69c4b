"""``resilience status``, ``verify`` and ``advise`` on a real checkpoint root with real damage.

The root is written by :class:`Checkpointer` (a tiny model, five saves, one save interrupted
before its manifest), then damaged the way disks and people damage it: a truncated file, flipped
bytes, a deleted file, a manifest-less copy, a ``.bad`` marker, a text-form pointer. Outputs are
compared with golden files after normalising what varies between runs (times, sizes, file
counts, the tmp path, run ids); ``UPDATE_GOLDEN=1`` rewrites them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resilience import cli
from resilience.checkpoint import Checkpointer, TrainingState, writer
from resilience.checkpoint.layout import BAD_MARKER, MANIFEST
from resilience.checkpoint.policy.progress_guard import must_end
from resilience.checkpoint.reader import find_resume_checkpoint
from resilience.checkpoint.storage.manifest import all_files
from resilience.config import CheckpointConfig
from resilience.distributed import DistContext
from resilience.state.step_scheduler import StepScheduler
from resilience.timing import RunTimer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
VAL = {2: 0.9, 4: 0.3, 6: 0.5, 8: 0.4, 10: 0.35}
TIMINGS = {2: (None, None), 4: (0.2, None), 6: (0.25, 2.0), 8: (0.3, 3.0), 10: (0.2, 2.5)}
BAD_TEXT = "skipping invalid checkpoint: written by hand for this test\n"


class _Crash(SystemExit):
    """Not an ``Exception``: the writer does not clean up after it, as after a kill."""


def _crash_at_manifest(phase: str) -> None:
    if phase == "manifest":
        raise _Crash(9)


def build_root(root: Path) -> None:
    """Five real saves (steps 2..10), a save interrupted before its manifest (step 12), then damage."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # momentum buffers: the optimizer has state to save
    state = TrainingState(model=model, optimizer=optimizer)
    scheduler, timer = StepScheduler(num_epochs=1), RunTimer()
    ck = Checkpointer(CheckpointConfig(checkpoint_dir=str(root)), DistContext(), state=state, scheduler=scheduler, timer=timer)
    for step in (2, 4, 6, 8, 10):
        scheduler.load_state_dict({"epoch": 0, "batches_in_epoch": step, "global_step": step})
        ck.record_validation(step, {"val_loss": VAL[step]})
        timer.step_s, timer.save_s = TIMINGS[step]  # as the loop's timer would have measured
        ck.save()
    scheduler.load_state_dict({"epoch": 0, "batches_in_epoch": 12, "global_step": 12})
    writer.fault_hook = _crash_at_manifest
    try:
        with pytest.raises(_Crash):
            ck.save()
    finally:
        writer.fault_hook = None
    assert (root / ".staging_epoch_0_step_12").is_dir()

    # LATEST's target loses the end of a file (size check catches it).
    with open(root / "epoch_0_step_10" / "step_scheduler.json", "r+b") as fh:
        fh.truncate(10)
    # A copy that lost its manifest (incomplete).
    shutil.copytree(root / "epoch_0_step_8", root / "epoch_0_step_9", symlinks=True)
    (root / "epoch_0_step_9" / MANIFEST).unlink()
    # Marked bad at an earlier start.
    (root / "epoch_0_step_8" / BAD_MARKER).write_text(BAD_TEXT)
    # Flipped bytes, same size: only the digest catches it.
    rng = root / "epoch_0_step_6" / "rank_state" / "rank_00000.safetensors"
    data = bytearray(rng.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rng.write_bytes(bytes(data))
    # A deleted file.
    (root / "epoch_0_step_2" / "config.yaml").unlink()
    # LOWEST_VAL in its text form, a user's own pointer, and a text file that is no pointer.
    target = os.readlink(root / "LOWEST_VAL")
    (root / "LOWEST_VAL").unlink()
    (root / "LOWEST_VAL.txt").write_text(target + "\n")
    os.symlink("epoch_0_step_2", root / "release")
    (root / "notes.txt").write_text("keep step 4 for the paper\n")


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("status") / "ckpt"
    build_root(root)
    return root


def tree(root: Path) -> list[tuple]:
    """Every entry under ``root`` (and ``root``): path, type, size, mtime, mode, link target."""
    rows = []
    for dirpath, dirs, files in os.walk(root):
        for name in [".", *dirs, *files]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            link = os.readlink(path) if os.path.islink(path) else None
            rows.append((os.path.relpath(path, root), st.st_mode, st.st_size, st.st_mtime_ns, link))
    return sorted(rows)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


_SIZE = re.compile(r"\b\d+(?:\.\d)? (?:B|KiB|MiB|GiB|TiB)\b")
_TIME = re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def normalise_text(text: str, root: Path) -> str:
    text = text.replace(str(root), "<ROOT>")
    text = _TIME.sub("<TIME>", _SIZE.sub("<SIZE>", text))
    text = re.sub(r"\b\d+ files\b", "N files", re.sub(r"\bof \d+ files\b", "of N files", text))
    # Column widths follow the values normalised away; alignment is checked separately.
    return "\n".join(re.sub(r"(?<=\S) {2,}", "  ", line) for line in text.splitlines()) + "\n"


def normalise_json(value, root: Path):
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in ("saved_at", "saved_at_unix") and item is not None:
                item = "<TIME>"
            elif key in ("size_bytes", "bytes_checked", "files_checked", "run_id") and item is not None:
                item = f"<{key.upper()}>"
            out[key] = normalise_json(item, root)
        return out
    if isinstance(value, list):
        return [normalise_json(item, root) for item in value]
    if isinstance(value, str):
        return value.replace(str(root), "<ROOT>")
    return value


def check_golden(name: str, actual: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(actual)
    assert path.exists(), f"{path} missing: run with UPDATE_GOLDEN=1 to create it"
    assert actual == path.read_text(), f"{name} differs from the golden file (UPDATE_GOLDEN=1 rewrites it after a deliberate change)"


# -- status -------------------------------------------------------------------------------------


def test_status_text_matches_golden_and_columns_align(damaged, capsys):
    code, out, _ = run_cli(capsys, "status", str(damaged))
    assert code == 0
    check_golden("status_text.txt", normalise_text(out, damaged))
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("NAME"))
    col = lines[header].index("STATE")
    states = [line[col:].split("  ")[0] for line in lines[header + 1 : header + 8]]
    assert states == ["incomplete", "corrupt", "incomplete", "marked bad", "complete", "complete", "corrupt"]


def test_status_json_matches_golden(damaged, capsys):
    code, out, _ = run_cli(capsys, "status", str(damaged), "--json")
    assert code == 0
    doc = json.loads(out)
    check_golden("status.json", json.dumps(normalise_json(doc, damaged), indent=2, sort_keys=True) + "\n")
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    assert by_name["epoch_0_step_4"]["pointers"] == ["LOWEST_VAL"]
    assert by_name["epoch_0_step_10"]["pointers"] == ["LATEST"]
    assert by_name["epoch_0_step_2"]["pointers"] == ["release"]
    assert "notes" not in doc["pointers"]
    sizes = {name: sum(f.stat().st_size for f in (damaged / name).rglob("*") if f.is_file()) for name in by_name}
    assert {name: c["size_bytes"] for name, c in by_name.items()} == sizes
    assert doc["resume"]["checkpoint"] == "epoch_0_step_6"


def test_status_deep_catches_flipped_bytes_and_moves_the_resume_pick(damaged, capsys):
    code, out, _ = run_cli(capsys, "status", str(damaged), "--deep")
    assert code == 0
    check_golden("status_deep.txt", normalise_text(out, damaged))
    doc = json.loads(run_cli(capsys, "status", str(damaged), "--deep", "--json")[1])
    step6 = next(c for c in doc["checkpoints"] if c["name"] == "epoch_0_step_6")
    assert step6["state"] == "corrupt" and "checksum mismatch" in step6["problem"]
    assert doc["resume"]["checkpoint"] == "epoch_0_step_4"


def test_status_resume_pick_is_what_the_reader_picks(damaged, tmp_path, capsys):
    """--deep validates like a resume does: the reader, on a copy, must agree."""
    doc = json.loads(run_cli(capsys, "status", str(damaged), "--deep", "--json")[1])
    copy = tmp_path / "copy"
    shutil.copytree(damaged, copy, symlinks=True)
    chosen = find_resume_checkpoint(DistContext(), copy, None)
    assert chosen is not None and chosen.name == doc["resume"]["checkpoint"]
    # LATEST's lineage first (10 -> 8 -> 6 -> 4): the manifest-less copy 9 is no ancestor of 10, never reached
    assert [s["name"] for s in doc["resume"]["skipped"]] == ["epoch_0_step_10", "epoch_0_step_8", "epoch_0_step_6"]


def hand_made(root: Path, step: int, *, manifest: bool = True, truncate: bool = False, bad: bool = False) -> None:
    """A small checkpoint written without the Checkpointer: one file and its manifest."""
    directory = root / f"epoch_0_step_{step}"
    directory.mkdir(parents=True)
    data = f"weights of step {step}".encode()
    (directory / "a.bin").write_bytes(data[:3] if truncate else data)
    if manifest:
        files = {"a.bin": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
        (directory / MANIFEST).write_text(json.dumps({"format_version": 1, "meta": {"global_step": step}, "files": files}))
    if bad:
        (directory / BAD_MARKER).write_text("marked by hand\n")


RESUME_CASES = {
    # name: (checkpoints as (step, options), LATEST target or None, expected pick, words in the reason)
    "only_one_and_it_is_truncated": ([(2, {"truncate": True})], "epoch_0_step_2", None, "fresh start: skipped epoch_0_step_2 (LATEST, corrupt)"),
    "no_latest_pointer": ([(2, {}), (4, {"manifest": False})], None, "epoch_0_step_2", "no LATEST pointer; skipped epoch_0_step_4 (incomplete)"),
    "latest_names_a_deleted_checkpoint": ([(2, {}), (4, {})], "epoch_0_step_8", "epoch_0_step_4", "skipped epoch_0_step_8 (LATEST, missing)"),
    "newer_than_latest_is_not_a_candidate": ([(2, {}), (4, {}), (6, {})], "epoch_0_step_4", "epoch_0_step_4", "LATEST -> epoch_0_step_4, which is complete"),
    "latest_marked_bad": ([(2, {}), (4, {"bad": True})], "epoch_0_step_4", "epoch_0_step_2", "skipped epoch_0_step_4 (LATEST, marked bad)"),
}


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_status_resume_rule_mirrors_the_reader(tmp_path, capsys, case):
    checkpoints, latest, expected, reason = RESUME_CASES[case]
    root = tmp_path / "root"
    root.mkdir()
    for step, options in checkpoints:
        hand_made(root, step, **options)
    if latest is not None:
        os.symlink(latest, root / "LATEST")
    for deep in ([], ["--deep"]):
        doc = json.loads(run_cli(capsys, "status", str(root), "--json", *deep)[1])
        assert doc["resume"]["checkpoint"] == expected
        assert reason in doc["resume"]["reason"]
    chosen = find_resume_checkpoint(DistContext(), root, None)  # the reader (may write .bad: status ran first)
    assert (chosen.name if chosen else None) == expected


def test_status_verify_and_advise_never_modify_the_directory(damaged, capsys):
    before = tree(damaged)
    for argv in (["status", str(damaged)], ["status", str(damaged), "--deep", "--json"], ["verify", str(damaged), "--no-progress"], ["advise", str(damaged)]):
        run_cli(capsys, *argv)
    assert tree(damaged) == before
    assert not (damaged / "epoch_0_step_10" / BAD_MARKER).exists()  # the reader would have marked it


def test_status_of_an_empty_root_says_fresh_start(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "status", str(tmp_path))
    assert code == 0
    assert "(no checkpoints)" in out
    assert "Resume would pick: fresh start" in out and "no checkpoints under" in out


def test_status_of_one_checkpoint_says_to_pass_its_root(damaged, capsys):
    one = next(p for p in sorted(damaged.iterdir()) if (p / "manifest.json").is_file())
    code, out, err = run_cli(capsys, "status", str(one))
    assert code == 2 and out == ""
    assert "is one checkpoint, not a checkpoint root" in err and f"resilience status {damaged}" in err


def test_status_of_an_empty_argument_is_a_usage_error_not_the_current_directory(capsys):
    code, out, err = run_cli(capsys, "status", "")
    assert code == 2 and out == "" and "CHECKPOINT_DIR: empty" in err


def test_status_of_a_missing_directory_is_a_usage_error(tmp_path, capsys):
    code, out, err = run_cli(capsys, "status", str(tmp_path / "nope"))
    assert code == 2 and out == ""
    assert "CHECKPOINT_DIR" in err and "no such directory" in err


# -- verify -------------------------------------------------------------------------------------


def test_verify_root_reports_every_failure_and_exits_1(damaged, capsys):
    code, out, err = run_cli(capsys, "verify", str(damaged), "--no-progress")
    assert code == 1
    assert err == ""  # --no-progress: nothing on stderr
    check_golden("status_verify.txt", normalise_text(out, damaged))
    code, out, _ = run_cli(capsys, "verify", str(damaged), "--json", "--no-progress")
    assert code == 1
    doc = json.loads(out)
    check_golden("status_verify.json", json.dumps(normalise_json(doc, damaged), indent=2, sort_keys=True) + "\n")
    for result in doc["checkpoints"]:
        manifest = damaged / result["name"] / MANIFEST
        if manifest.exists():  # every file: the manifest's list and the rank manifest's own files
            assert result["files_checked"] == len(all_files(manifest.parent, json.loads(manifest.read_text())))
    assert {r["name"]: r["ok"] for r in doc["checkpoints"]} == {
        "epoch_0_step_10": False,
        "epoch_0_step_9": False,
        "epoch_0_step_8": True,
        "epoch_0_step_6": False,
        "epoch_0_step_4": True,
        "epoch_0_step_2": False,
    }


def test_verify_root_lists_a_checkpoint_set_aside_after_a_rollback_as_skipped_and_verifies_it_by_path(damaged, tmp_path, capsys):
    root = tmp_path / "root"
    shutil.copytree(damaged, root, symlinks=True)
    aside = root / "epoch_0_step_4.abandoned-20261201T000000Z"
    shutil.copytree(root / "epoch_0_step_4", aside, symlinks=True)
    code, out, _ = run_cli(capsys, "verify", str(root), "--no-progress")
    assert code == 1
    assert f"{aside.name}: skipped (set aside after a rollback, never resumed from; give its path to verify it)" in out.splitlines()
    code, out, _ = run_cli(capsys, "verify", str(root), "--json", "--no-progress")
    assert json.loads(out)["set_aside"] == [aside.name]
    with open(aside / "step_scheduler.json", "r+b") as fh:
        fh.truncate(5)
    code, out, _ = run_cli(capsys, "verify", str(aside), "--no-progress")
    assert code == 1 and out.startswith(f"{aside.name}: FAILED") and "step_scheduler.json" in out


def test_verify_one_good_checkpoint_exits_0_with_a_progress_bar(damaged, capsys):
    code, out, err = run_cli(capsys, "verify", str(damaged / "epoch_0_step_4"))
    assert code == 0
    assert out.startswith("epoch_0_step_4: ok, ") and out.rstrip().endswith("1 checkpoint verified: 1 ok, 0 failed")
    assert "epoch_0_step_4" in err and "B" in err  # tqdm's bar, on stderr


def test_verify_one_flipped_checkpoint_exits_1_naming_the_file(damaged, capsys):
    code, out, _ = run_cli(capsys, "verify", str(damaged / "epoch_0_step_6"), "--no-progress")
    assert code == 1
    assert "  rank_state/rank_00000.safetensors: checksum mismatch (corrupted bytes)" in out.splitlines()


@pytest.mark.parametrize("what", ["missing", "empty", "file"])
def test_verify_bad_path_exits_2(tmp_path, capsys, what):
    path = tmp_path / "x"
    if what == "empty":
        path.mkdir()
    elif what == "file":
        path.write_text("")
    code, out, err = run_cli(capsys, "verify", str(path))
    assert code == 2 and out == ""
    assert err.startswith("resilience verify: PATH")


@pytest.mark.timeout(60)
def test_verify_exit_code_through_the_console_entry_point(damaged):
    run = subprocess.run(
        [sys.executable, "-m", "resilience", "verify", str(damaged / "epoch_0_step_2"), "--no-progress"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert run.returncode == 1
    assert "config.yaml: missing" in run.stdout


# -- advise -------------------------------------------------------------------------------------


def write_manifest(root: Path, step: int, saved_at: float, step_s, save_s) -> None:
    directory = root / f"epoch_0_step_{step}"
    directory.mkdir(parents=True)
    meta = {
        "epoch": 0,
        "global_step": step,
        "world_size": 1,
        "reason": "periodic",
        "saved_at": saved_at,
        "run_id": "r",
        "is_async": False,
        "timings": {"step_s": step_s, "save_s": save_s},
    }
    (directory / MANIFEST).write_text(json.dumps({"format_version": 1, "meta": meta, "files": {}}))


@pytest.fixture
def timed(tmp_path) -> Path:
    root = tmp_path / "timed"
    write_manifest(root, 2, 100.0, None, None)  # the first save: nothing timed yet
    write_manifest(root, 4, 200.0, 0.4, None)
    write_manifest(root, 6, 300.0, 0.5, 4.0)  # the newest with both times
    write_manifest(root, 8, 400.0, 0.6, None)  # newest, but no save time
    write_manifest(root, 10, 50.0, 0.3, 2.0)  # highest step, oldest save (another run)
    return root


def test_advise_uses_the_newest_checkpoint_with_both_times(timed, capsys):
    code, out, _ = run_cli(capsys, "advise", str(timed))
    assert code == 0
    check_golden("status_advise.txt", out)
    # ((2*1 - 1) * 0.5 + 4.0) * 1.5 = 6.75; ceil(6.75 + 30) = 37
    assert "  ((2 x 1 - 1) x 0.5 s + 4 s) x 1.5 = (1 x 0.5 + 4) x 1.5 = 6.750 s" in out.splitlines()
    assert "  N = ceil(6.750 + 30) = 37" in out.splitlines()
    assert out.splitlines()[-2] == "#SBATCH --signal=B:USR1@37"


def test_advise_cadence_and_safety_enter_the_formula_and_ceil_keeps_whole_seconds(timed, capsys):
    code, out, _ = run_cli(capsys, "advise", str(timed), "--safety", "2", "--agreement-every-steps", "2", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["seconds_needed"] == pytest.approx((3 * 0.5 + 4.0) * 2)  # 11.0
    assert doc["lead_s"] == 41 and doc["sbatch"] == "#SBATCH --signal=B:USR1@41"


def test_advise_median_over_checkpoints(timed, capsys):
    doc = json.loads(run_cli(capsys, "advise", str(timed), "--median", "--json")[1])
    assert doc["step_s"] == pytest.approx(0.45) and doc["save_s"] == pytest.approx(3.0)  # medians of [.3 .4 .5 .6], [2 4]
    assert doc["lead_s"] == 36  # ceil((0.45 + 3.0) * 1.5 + 30) = ceil(35.175)


def test_advise_counts_an_untimed_save_as_one_step(tmp_path, capsys):
    write_manifest(tmp_path, 4, 200.0, 0.4, None)
    code, out, _ = run_cli(capsys, "advise", str(tmp_path))
    assert code == 0
    assert "note: no save time recorded yet" in out
    assert "#SBATCH --signal=B:USR1@32" in out  # ceil((0.4 + 0.4) * 1.5 + 30) = ceil(31.2)


def test_advise_of_an_empty_root_says_there_are_no_checkpoints(tmp_path, capsys):
    code, out, err = run_cli(capsys, "advise", str(tmp_path))
    assert code == 1 and out == "" and "no checkpoint with a readable manifest under" in err


def test_advise_shows_sub_millisecond_steps_so_the_printed_arithmetic_adds_up(tmp_path, capsys):
    write_manifest(tmp_path, 2, 100.0, 0.000812, 0.0223)
    code, out, _ = run_cli(capsys, "advise", str(tmp_path))
    assert code == 0 and "(1229 x 0.000812 + 0.0223) x 1.5 = 1.530 s" in out and "k = 615 for 0.000812 s steps" in out, out


def test_advise_without_timings_exits_1_saying_why(tmp_path, capsys):
    write_manifest(tmp_path, 2, 100.0, None, None)
    code, out, err = run_cli(capsys, "advise", str(tmp_path))
    assert code == 1 and out == ""
    assert "no step times recorded" in err


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--safety", "0"], "--safety"),
        (["--safety", "0.5"], "--safety"),
        (["--safety", "x"], "--safety"),
        (["--agreement-every-steps", "0"], "--agreement-every-steps"),
        ([], "CHECKPOINT_DIR"),
    ],
)
def test_advise_bad_arguments_exit_2_naming_them(tmp_path, capsys, argv, names):
    root = tmp_path if argv else tmp_path / "nope"
    code, _, err = run_cli(capsys, "advise", str(root), *argv)
    assert code == 2 and names in err


def test_registering_the_commands_keeps_torch_out_of_cli_import():
    run = subprocess.run(
        [sys.executable, "-c", "import sys, resilience.cli; print('torch' in sys.modules)"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert run.stdout.strip() == "False", run.stderr


def test_status_of_a_relative_root_keeps_absolute_paths_in_messages_whole(damaged, capsys, monkeypatch):
    # A .bad reason names the file by its absolute path; given the root as "ck", stripping "ck/"
    # must not cut it out of "/.../ck/epoch_..." elsewhere in the path.
    bad = damaged / "epoch_0_step_8" / BAD_MARKER
    bad.write_text(f"{damaged / 'epoch_0_step_8' / 'model' / 'x.safetensors'}: checksum mismatch\n")
    monkeypatch.chdir(damaged.parent)
    code, out, _ = run_cli(capsys, "status", damaged.name, "--json")
    assert code == 0
    entry = next(e for e in json.loads(out)["checkpoints"] if e["name"] == "epoch_0_step_8")
    assert entry["marked_bad"] == "epoch_0_step_8/model/x.safetensors: checksum mismatch"


def test_advise_takes_cadence_and_signal_from_the_runs_saved_config(timed, capsys):
    (timed / "epoch_0_step_6" / "config.yaml").write_text("step_scheduler:\n  agreement_every_steps: 4\n  preemption_signal: [SIGTERM]\n")
    code, out, _ = run_cli(capsys, "advise", str(timed), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["agreement_every_steps"] == 4
    assert doc["seconds_needed"] == pytest.approx((7 * 0.5 + 4.0) * 1.5)
    assert doc["sbatch"].startswith("#SBATCH --signal=B:TERM@")
    # an explicit --agreement-every-steps still wins
    code, out, _ = run_cli(capsys, "advise", str(timed), "--json", "--agreement-every-steps", "1")
    assert json.loads(out)["agreement_every_steps"] == 1


def test_status_shows_the_restart_guard_and_when_the_next_start_would_exit_76(damaged, capsys):
    code, out, _ = run_cli(capsys, "status", str(damaged), "--json")
    pick = json.loads(out)["resume"]["checkpoint"]
    assert json.loads(out)["restart_guard"] is None  # nothing counted yet
    (damaged / ".starts.json").write_text(json.dumps({"resume_point": pick, "starts": 1}))
    code, out, _ = run_cli(capsys, "status", str(damaged))
    assert f"starts in a row from {pick}: 1" in out and "exits 76" not in out
    # A start that has not reported how it ended counts as failed, in the line as in the guard.
    (damaged / ".starts.json").write_text(json.dumps({"resume_point": pick, "failed": 0, "preempted": 1, "running": True}))
    code, out, _ = run_cli(capsys, "status", str(damaged))
    assert f"starts in a row from {pick}: 2 (failed: 1, counting the last start, which has not reported how it ended" in out
    assert "starts a new count" not in out
    # Counted from a fresh start, but that start saved a checkpoint before it was killed.
    (damaged / ".starts.json").write_text(json.dumps({"resume_point": None, "failed": 0, "preempted": 0, "running": True}))
    code, out, _ = run_cli(capsys, "status", str(damaged))
    assert "starts in a row from a fresh start: 1 (failed: 1, counting the last start" in out
    assert f"the next start resumes from {pick} instead, so it starts a new count" in out and "exits 76" not in out
    (damaged / ".starts.json").write_text(json.dumps({"resume_point": pick, "starts": 3}))
    code, out, _ = run_cli(capsys, "status", str(damaged), "--json")
    guard = json.loads(out)["restart_guard"]
    assert guard["starts"] == 3 and guard["limit"] == 3 and guard["next_start_exits_no_progress"] is True
    code, out, _ = run_cli(capsys, "status", str(damaged))
    assert "the next start exits 76 (NO_PROGRESS) at once" in out and ".starts.json" in out


def test_a_start_that_exited_76_is_shown_as_such_not_as_one_that_never_reported_and_the_next_still_exits_76(damaged, capsys):
    code, out, _ = run_cli(capsys, "status", str(damaged), "--json")
    pick = json.loads(out)["resume"]["checkpoint"]
    (damaged / ".starts.json").write_text(json.dumps({"resume_point": pick, "failed": 3, "preempted": 0, "running": False}))
    for refused in (1, 2):
        assert must_end(DistContext(), damaged, damaged / pick, limit=3) is True
        code, out, _ = run_cli(capsys, "status", str(damaged))
        assert f"starts in a row from {pick}: {3 + refused} (failed: 3, limit 3;" in out, out
        assert f"exited 76 (NO_PROGRESS) at once: {refused})" in out and "has not reported" not in out
        assert "the next start exits 76 (NO_PROGRESS) at once" in out


@pytest.mark.parametrize(
    "slurm,warned",
    [
        ("  launcher: torchrun\n", True),
        ("  launcher: torchrun\n  setup: ['export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120']\n", False),
        ("  launcher: resilience\n", False),
    ],
    ids=["torchrun", "torchrun-shutdown-timeout-120", "resilience"],
)
def test_advise_warns_when_a_stop_outlasts_torchruns_sigterm_budget(tmp_path, capsys, slurm, warned):
    """torchrun's agent SIGKILLs its workers 30 s after its own SIGTERM: a 40 s save is lost there."""
    root = tmp_path / "slow"
    write_manifest(root, 6, 300.0, 0.5, 40.0)
    (root / "epoch_0_step_6" / "config.yaml").write_text("step_scheduler:\n  agreement_every_steps: 1\nslurm:\n" + slurm)
    code, out, _ = run_cli(capsys, "advise", str(root))
    assert code == 0
    assert ("warning: slurm.launcher: torchrun: a stop needs 60.8 s" in out) == warned, out
    if warned:
        assert "SIGKILLs its workers 30 s after it receives SIGTERM" in out
        assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=61" in out
    doc = json.loads(run_cli(capsys, "advise", str(root), "--json")[1])
    assert bool(doc["warnings"]) == warned


def test_status_tells_failed_from_cleanly_preempted_starts_and_says_why_the_next_start_would_exit_76(damaged, capsys):
    code, out, _ = run_cli(capsys, "status", str(damaged), "--json")
    pick = json.loads(out)["resume"]["checkpoint"]

    def guard_for(**doc):
        (damaged / ".starts.json").write_text(json.dumps({"resume_point": pick, **doc}))
        _, text, _ = run_cli(capsys, "status", str(damaged))
        _, js, _ = run_cli(capsys, "status", str(damaged), "--json")
        return text, json.loads(js)["restart_guard"]

    text, guard = guard_for(failed=0, preempted=5, running=False)
    assert guard["preempted"] == 5 and guard["preemption_limit"] == 10 and guard["next_start_exits_no_progress"] is False
    assert "preempted cleanly before saving anything new: 5" in text and "exits 76" not in text
    # the last start never reported its end: counted as failed, and with it the limit is reached
    text, guard = guard_for(failed=2, preempted=1, running=True)
    assert guard["next_start_exits_no_progress"] is True and "max_restarts_without_progress: 3" in guard["why"]
    assert "(failed: 3, counting the last start, which has not reported how it ended" in text
    assert "the next start exits 76 (NO_PROGRESS) at once: the 3 starts before it" in text
    text, guard = guard_for(failed=0, preempted=10, running=False)
    assert guard["next_start_exits_no_progress"] is True and "max_preemptions_without_progress: 10" in guard["why"]
    assert "were each preempted before they could save anything new" in text


def _save_one(root: Path, model: torch.nn.Module, **checkpoint) -> Path:
    ck = Checkpointer(
        CheckpointConfig(checkpoint_dir=str(root), **checkpoint),
        DistContext(),
        state=TrainingState(model=model),
        scheduler=StepScheduler(num_epochs=1, batches_in_epoch=1, global_step=1),
    )
    return ck.save()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_status_shows_model_format_world_size_hf_bundle_and_adapters(tmp_path, capsys):
    peft = pytest.importorskip("peft")
    kinds = {
        "dcp": _save_one(tmp_path / "dcp", _mlp(), model_save_format="torch_save", save_consolidated=False),
        "shards": _save_one(tmp_path / "shards", _mlp()),
        "bundle": _save_one(tmp_path / "bundle", _mlp()),
        "lora": _save_one(tmp_path / "lora", peft.get_peft_model(_mlp(), peft.LoraConfig(target_modules=["0"], r=2))),
    }
    assert run_cli(capsys, "consolidate", str(kinds["bundle"]))[0] == 0
    want = {
        "dcp": ("torch_save", "full", False, "torch_save full"),
        "shards": ("safetensors", "full", False, "safetensors full"),
        "bundle": ("safetensors", "full", True, "safetensors full +HF"),
        "lora": ("safetensors", "adapters", False, "safetensors adapters"),
    }
    for name, (fmt, weights, hf, shown) in want.items():
        code, out, _ = run_cli(capsys, "status", str(tmp_path / name), "--json")
        entry = json.loads(out)["checkpoints"][0]
        assert (entry["model_format"], entry["model_weights"], entry["hf_bundle"], entry["world_size"]) == (fmt, weights, hf, 1), name
        code, out, _ = run_cli(capsys, "status", str(tmp_path / name))
        header, row = out.splitlines()[2:4]
        assert "RANKS" in header and "MODEL" in header
        assert re.search(rf"complete\s+1\s+{re.escape(shown)}\s", row), row


def test_verify_checks_a_bundle_consolidated_after_the_checkpoint(tmp_path, capsys):
    directory = _save_one(tmp_path, _mlp())
    assert run_cli(capsys, "consolidate", str(directory))[0] == 0
    bundle = directory / "model" / "consolidated"
    code, out, _ = run_cli(capsys, "verify", str(directory), "--json", "--no-progress")
    result = json.loads(out)["checkpoints"][0]
    assert code == 0 and result["bundle"] == "verified"
    assert result["files_checked"] == len(all_files(directory, json.loads((directory / MANIFEST).read_text()))) + len(
        json.loads((bundle / "bundle_manifest.json").read_text())["files"]
    )

    weights = bundle / "model-00001-of-00001.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    code, out, _ = run_cli(capsys, "verify", str(directory), "--no-progress")
    assert code == 1
    assert "model/consolidated/model-00001-of-00001.safetensors: checksum mismatch" in out

    (bundle / "bundle_manifest.json").unlink()
    code, out, _ = run_cli(capsys, "verify", str(directory), "--no-progress")
    assert code == 0 and "model/consolidated/: unverified" in out, "a bundle without its manifest is reported, not trusted"
