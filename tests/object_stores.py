"""A real S3 endpoint for the tests: moto's standalone server on 127.0.0.1, started as a process
(as s3fs's own test suite does) and stopped by its PID; plus an msc configuration with a POSIX
profile. No client is mocked in-process: boto3 and multi-storage-client talk to these as they
would to a bucket.

:func:`start_moto` / :meth:`Moto.stop` are used by the session fixture ``s3_endpoint``
(tests/conftest.py) and by the bench (bench/object_store.py). The environment a rank needs
(``AWS_ENDPOINT_URL``, credentials, ``MSC_CONFIG``) goes in :meth:`Moto.env` and :func:`msc_env`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import torch
from safetensors.torch import load

from resilience.checkpoint.formats.model_io import model_file
from resilience.checkpoint.layout import LATEST
from resilience.checkpoint.storage.manifest import data_dir, read_manifest
from resilience.checkpoint.storage.object_path import ObjectPath, root_location
from resilience.checkpoint.storage.stores import forget_stores

MSC_PROFILE = "resilience-posix"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Moto:
    """A running moto server: ``url`` (``http://127.0.0.1:<port>``), its process."""

    url: str
    proc: subprocess.Popen

    def env(self) -> dict[str, str]:
        """What boto3 reads: the endpoint and (fake) credentials; no instance-metadata lookups."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_MAX_ATTEMPTS": "3",
        }

    def bucket(self, name: str | None = None) -> str:
        """Create a fresh bucket; returns its name."""
        import boto3

        name = name or f"ck-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1").create_bucket(
            Bucket=name
        )
        return name

    def stop(self) -> None:
        """Stop the server by its PID (SIGTERM, then SIGKILL after 5 s)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_moto(timeout_s: float = 30.0) -> Moto:
    """Start ``python -m moto.server`` on a free port of 127.0.0.1 and wait until it answers."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
            return Moto(url, proc)
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto server did not start on {url}") from None
            time.sleep(0.1)


def msc_env(base: Path) -> dict[str, str]:
    """An msc configuration with the POSIX profile :data:`MSC_PROFILE` storing under ``base``."""
    base.mkdir(parents=True, exist_ok=True)
    config = base.parent / f"{base.name}.msc.yaml"
    config.write_text(f"profiles:\n  {MSC_PROFILE}:\n    storage_provider:\n      type: file\n      options:\n        base_path: {base}\n")
    return {"MSC_CONFIG": str(config)}


def set_env(env: dict[str, str]) -> dict[str, str | None]:
    """Put ``env`` into this process's environment (the ranks inherit it); returns the old values."""
    old = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    forget_stores()
    return old


def restore_env(old: dict[str, str | None]) -> None:
    """Undo :func:`set_env`."""
    for key, value in old.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    forget_stores()


def latest(url: str) -> str | None:
    """The checkpoint name ``LATEST`` holds under ``url`` (``None``: no pointer)."""
    root = root_location(url)
    return root.store.read_pointer(LATEST)


def object_final_weights(url: str) -> dict[str, torch.Tensor]:
    """The model weights of the checkpoint ``LATEST`` names under ``url`` (a replicated model's one file)."""
    root = root_location(url)
    checkpoint = root / latest(url)
    files_at = data_dir(checkpoint, read_manifest(checkpoint))
    return load((files_at / model_file()).read_bytes())


def keys(url: str) -> list[str]:
    """Every object under ``url`` (keys relative to it), sorted."""
    root = root_location(url)
    assert isinstance(root, ObjectPath)
    return sorted(o.rel for o in root.store.list("")[0])
