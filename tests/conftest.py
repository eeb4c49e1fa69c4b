"""Shared fixtures: a launcher-free environment, size-limited tmpfs mounts, the local Slurm cluster.

Shared runners and readers live next to this file as importable modules (``tiny_runs``,
``sample_runs``, ``worker_runs``, ``slurm_cluster``); the scripts that tests run as ranks live in
``helpers/``. Test files sit in a folder per package part (``checkpoint/``, ``config/``, ``launch/``,
``stop/``, ``state/``, ``cli/``, ``slurm/``, ``integrations/``) plus ``e2e/``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "digits"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# botocore's credential chain ends with the instance metadata service (a link-local address): the tests
# never reach for it (a test without credentials gets "no AWS credentials found" at once)
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"

from slurm_cluster import slurm_cluster, slurm_cluster_2nodes  # noqa: E402,F401  (session fixtures)


@pytest.fixture
def no_launcher_environment(monkeypatch):
    """No ``RESILIENCE_*`` or ``SLURM_*`` variable from an enclosing launcher or job: a stop file, a
    ready directory or a job id would change what the loop does. Used by name (``usefixtures``)."""
    for name in [n for n in os.environ if n.startswith(("RESILIENCE_", "SLURM_"))]:
        monkeypatch.delenv(name)


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler (``signal.default_int_handler``) installed for the test, the previous
    disposition restored after. Python installs it at start only where SIGINT is not ignored; a test
    run started as a background job of a non-interactive shell (``nohup make test &``) inherits
    SIG_IGN, and the tests of what a hold or a recorder does to that handler need it there."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def one_rank_group():
    """One gloo rank in this process (a HashStore, no port), for a module whose DDP model or DTensor
    needs a process group; none is made when one exists already."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _unusable(reason: str):
    """A mount the machine cannot give: a failure in CI (which runs as root), else a skip."""
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(name, options)`` mounts a tmpfs (``mount -o options``, e.g. ``size=2m`` or ``ro,size=64k``)
    on ``tmp_path / name`` and returns that path; every mount is lazily unmounted after the test.
    Needs root: skips without it (fails when ``CI=true``), as when the mount itself fails."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        if os.geteuid() != 0:
            _unusable(f"mounting a tmpfs ({options}) needs root")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
        if result.returncode != 0:
            _unusable(f"cannot mount a tmpfs ({options}) here: {result.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1 (a free port), one for the whole session, stopped by its PID at
    the end; its endpoint and credentials are in ``os.environ`` meanwhile (the ranks inherit them),
    as boto3 reads them from a user's environment (``AWS_ENDPOINT_URL``, ...). ``s3_endpoint.bucket()``
    makes a fresh bucket. Skipped where moto is not installed (the ``storage`` extra)."""
    pytest.importorskip("moto.server")
    pytest.importorskip("boto3")
    from object_stores import restore_env, set_env, start_moto

    moto = start_moto()
    old = set_env(moto.env())
    try:
        yield moto
    finally:
        restore_env(old)
        moto.stop()


@pytest.fixture(scope="session")
def msc_posix(tmp_path_factory):
    """An msc configuration (``MSC_CONFIG`` in ``os.environ`` for the session) whose profile
    ``object_stores.MSC_PROFILE`` stores under a temporary directory: msc's POSIX provider."""
    pytest.importorskip("multistorageclient")
    from object_stores import msc_env, restore_env, set_env

    base = tmp_path_factory.mktemp("msc") / "store"
    old = set_env(msc_env(base))
    try:
        yield base
    finally:
        restore_env(old)
