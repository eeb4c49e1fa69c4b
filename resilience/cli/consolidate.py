"""``resilience consolidate DIR``: the command behind every checkpoint's ``model/consolidate.sh``.

Kept free of torch imports so registering it does not slow down ``resilience run``; the work is in
:func:`resilience.checkpoint.formats.consolidate.consolidate`. Options default to the environment
variables NeMo AutoModel's helper reads: ``NPROC_PER_NODE`` (1), ``NUM_THREADS`` (5) and
``CAST_DTYPE`` (unset: original dtypes).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from resilience.checkpoint.layout import CONSOLIDATED
from resilience.checkpoint.storage.object_store import is_object_url
from resilience.env_names import CONSOLIDATE
from resilience.exit_codes import ExitCode
from resilience.local_paths import local_path

HELP = "write model/consolidated/ (a Hugging Face bundle) from a checkpoint's sharded safetensors; what model/consolidate.sh runs"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``DIR``, ``--output``, ``--nproc``, ``--num-threads``, ``--cast-dtype``, ``--no-progress``."""
    parser.add_argument("directory", metavar="DIR", help="a checkpoint's model/ directory, or the checkpoint directory holding it")
    parser.add_argument("--output", default=None, help=f"where the bundle goes (default DIR/{CONSOLIDATED})")
    parser.add_argument("--nproc", default=None, help="worker processes (default $NPROC_PER_NODE or 1)")
    parser.add_argument("--num-threads", default=None, help="reader threads per worker (default $NUM_THREADS or 5)")
    parser.add_argument("--cast-dtype", default=None, help="bf16, fp16, fp32 or fp64 for ordinary float tensors (default $CAST_DTYPE, else original dtypes)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _count(flag: str, value: str | None, env: str, default: int) -> int:
    text = value if value is not None else os.environ.get(env) or str(default)
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{flag} / {env}: expected an integer >= 1, got {text!r}")
    return number


def run(args: argparse.Namespace) -> int:
    """Consolidate ``args.directory``; 0 on success (or nothing to do), 2 on a usage error, 1 else
    (a shard that does not match the checkpoint's manifest among them: nothing is written)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        nproc = _count("--nproc", args.nproc, CONSOLIDATE["nproc"], 1)
        threads = _count("--num-threads", args.num_threads, CONSOLIDATE["num_threads"], 5)
        if is_object_url(args.directory):
            return _run_on_bucket(args, nproc, threads)
        directory = local_path(args.directory, "DIR")
        output = local_path(args.output, "--output") if args.output is not None else None
    except ValueError as exc:  # NotALocalPath too: a URL is not read as a local folder "s3:"
        print(f"resilience consolidate: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    cast = args.cast_dtype if args.cast_dtype is not None else os.environ.get(CONSOLIDATE["cast_dtype"])

    from resilience.checkpoint.formats.consolidate import ConsolidateError, CorruptedInput, consolidate  # imports torch

    try:
        out = consolidate(directory, output, nproc=nproc, num_threads=threads, cast_dtype=cast, progress=not args.no_progress)
    except ConsolidateError as exc:
        print(f"resilience consolidate: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    except (CorruptedInput, OSError) as exc:
        print(f"resilience consolidate: {exc}", file=sys.stderr)
        return int(ExitCode.FAILED)
    print(out)
    return int(ExitCode.DONE)


def _run_on_bucket(args: argparse.Namespace, nproc: int, threads: int) -> int:
    """``DIR`` is a checkpoint on object storage: its manifest, rank manifests and ``model/`` are
    downloaded into a temporary directory, the bundle is built there and uploaded under the
    checkpoint's ``model/consolidated/`` (``bundle_manifest.json`` last), or into ``--output``."""
    import tempfile
    from pathlib import Path

    from resilience.checkpoint.formats.consolidate import ConsolidateError, CorruptedInput, consolidate  # imports torch
    from resilience.checkpoint.layout import MODEL_CONSOLIDATED, MODEL_DIR, RANK_MANIFESTS_DIR
    from resilience.checkpoint.object_tools import download, upload_bundle
    from resilience.checkpoint.storage.manifest import CheckpointInvalid
    from resilience.checkpoint.storage.object_path import url_location
    from resilience.checkpoint.storage.object_store import StoreError, StoreUnavailable

    cast = args.cast_dtype if args.cast_dtype is not None else os.environ.get(CONSOLIDATE["cast_dtype"])
    try:
        output = local_path(args.output, "--output") if args.output is not None else None
        checkpoint = url_location(args.directory)
        if checkpoint.rel == "":
            raise ValueError(f"DIR {args.directory!r}: not a checkpoint (no manifest.json directly under it)")
    except (ValueError, StoreUnavailable, StoreError) as exc:
        print(f"resilience consolidate: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="resilience-consolidate-") as tmp:

            def wanted(rel: str) -> bool:
                return rel.startswith((f"{MODEL_DIR}/", f"{RANK_MANIFESTS_DIR}/")) and not rel.startswith(f"{MODEL_CONSOLIDATED}/")

            local = download(checkpoint, Path(tmp), wanted)
            bundle = consolidate(local, output, nproc=nproc, num_threads=threads, cast_dtype=cast, progress=not args.no_progress)
            out = str(bundle)
            if output is None:
                upload_bundle(bundle, checkpoint, MODEL_CONSOLIDATED)
                out = f"{checkpoint}/{MODEL_CONSOLIDATED}"
    except ConsolidateError as exc:
        print(f"resilience consolidate: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    except (CorruptedInput, CheckpointInvalid, OSError) as exc:
        print(f"resilience consolidate: {exc}", file=sys.stderr)
        return int(ExitCode.FAILED)
    print(out)
    return int(ExitCode.DONE)
