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


class Proxy:
    """A TCP forwarder on 127.0.0.1 in front of an endpoint, to make it fail for real: ``mode``
    ``"pass"`` forwards every connection; ``"refuse"`` closes the listening socket and every open
    connection (the endpoint stopped); ``"503"`` answers each request ``503 Slow Down`` (S3's
    throttling) and closes. ``requests`` counts the connections answered 503. Threads, stopped by
    :meth:`close`."""

    def __init__(self, target: str):
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.mode = "pass"
        self.requests = 0
        self._conns: list[socket.socket] = []
        self._lock = __import__("threading").Lock()
        self._listener: socket.socket | None = None
        self._listen()

    def _listen(self) -> None:
        import threading

        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        import threading

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self.mode == "503":
                threading.Thread(target=self._slow_down, args=(client,), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _slow_down(self, client: socket.socket) -> None:
        with self._lock:
            self.requests += 1
        try:
            client.settimeout(2)
            client.recv(65536)
            body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        except OSError:
            pass
        finally:
            client.close()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def set(self, mode: str) -> None:
        """Switch to ``mode`` (see the class docstring); ``"refuse"`` drops every connection now."""
        self.mode = mode
        if mode == "refuse":
            self._stop_listening()
        elif self._listener is None:
            self._listen()
        if mode != "pass":
            with self._lock:
                conns, self._conns = self._conns, []
            for s in conns:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _stop_listening(self) -> None:
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            except OSError:
                pass
            self._listener.close()
            self._listener = None

    def close(self) -> None:
        """Stop forwarding and listening."""
        self.set("refuse")


def download_latest(url: str, dest: Path) -> Path:
    """Copy the checkpoint ``LATEST`` names under ``url`` into ``dest/<name>/`` (laid out as on a
    filesystem) and point ``dest/LATEST`` at it, so the local readers (``runs.final_weights``,
    ``sharded_runs.mesh_final_weights``) read it; returns ``dest``."""
    from resilience.checkpoint.object_tools import download

    name = latest(url)
    download(root_location(url) / name, dest)
    link = dest / LATEST
    if link.is_symlink():
        link.unlink()
    link.symlink_to(name)
    return dest


def orphans(url: str) -> list[str]:
    """Objects under ``url`` that no committed checkpoint names (not a pointer, a manifest, or
    under the prefix of a committed checkpoint's files)."""
    root = root_location(url)
    names = {k.split("/")[0] for k in keys(url) if k.count("/") == 1 and k.endswith("/manifest.json")}
    prefixes = {read_manifest(root / name).get("objects", name) for name in names}
    return [k for k in keys(url) if "/" in k and not (k in {f"{n}/manifest.json" for n in names} or any(k.startswith(p + "/") for p in prefixes))]
