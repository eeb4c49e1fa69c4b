"""Object-store URLs never become local folders named after them.

``checkpoint.checkpoint_dir=s3://bucket/x`` used to train, exit 0 and write full checkpoints into
``./s3:/bucket/x/``; ``resilience status s3://bucket/x`` then read that folder. Every path-valued
key and every command that takes a checkpoint path now refuses a ``scheme://`` URL (exit 2 from
the commands), naming the key and what is accepted; ``file:///abs`` is the local path ``/abs``.
``checkpoint_dir`` (and status/verify/consolidate) take ``s3://`` and ``msc://`` for object storage
(tests/checkpoint/test_object_store.py); without credentials that is a ConfigError too, and
no local folder either.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilience import cli
from resilience.config import ConfigError, config_from_dict, load_config
from tiny_runs import attempt  # the tiny training run under a config

URLS = ["s3://bucket/x", "gs://bucket/x", "hdfs://namenode/x", "az://container/x"]
KEYS = [
    ("checkpoint", "checkpoint_dir"),
    ("checkpoint", "save_path"),  # MindSpore's spelling of checkpoint_dir
    ("checkpoint", "restore_from"),
    ("checkpoint", "load_path"),
    ("slurm", "script"),
    ("slurm", "output"),
]


BACKED = ("checkpoint_dir", "save_path")  # the keys an s3:// URL is object storage for


@pytest.mark.parametrize("section,key,url", [(s, k, u) for s, k in KEYS for u in URLS if not (k in BACKED and u.startswith("s3://"))])
def test_an_object_store_url_in_any_path_key_is_a_config_error_naming_the_key_before_any_step(tmp_path, monkeypatch, section, key, url):
    monkeypatch.chdir(tmp_path)
    config: dict = {section: {key: url}}
    if key not in ("checkpoint_dir", "save_path"):
        config.setdefault("checkpoint", {})["checkpoint_dir"] = str(tmp_path / "ck")
    error, ran = attempt(config)
    assert isinstance(error, ConfigError), repr(error)
    assert f"{section}.{key}={url!r}" in str(error)
    assert "URLs are not supported" in str(error) and "file:///absolute/path" in str(error)
    assert ran == []
    assert sorted(os.listdir(tmp_path)) == [], "nothing written, no folder named after the URL"


@pytest.mark.parametrize("key", BACKED)
def test_an_s3_checkpoint_dir_without_credentials_is_a_config_error_before_any_step_and_no_folder(tmp_path, monkeypatch, key):
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("AWS_") and n != "AWS_EC2_METADATA_DISABLED"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path.parent / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path.parent / "no-config"))
    error, ran = attempt({"checkpoint": {key: "s3://bucket/x", "local_dir": str(tmp_path.parent / f"local-{key}")}})
    assert isinstance(error, ConfigError), repr(error)
    assert "checkpoint.checkpoint_dir='s3://bucket/x'" in str(error) and "no AWS credentials found" in str(error)
    assert ran == [] and sorted(os.listdir(tmp_path)) == []


def test_an_object_store_url_given_as_a_command_line_override_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"checkpoint\.checkpoint_dir='gs://bucket/x': gs:// URLs are not supported"):
        load_config(None, ["checkpoint.checkpoint_dir=gs://bucket/x", "checkpoint.max_recent_checkpoints=null"])


def test_a_file_url_is_the_local_path_it_names_and_no_folder_called_file_is_made(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    target = tmp_path / "my ck"
    error, ran = attempt({"checkpoint": {"checkpoint_dir": "file://" + str(target).replace(" ", "%20")}})
    assert error is None and ran == [1, 2, 3, 4]
    assert (target / "LATEST").exists()
    assert os.listdir(work) == []
    cfg = config_from_dict({"checkpoint": {"checkpoint_dir": "file:///scratch/ck", "restore_from": "file://localhost/scratch/ck/epoch_0_step_2"}})
    assert (cfg.checkpoint.checkpoint_dir, cfg.checkpoint.restore_from) == ("/scratch/ck", "/scratch/ck/epoch_0_step_2")


def test_a_home_relative_path_is_expanded_and_no_folder_called_tilde_is_made(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    error, ran = attempt({"checkpoint": {"checkpoint_dir": "~/ck"}})
    assert error is None and ran == [1, 2, 3, 4]
    assert (tmp_path / "home" / "ck" / "LATEST").exists() and os.listdir(work) == []
    assert load_config(None, ["slurm.output=~/logs/%j.out"]).slurm.output == str(tmp_path / "home" / "logs" / "%j.out")


@pytest.mark.parametrize("text", ["file://otherhost/ck", "file://relative/ck", "file:relative/ck", "FILE:/abs/ck"])
def test_a_file_url_naming_another_host_is_refused(text):
    with pytest.raises(ConfigError, match=r"checkpoint\.checkpoint_dir=.*file:///path"):
        config_from_dict({"checkpoint": {"checkpoint_dir": text}})


@pytest.mark.parametrize("command", [["status"], ["status", "--deep"], ["verify"], ["advise"], ["consolidate"], ["consolidate", "--output"]])
def test_checkpoint_commands_exit_2_on_an_object_store_url_even_when_a_folder_named_after_it_exists(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    # What the old behaviour left behind: a local folder "gs:/bucket/x" holding a checkpoint root
    # (s3:// and msc:// are object storage for status, verify and consolidate: test_object_store.py)
    (tmp_path / "gs:" / "bucket" / "x" / "epoch_0_step_1").mkdir(parents=True)
    if command[-1] == "--output":
        args = ["consolidate", str(tmp_path / "gs:" / "bucket" / "x" / "epoch_0_step_1"), "--output", "gs://bucket/bundle"]
        name = "--output='gs://bucket/bundle'"
    else:
        args = [command[0], "gs://bucket/x", *command[1:]]
        name = "='gs://bucket/x'"
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert name in err and "URLs are not supported" in err


def test_resilience_status_with_a_url_exits_2_in_a_real_process(tmp_path):
    (tmp_path / "gs:" / "bucket" / "x").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run([sys.executable, "-m", "resilience", "status", "gs://bucket/x"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "CHECKPOINT_DIR='gs://bucket/x': gs:// URLs are not supported" in result.stderr
