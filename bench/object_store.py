"""Save and load of the bench's state on object storage vs the endpoint's raw PUT/GET of the same bytes.

    python -m bench.object_store            # 64M model + Adam state, 7 rounds (make bench)
    python -m bench.object_store --quick    # 4M, 5 rounds

An S3 endpoint is started on 127.0.0.1 (moto's standalone server, as the tests do; stopped by its
PID at the end). Each round, in rotating order:

* ours, save: ``Checkpointer.save`` with ``checkpoint_dir: s3://...``: staging in ``local_dir``
  (write, fsync, digest), every file uploaded, the manifest (the commit), ``LATEST`` (a conditional PUT);
* raw PUT: the same objects (the files of that checkpoint, same sizes and bytes) uploaded from
  memory with the same boto3 transfer (multipart above 8 MiB), nothing else;
* ours, load: ``find_resume_point`` + ``load`` into the live model and optimizer (orphan check,
  the choice and size checks, the downloads, the digests, the load);
* raw GET: the same objects downloaded into memory.

The Checkpointer of each is built before the clock starts (its construction checks the store
with a write probe, once per run). The figures are ``raw / ours`` per round (1.0: as fast as the endpoint moves the bytes; the goal is
>= 0.8), median and 95 % interval over the rounds (:func:`bench.stats.median_interval`). Results
go to ``bench/results/object_store.json``. The endpoint is in-memory on this machine, so the
figures measure our overhead against the transfer itself, not a network.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import build_state, human_bytes, nbytes, parse_size, rotate, state_tensors
from bench.stats import median_interval
from resilience.checkpoint import Checkpointer, TrainingState
from resilience.checkpoint.storage.manifest import all_files, data_dir, read_manifest
from resilience.checkpoint.storage.object_path import root_location
from resilience.config import CheckpointConfig
from resilience.distributed import DistContext
from resilience.state.step_scheduler import StepScheduler

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "object_store.json"


def _checkpointer(url: str, local: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Checkpointer:
    config = CheckpointConfig(checkpoint_dir=url, local_dir=str(local), save_consolidated=False, load_balanced=False)
    return Checkpointer(config, DistContext(), state=TrainingState(model=model, optimizer=optimizer), scheduler=StepScheduler(num_epochs=1, global_step=step))


def _objects(url: str) -> dict[str, bytes]:
    """The files of the checkpoint ``LATEST`` names (relative path -> bytes), read once, untimed."""
    root = root_location(url)
    checkpoint = root / root.store.read_pointer("LATEST")
    doc = read_manifest(checkpoint)
    files_at = data_dir(checkpoint, doc)
    return {rel: (files_at / rel).read_bytes() for rel in all_files(files_at, doc)}


def run(size: int, rounds: int, log: Any) -> dict[str, Any]:
    """``rounds`` rounds of the four methods on a fresh endpoint; the raw times (s) and ratios."""
    sys.path.insert(0, str(REPO / "tests"))
    from object_stores import restore_env, set_env, start_moto  # the tests' endpoint

    model, optimizer = build_state(size)
    state_bytes = nbytes(state_tensors(model, optimizer))
    moto = start_moto()
    old = set_env(moto.env())
    work = Path(tempfile.mkdtemp(prefix="bench-object-store-"))
    try:
        import boto3
        from boto3.s3.transfer import TransferConfig

        client = boto3.client("s3")
        transfer = TransferConfig()  # the defaults S3Store's uploads and downloads use
        bucket = moto.bucket()
        url = f"s3://{bucket}/ours"
        times: dict[str, list[float]] = {"save": [], "put": [], "load": [], "get": []}
        objects: dict[str, bytes] = {}

        # each method is prepared untimed (a Checkpointer's construction checks the store: a write
        # probe) and returns what is timed
        def save(r: int) -> Any:
            ck = _checkpointer(url, work, model, optimizer, r + 1)
            return ck.save

        def put(r: int) -> Any:
            return lambda: [client.upload_fileobj(io.BytesIO(data), bucket, f"raw/{r}/{rel}", Config=transfer) for rel, data in objects.items()]

        def load(r: int) -> Any:
            ck = _checkpointer(url, work, model, optimizer, 0)
            return lambda: ck.load(ck.find_resume_point(), ck.state)

        def get(r: int) -> Any:
            return lambda: [client.download_fileobj(bucket, f"raw/0/{rel}", io.BytesIO(), Config=transfer) for rel in objects]

        save(-1)()  # untimed: the first save makes the objects the raw methods move
        objects.update(_objects(url))
        put(0)()
        log(f"state {human_bytes(state_bytes)}; the checkpoint: {len(objects)} objects, {human_bytes(sum(map(len, objects.values())))}")
        methods = {"save": save, "put": put, "load": load, "get": get}
        for r in range(rounds):
            for name in rotate(list(methods), r):
                timed = methods[name](r + 1)
                t0 = time.perf_counter()
                timed()
                times[name].append(time.perf_counter() - t0)
            log(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()))
        moved = sum(map(len, objects.values()))
        return {
            "state_bytes": state_bytes,
            "objects": len(objects),
            "object_bytes": moved,
            "times_s": times,
            "save_vs_raw_put": median_interval([p / s for p, s in zip(times["put"], times["save"])]),
            "load_vs_raw_get": median_interval([g / lo for g, lo in zip(times["get"], times["load"])]),
        }
    finally:
        restore_env(old)
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)


def _line(name: str, figure: dict[str, Any]) -> str:
    ci = f" [{figure['ci_low']:.2f}, {figure['ci_high']:.2f}] ({figure['confidence'] * 100:.1f} %)" if figure["ci_low"] is not None else ""
    return f"{name}: {figure['median']:.2f}{ci} over {figure['n']} rounds"


def main(argv: list[str] | None = None) -> int:
    """Run the bench, print the two figures, write :data:`RESULTS`."""
    parser = argparse.ArgumentParser(prog="python -m bench.object_store", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4M model, 5 rounds")
    parser.add_argument("--size", default=None, help="model bytes (default 64M, --quick 4M)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 7, --quick 5)")
    parser.add_argument("--out", default=str(RESULTS), help="where the JSON goes")
    args = parser.parse_args(argv)
    size = parse_size(args.size or ("4M" if args.quick else "64M"))
    rounds = args.rounds or (5 if args.quick else 7)
    result = run(size, rounds, lambda text: print(text, file=sys.stderr, flush=True))
    result.update(quick=args.quick, rounds=rounds, model_bytes_requested=size)
    print(_line("save on S3 vs raw PUT of the same bytes (raw / ours)", result["save_vs_raw_put"]))
    print(_line("load from S3 vs raw GET of the same bytes (raw / ours)", result["load_vs_raw_get"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
