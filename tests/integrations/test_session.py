"""The shared core of trainer integrations (resilience.integrations.session) on one process: real
signals, real files, the checkpointer's own publish path around files a "trainer" writes itself."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from resilience import ExitCode
from resilience.checkpoint.layout import CONFIG, LATEST, STARTS_FILE, rank_manifest_file
from resilience.checkpoint.storage.manifest import validate
from resilience.checkpoint.writer import CheckpointSaveError
from resilience.config import ConfigError
from resilience.integrations.session import TrainerSession

pytestmark = pytest.mark.usefixtures("no_launcher_environment")


def _session(root: Path, **checkpoint) -> TrainerSession:
    config = {"step_scheduler": {"preemption_signal": "USR1", "agreement_every_steps": 1}, "checkpoint": {"checkpoint_dir": str(root), **checkpoint}}
    return TrainerSession(config, producer="toy.Trainer", producer_version="1.0")


def _writer(payload: bytes):
    """A trainer's own save: two files, one in a subdirectory; returns what it wrote."""

    def write(staging: Path) -> list[str]:
        (staging / "weights.bin").write_bytes(payload)
        (staging / "state").mkdir()
        (staging / "state" / "trainer.json").write_text(json.dumps({"payload": payload.hex()}))
        return ["weights.bin", str(staging / "state" / "trainer.json")]  # relative or absolute inside staging

    return write


def test_a_signal_stops_at_the_step_end_and_the_trainers_files_are_published_and_resumed(tmp_path):
    root = tmp_path / "ck"
    with _session(root) as session:
        assert session.resume_point() is None and session.exit_code is None and not session.stop_before_start()
        session.training_started(0)
        assert session.step_end(1) == 0
        os.kill(os.getpid(), signal.SIGUSR1)  # recorded by the session's handler, not fatal
        assert session.step_end(2) == 1  # one process: agreed at once
        saved = session.save("preemption", _writer(b"step two"), step=2, epoch=0, epoch_complete=False, meta={"extra": 1})
        assert session.finish(stopped_at=2) == ExitCode.PREEMPTED
    assert saved == root.absolute() / "epoch_0_step_2" and os.readlink(root / LATEST) == "epoch_0_step_2"
    doc = validate(saved)  # sizes and digests of every file
    assert sorted(doc["files"]) == sorted([CONFIG, "weights.bin", "state/trainer.json", rank_manifest_file(0, 0)])  # no own files: an empty rank manifest
    assert doc["meta"]["producer"] == "toy.Trainer" and doc["meta"]["reason"] == "preemption" and doc["meta"]["extra"] == 1
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the handler is gone with the session

    with _session(root) as session:
        assert session.resume_point() == saved and session.resumed_meta["global_step"] == 2
        session.training_started(2)
        assert session.step_end(3) == 0
        again = session.save("final", _writer(b"step three"), step=3, epoch=0, epoch_complete=True)
        assert session.finish() == ExitCode.DONE
    assert validate(again)["meta"]["parent"]["name"] == "epoch_0_step_2" and not (root / STARTS_FILE).exists()


def test_a_corrupt_latest_is_skipped_before_the_trainer_reads_it(tmp_path):
    root = tmp_path / "ck"
    with _session(root) as session:
        session.resume_point()
        older = session.save("periodic", _writer(b"one"), step=1, epoch=0, epoch_complete=False)
        newer = session.save("periodic", _writer(b"two"), step=2, epoch=0, epoch_complete=False)
        session.finish()
    (newer / "weights.bin").write_bytes(b"tw0")  # same size: only a digest finds it
    with _session(root) as session:
        assert session.resume_point() == older  # every digest is checked before the trainer loads anything
        session.finish()
    assert (newer / ".bad").exists()


def test_starts_that_never_finish_end_with_exit_76(tmp_path):
    root = tmp_path / "ck"
    with _session(root) as session:
        session.resume_point()
        session.save("periodic", _writer(b"one"), step=1, epoch=0, epoch_complete=False)
    for _ in range(3):  # crashed starts: they never reach finish()
        with pytest.raises(RuntimeError), _session(root) as session:
            assert session.resume_point() is not None and session.exit_code is None
            raise RuntimeError("out of memory")
    with _session(root) as session:
        session.resume_point()
        assert session.exit_code == ExitCode.NO_PROGRESS


def test_a_stop_before_the_first_step_leaves_with_75_and_saves_nothing(tmp_path):
    root = tmp_path / "ck"
    with _session(root) as session:
        session.resume_point()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert session.stop_before_start() and session.exit_code == ExitCode.PREEMPTED
    assert not (root / LATEST).exists()


def test_a_file_outside_the_staging_directory_fails_the_save_and_leaves_latest(tmp_path):
    root = tmp_path / "ck"
    with _session(root) as session:
        session.resume_point()
        session.save("periodic", _writer(b"one"), step=1, epoch=0, epoch_complete=False)
        with pytest.raises(CheckpointSaveError, match="not a file of its own"):
            session.save("periodic", lambda staging: [str(tmp_path / "elsewhere")], step=2, epoch=0, epoch_complete=False)
        session.finish()
    assert os.readlink(root / LATEST) == "epoch_0_step_1"


@pytest.mark.parametrize(
    "key,value", [("is_async", True), ("no_save_optim", True), ("no_load_optim", True), ("model_save_format", "torch_save"), ("save_consolidated", "every")]
)
def test_keys_of_our_own_format_are_refused_at_setup(tmp_path, key, value):
    with pytest.raises(ConfigError, match=f"checkpoint.{key}="):
        _session(tmp_path / "ck", **{key: value})
