"""Fault injection: SIGKILL a 2-rank training at random moments, then check that nothing is torn
and that the resumed run is bitwise exact.

    python -m bench.faults                     # 200 trials (a few minutes)
    python bench/faults.py --trials 20 --seed 3
    python -m bench.faults --start exec        # fresh interpreters via resilience.launch (slower)
    python -m bench.faults --model fsdp2 --modes sync --kill-at-phase parts
                                               # a sharded (FSDP2) model, each kill inside a save's shard writing

Each trial runs a small 2-rank (gloo, DDP) training under ``resilient_loop`` with a save every
``--every`` steps, alternating synchronous and asynchronous saves, and a short sleep at each
publishing step of every save (``resilience.checkpoint.writer.fault_hook``) so that many kills
land inside a save. At a uniformly random moment of the run it SIGKILLs rank 0, rank 1 or both;
a surviving rank may finish on its own (it normally fails in its next collective) within
``--survivor-grace`` seconds, else it is killed too. Then, with nothing running:

* torn: ``LATEST`` must name a checkpoint whose manifest validates (every file present with its
  size and digest), and so must every published ``epoch_*_step_*`` directory;
* a resumed run (same config, no kill) must finish with exit 0, no staging directory left, and
  per-step losses and learning rates and the final model weights bitwise equal to an
  uninterrupted reference run of the same mode (two reference runs per mode, made once, which
  must agree with each other first).

``--store s3`` puts the checkpoints on an S3 endpoint started on 127.0.0.1 (moto's server, as the
tests start it): ``checkpoint_dir: s3://...``, the logs and staging in each trial's ``local/``;
then nothing may be left that no committed manifest names once the resumed run ends.

``--model fsdp2`` trains the same model sharded with FSDP2 (``bench/fault_models.py``), so each
rank writes only its own shards; ``--kill-at-phase PHASE`` replaces the random moment by the
moment a rank reaches that phase of the second or a later save (``parts``: the ranks writing
their files), so every kill lands inside a save with a previous ``LATEST`` to keep.

Where each kill landed is read from events the ranks append (one unbuffered ``write`` each, with
``time.monotonic()``, the same clock in every process): before the first save, during a save
(with the last phase reached: ``snapshot``, ``staging``, ``parts``, ``manifest``, ``rename``,
``pointer``, ``after_publish``, ``returning``), between saves, or after training (a rank had
left its loop, e.g. while tearing down its process group).

Ranks are started with ``fork()`` from this process, which has imported torch, our package and
everything the training imports already (about 2.5 s per rank saved on each start; the ranks are
real processes with their own gloo groups, rendezvous through a file store, real files and a real
SIGKILL); ``--start exec`` starts fresh interpreters through :func:`resilience.launch.launch`
instead (env:// rendezvous, as in production). Progress goes to stderr, the summary to stdout as
``name: value`` lines; the exit code is 1 when any checkpoint was torn or any resume was inexact
or failed, 2 for bad arguments, else 0.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import faulthandler
import gc
import json
import os
import random
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/faults.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.fault_models import MODELS  # noqa: E402

MODES = ("sync", "async")
PUBLISH_PHASES = ("staging", "upload", "manifest", "rename", "pointer", "after_publish")  # upload: object storage only
STORE_ENV = "FAULTS_STORE_FILE"  # --start fork: the rendezvous file of this run's ranks
LOG_ENV = "FAULTS_RANK_LOG"  # --start exec: the file a worker sends its stdout and stderr to
SLOW_PHASE_ENV = "FAULTS_SLOW_PHASE"  # --kill-at-phase: that phase sleeps --phase-sleep too, so the kill lands in it
STEPS_PER_EPOCH = 20  # per rank: 320 samples / 2 ranks / batch 8
EPOCHS = 2


# -- the training every rank runs ------------------------------------------------------------
def train(ckpt_dir: str, mode: str, events_path: str, phase_sleep_s: float, every: int, model_kind: str = "ddp", fmt: str = "safetensors") -> int:
    """One rank of the trial training (RANK, WORLD_SIZE, MASTER_ADDR/PORT from the environment):
    ``model_kind`` ``ddp`` (replicated) or ``fsdp2`` (sharded), saved with ``model_save_format: fmt``.

    Appends ``<monotonic seconds> <rank> <event> [detail]`` lines to ``events_path``. Returns the
    loop's exit code.
    """
    import datetime

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from bench.fault_models import build
    from resilience import load_config, resilient_loop
    from resilience.checkpoint import checkpointer, writer

    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the harness asks a hung survivor where it is
    timeout = datetime.timedelta(seconds=60)
    if os.environ.get(STORE_ENV):  # forked ranks: a file store, no TCP connect-and-retry race at start
        dist.init_process_group(
            "gloo", init_method=f"file://{os.environ[STORE_ENV]}", timeout=timeout, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
        )
    else:
        dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    fd = os.open(events_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def event(kind: str, detail: Any = "") -> None:
        os.write(fd, f"{time.monotonic():.6f} {rank} {kind} {detail}\n".encode())

    original_save, original_write = checkpointer.Checkpointer.save, checkpointer.Checkpointer._write

    def save(self, reason="periodic"):
        event("save_begin", self.scheduler.global_step)
        try:
            return original_save(self, reason)
        finally:
            event("save_return", self.scheduler.global_step)

    def write(self, ctx, name, *args, **kwargs):  # the writing and publishing (background when async)
        event("write_begin", name)
        result = original_write(self, ctx, name, *args, **kwargs)
        event("write_end", name)
        return result

    def hook(phase: str) -> None:
        event("phase", phase)
        if (phase in PUBLISH_PHASES or phase == os.environ.get(SLOW_PHASE_ENV)) and phase_sleep_s:
            time.sleep(phase_sleep_s)

    checkpointer.Checkpointer.save = save
    checkpointer.Checkpointer._write = write
    writer.fault_hook = hook
    event("start")

    on_store = [f"checkpoint.local_dir={Path(events_path).parent / 'local'}"] if "://" in ckpt_dir else []  # --store s3
    cfg = load_config(
        None,
        [
            *on_store,
            f"checkpoint.checkpoint_dir={ckpt_dir}",
            f"checkpoint.is_async={'true' if mode == 'async' else 'false'}",
            f"checkpoint.model_save_format={fmt}",
            f"step_scheduler.num_epochs={EPOCHS}",
            f"step_scheduler.ckpt_every_steps={every}",
            "step_scheduler.preemption_signal=[USR1, TERM]",
        ],
    )
    torch.manual_seed(0)
    model, net = build(model_kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)
    g = torch.Generator().manual_seed(1234)
    dataset = TensorDataset(torch.randn(STEPS_PER_EPOCH * 8 * world, 16, generator=g), torch.randn(STEPS_PER_EPOCH * 8 * world, 4, generator=g))
    loader = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0))

    loop = resilient_loop(cfg, model=net, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=loader)
    with loop:
        for step in loop:
            x, y = step.batch
            loss = torch.nn.functional.mse_loss(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            lr_scheduler.step()
            loop.log(loss=loss.item(), lr=lr)
    code = int(loop.exit_code)
    event("exit", code)
    # torch 2.13 + gloo: a DistributedDataParallel module alive at interpreter exit aborts the
    # process now and then (rc -6, "terminate called without an active exception"): free it first.
    del loop, net
    gc.collect()
    dist.destroy_process_group()
    return code


# -- starting and killing the two ranks --------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ForkedRanks:
    """Two ranks forked from this process (torch already imported), each running :func:`train`."""

    def __init__(self, args: tuple, log_path: Path) -> None:
        port = _free_port()
        store = log_path.with_name(log_path.name + ".store")
        if store.exists():
            store.unlink()
        sys.stdout.flush()  # a child must not write our buffered output again
        sys.stderr.flush()
        self.pids: list[int] = []
        self.codes: list[int | None] = [None, None]
        for rank in (0, 1):
            pid = os.fork()
            if pid == 0:  # the child: never returns into the harness
                code = 1
                try:
                    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(out, 1)
                    os.dup2(out, 2)
                    os.environ.update(
                        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{STORE_ENV: str(store)}
                    )
                    code = train(*args)
                except BaseException:  # noqa: BLE001 - report it in the log, exit 1
                    traceback.print_exc()
                finally:
                    try:
                        sys.stdout.flush()
                        sys.stderr.flush()
                    finally:
                        os._exit(code)
            self.pids.append(pid)

    def poll(self) -> list[int | None]:
        """Each rank's exit code (``-N``: killed by signal N), ``None`` while it runs."""
        for i, pid in enumerate(self.pids):
            if self.codes[i] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.codes[i] = os.waitstatus_to_exitcode(status)
        return list(self.codes)

    def kill(self, ranks) -> None:
        for rank in ranks:
            self.signal(rank, signal.SIGKILL)

    def signal(self, rank: int, sig: int) -> None:
        if self.codes[rank] is None:
            os.kill(self.pids[rank], sig)

    def close(self) -> None:
        self.kill((0, 1))
        while None in self.poll():
            time.sleep(0.005)


class LaunchedRanks:
    """Two fresh interpreters started by :func:`resilience.launch.launch` (``--start exec``)."""

    def __init__(self, args: tuple, log_path: Path) -> None:
        from resilience.launch import launch

        cmd = [sys.executable, os.path.abspath(__file__), "--worker", *map(str, args)]
        # launch() lets ranks inherit our stdout; each worker sends its output to LOG_ENV instead
        self.group = launch(cmd, 2, env={"OMP_NUM_THREADS": "1", LOG_ENV: str(log_path)}, failure_grace_s=3600)

    def poll(self) -> list[int | None]:
        return [proc.poll() for proc in self.group.procs]

    def kill(self, ranks) -> None:
        self.group.send_signal(signal.SIGKILL, ranks)

    def signal(self, rank: int, sig: int) -> None:
        self.group.send_signal(sig, [rank])

    def close(self) -> None:
        self.group.send_signal(signal.SIGKILL)
        self.group.close()


def _start(start: str, args: tuple, log_path: Path):
    return ForkedRanks(args, log_path) if start == "fork" else LaunchedRanks(args, log_path)


def _run_to_end(start: str, args: tuple, log_path: Path, timeout: float) -> tuple[list[int | None], float]:
    began = time.monotonic()
    ranks = _start(start, args, log_path)
    try:
        while None in ranks.poll():
            if time.monotonic() - began > timeout:
                break
            time.sleep(0.005)
        return ranks.poll(), time.monotonic() - began
    finally:
        ranks.close()


# -- checking what is on disk ------------------------------------------------------------------
def torn_checkpoints(root: Path | str) -> list[str]:
    """Why ``LATEST`` or a published checkpoint under ``root`` (a directory, or an ``s3://`` URL)
    is not complete (empty: all good)."""
    from resilience.checkpoint.layout import LATEST, list_checkpoints
    from resilience.checkpoint.storage.manifest import CheckpointInvalid, validate
    from resilience.checkpoint.storage.object_path import root_location
    from resilience.checkpoint.storage.pointers import PointerError, read_pointer

    root = root_location(root)
    problems = []
    try:
        latest = read_pointer(root, LATEST)
    except PointerError as exc:
        problems.append(f"LATEST: {exc}")
        latest = None
    if latest is not None:
        try:
            validate(latest, checksums=True)
        except CheckpointInvalid as exc:
            problems.append(f"LATEST -> {latest.name}: {exc}")
    for directory in list_checkpoints(root):
        if directory != latest:
            try:
                validate(directory, checksums=True)
            except CheckpointInvalid as exc:
                problems.append(f"{directory.name}: {exc}")
    return problems


def latest_name(root: Path | str) -> str | None:
    from resilience.checkpoint.layout import LATEST
    from resilience.checkpoint.storage.object_path import root_location
    from resilience.checkpoint.storage.pointers import PointerError, read_pointer

    try:
        latest = read_pointer(root_location(root), LATEST)
    except PointerError:
        return None
    return latest.name if latest is not None else None


@dataclasses.dataclass
class Outcome:
    """What a finished run left: per-step (loss, lr) rows and the final model tensors."""

    rows: list[tuple]
    weights: dict[str, Any]


def outcome(root: Path | str, logs: Path | None = None) -> Outcome:
    """Rows of ``training.jsonl`` (in ``logs``, default ``root``) and the weights of ``LATEST``
    (loaded into an unsharded model, so replicated and sharded runs, in either model format,
    compare the same way; from a bucket, downloaded first)."""
    from bench.fault_models import final_weights
    from resilience.checkpoint.layout import LATEST
    from resilience.checkpoint.object_tools import download
    from resilience.checkpoint.storage.object_path import is_object, root_location
    from resilience.checkpoint.storage.pointers import read_pointer

    location = root_location(root)
    rows = [json.loads(line) for line in (Path(logs or location) / "training.jsonl").read_text().splitlines() if line.strip()]
    latest = read_pointer(location, LATEST)
    if not is_object(latest):
        return Outcome([(r["global_step"], r["loss"], r["lr"]) for r in rows], final_weights(latest))
    with tempfile.TemporaryDirectory(prefix="faults-latest-") as tmp:
        return Outcome([(r["global_step"], r["loss"], r["lr"]) for r in rows], final_weights(download(latest, Path(tmp))))


def same(a: Outcome, b: Outcome) -> str | None:
    """``None`` when bitwise equal, else what differs."""
    import torch

    if [r[0] for r in a.rows] != [r[0] for r in b.rows]:
        return f"logged steps differ ({len(a.rows)} vs {len(b.rows)} rows)"
    for ra, rb in zip(a.rows, b.rows):
        if ra != rb:
            return f"step {ra[0]}: loss/lr {ra[1:]} vs {rb[1:]}"
    if a.weights.keys() != b.weights.keys():
        return f"weight names differ: {sorted(a.weights)} vs {sorted(b.weights)}"
    for key in a.weights:
        if not torch.equal(a.weights[key], b.weights[key]):
            return f"final weights differ in {key}"
    return None


# -- where a kill landed -------------------------------------------------------------------------
def classify(events_path: Path, killed_at: float) -> tuple[str, str | None]:
    """(``before first save`` | ``during a save`` | ``between saves`` | ``after training``, phase
    when during a save), from the events both ranks wrote before ``killed_at`` (monotonic
    seconds). ``after training``: a rank had left its loop (exit code decided) before the kill."""
    begun = collections.Counter()
    ended = collections.Counter()
    phase = None
    any_save = finished = False
    for line in events_path.read_text().splitlines() if events_path.exists() else []:
        parts = line.split()
        if len(parts) < 3 or float(parts[0]) >= killed_at:
            continue
        rank, kind = parts[1], parts[2]
        if kind == "save_begin":
            any_save = True
            begun[rank] += 1
            phase = "snapshot"
        elif kind == "write_end":
            ended[rank] += 1
            phase = "returning"
        elif kind == "phase":
            phase = parts[3]
        elif kind == "exit":
            finished = True
    if finished:
        return "after training", None
    if not any_save:
        return "before first save", None
    if any(begun[r] > ended[r] for r in begun):
        return "during a save", phase
    return "between saves", None


def reached(events_path: Path, phase: str, min_save: int) -> bool:
    """Whether a rank has reached ``phase`` of its ``min_save``-th (1-based) or a later save."""
    saves: collections.Counter = collections.Counter()
    try:
        lines = events_path.read_text().splitlines()
    except FileNotFoundError:
        return False
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "save_begin":
            saves[parts[1]] += 1
        elif len(parts) >= 4 and parts[2] == "phase" and parts[3] == phase and saves[parts[1]] >= min_save:
            return True
    return False


# -- the harness -------------------------------------------------------------------------------
def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200, help="number of kill-and-resume trials (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times and targets (default 0)")
    parser.add_argument("--every", type=int, default=3, help="save every N steps (default 3; 40 steps per run)")
    parser.add_argument(
        "--phase-sleep",
        type=float,
        default=0.004,
        metavar="S",
        help=f"seconds to sleep at each publishing step of a save ({', '.join(PUBLISH_PHASES)}; default 0.004)",
    )
    parser.add_argument(
        "--survivor-grace",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds a rank that was not killed may take to exit by itself (default 5), "
        "then its stack is dumped to its log (SIGUSR2, faulthandler) and it is killed",
    )
    parser.add_argument(
        "--start",
        choices=("fork", "exec"),
        default="fork",
        help="fork ranks from this process (default, fast) or exec fresh interpreters via resilience.launch",
    )
    parser.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one, removed at the end)")
    parser.add_argument(
        "--kill-window", default="0,1", metavar="A,B", help="kill at a uniform fraction in [A, B] of the reference run's duration (default 0,1)"
    )
    parser.add_argument(
        "--tear", action="store_true", help="self-test of the checker: after each kill, truncate a file of LATEST's checkpoint (must count as torn)"
    )
    parser.add_argument("--model", choices=MODELS, default="ddp", help="ddp (replicated, default) or fsdp2 (sharded: each rank saves its shards)")
    parser.add_argument(
        "--model-save-format", choices=("safetensors", "torch_save"), default="safetensors", help="checkpoint.model_save_format (default safetensors)"
    )
    parser.add_argument("--modes", default=",".join(MODES), help="save modes the trials alternate (default sync,async)")
    parser.add_argument(
        "--kill-at-phase",
        default=None,
        metavar="PHASE",
        help="instead of a random moment, kill once a rank reaches PHASE (parts, or one of "
        f"{', '.join(PUBLISH_PHASES)}) of the second or a later save, so a previous LATEST exists",
    )
    parser.add_argument(
        "--store",
        choices=("dir", "s3"),
        default="dir",
        help="where the checkpoints go: a local directory (default) or s3://, an S3 endpoint started on 127.0.0.1 (moto)",
    )
    parser.add_argument("--worker", nargs=7, metavar=("CKPT", "MODE", "EVENTS", "SLEEP", "EVERY", "MODEL", "FORMAT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None:
        if args.trials < 1:
            parser.error(f"--trials: must be >= 1, got {args.trials}")
        if args.every < 1:
            parser.error(f"--every: must be >= 1, got {args.every}")
        if args.phase_sleep < 0 or args.survivor_grace < 0:
            parser.error("--phase-sleep and --survivor-grace: must be >= 0 seconds")
        try:
            low, high = (float(x) for x in args.kill_window.split(","))
        except ValueError:
            parser.error(f"--kill-window: expected two fractions A,B, got {args.kill_window!r}")
        if not 0 <= low <= high <= 1:
            parser.error(f"--kill-window: expected 0 <= A <= B <= 1, got {args.kill_window!r}")
        args.kill_window = (low, high)
        args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not args.modes or set(args.modes) - set(MODES):
            parser.error(f"--modes: expected a comma-separated subset of {','.join(MODES)}, got {','.join(args.modes)!r}")
        if args.kill_at_phase is not None and args.kill_at_phase not in ("parts", *PUBLISH_PHASES):
            parser.error(f"--kill-at-phase: expected parts or one of {', '.join(PUBLISH_PHASES)}, got {args.kill_at_phase!r}")
    return args


def _tear(root: Path | str) -> str | None:
    """Truncate the largest file of LATEST's checkpoint by one byte (the ``--tear`` self-test)."""
    from resilience.checkpoint.storage.manifest import data_dir, read_manifest
    from resilience.checkpoint.storage.object_path import is_object, root_location

    name = latest_name(root)
    if name is None:
        return None
    if is_object(root_location(root)):
        files_at = data_dir(root_location(root) / name, read_manifest(root_location(root) / name))
        largest = max(files_at.store.list(files_at.rel)[0], key=lambda o: o.size)
        files_at.store.put_bytes(largest.rel, files_at.store.get_bytes(largest.rel)[:-1])
        return largest.rel
    root = Path(root)
    files = sorted((p for p in (root / name).rglob("*") if p.is_file() and p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    if not files:
        return None
    with open(files[-1], "r+b") as fh:
        fh.truncate(max(0, files[-1].stat().st_size - 1))
    return str(files[-1].relative_to(root))


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.worker is not None:
        ckpt, mode, events, sleep_s, every, model_kind, fmt = args.worker
        if os.environ.get(LOG_ENV):
            out = os.open(os.environ[LOG_ENV], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
        return train(ckpt, mode, events, float(sleep_s), int(every), model_kind, fmt)

    # Everything train() imports, imported once before any fork, so no rank pays for it.
    import torch
    import torch._dynamo  # noqa: F401 - DistributedDataParallel() imports it (1 s)
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import torch.utils.data  # noqa: F401

    import resilience.checkpoint  # noqa: F401
    import resilience.loop  # noqa: F401 - resilience's names are lazy: import the modules themselves

    torch.set_num_threads(1)  # no OpenMP pool in the parent: forked ranks must not inherit one
    store = _Store.start(args.store)
    try:
        return _main(args, store)
    finally:
        store.stop()


class _Store:
    """``--store``: where each run's checkpoints go (``location``), where its logs are (``logs``),
    and what a run may have left (``leftovers``)."""

    def __init__(self, moto: Any = None, bucket: str | None = None, old_env: Any = None) -> None:
        self.moto, self.bucket, self.old_env = moto, bucket, old_env

    @classmethod
    def start(cls, kind: str) -> _Store:
        if kind == "dir":
            return cls()
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from object_stores import set_env, start_moto  # the tests' endpoint: moto's server, stopped by PID

        moto = start_moto()
        old = set_env(moto.env())  # the forked (or exec'd) ranks inherit it
        return cls(moto, moto.bucket(), old)

    def location(self, base: Path) -> str:
        return f"s3://{self.bucket}/{base.name}" if self.moto else str(base / "ck")

    def logs(self, base: Path) -> Path:
        return base / "local" if self.moto else base / "ck"

    def leftovers(self, base: Path) -> list[str]:
        from resilience.checkpoint.layout import STAGING_PREFIX

        if not self.moto:
            return [p.name for p in (base / "ck").glob(f"{STAGING_PREFIX}*")]
        from object_stores import orphans

        return orphans(self.location(base)) + [str(p) for p in (base / "local").glob(f"rank_*/{STAGING_PREFIX}*")]

    def stop(self) -> None:
        if self.moto:
            from object_stores import restore_env

            restore_env(self.old_env)
            self.moto.stop()


def _main(args: argparse.Namespace, store: _Store) -> int:
    rng = random.Random(args.seed)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="faults-"))
    work.mkdir(parents=True, exist_ok=True)
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731 - progress on stderr

    # Two uninterrupted runs per mode: they must agree bitwise (else "exact" would mean nothing).
    # Kill times are a fraction of the median of the last few whole-run durations of the mode:
    # these two, then trials that finished before their kill and resumed runs that started from
    # scratch, so the range follows the machine's load as it changes.
    references: dict[str, Outcome] = {}
    durations: dict[str, collections.deque] = {}
    if args.kill_at_phase:  # the ranks (forked or exec'd) inherit it: they pause there as at a publishing step
        os.environ[SLOW_PHASE_ENV] = args.kill_at_phase
    for mode in args.modes:
        runs = []
        for attempt in (1, 2):
            base = work / f"reference-{mode}-{attempt}"
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir()
            run_args = (store.location(base), mode, str(base / "events"), args.phase_sleep, args.every, args.model, args.model_save_format)
            codes, took = _run_to_end(args.start, run_args, base / "log", timeout=300)
            if codes != [0, 0]:
                print(f"the {mode} reference run failed with {codes}:\n{_tail(base / 'log')}", file=sys.stderr)
                return 1
            runs.append((outcome(store.location(base), store.logs(base)), took))
        diff = same(runs[0][0], runs[1][0])
        if diff:
            print(f"two uninterrupted {mode} runs differ ({diff}): the training is not deterministic", file=sys.stderr)
            return 1
        references[mode] = runs[0][0]
        durations[mode] = collections.deque((took for _, took in runs), maxlen=5)
        say(f"reference ({mode}): {runs[0][1]:.2f} s and {runs[1][1]:.2f} s, {len(runs[0][0].rows)} steps, two runs bitwise equal")

    counts: collections.Counter = collections.Counter()
    phases: collections.Counter = collections.Counter()
    failures: list[str] = []
    started = time.monotonic()
    for trial in range(args.trials):
        mode = args.modes[trial % len(args.modes)]
        target = rng.choice(((0,), (1,), (0, 1)))
        fraction = rng.uniform(*args.kill_window)
        base = work / f"trial-{trial:04d}"
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir()
        ckpt, events, log = store.location(base), base / "events", base / "log"
        run_args = (ckpt, mode, str(events), args.phase_sleep, args.every, args.model, args.model_save_format)
        counts[f"mode {mode}"] += 1
        counts["target " + ("both" if len(target) == 2 else f"rank {target[0]}")] += 1

        # 1. run and kill
        reference, duration = references[mode], statistics.median(durations[mode])
        began = time.monotonic()
        ranks = _start(args.start, run_args, log)
        try:
            kill_at = began + fraction * duration
            if args.kill_at_phase:  # wait for the phase instead (bounded by 3 whole runs)
                kill_at = began + 3 * duration
            while time.monotonic() < kill_at and None in ranks.poll():
                if args.kill_at_phase and reached(events, args.kill_at_phase, min_save=2):
                    break
                time.sleep(0.001)
            if None not in ranks.poll():
                where, phase = "finished before the kill", None
                durations[mode].append(time.monotonic() - began)
            else:
                killed_at = time.monotonic()
                ranks.kill(target)
                survivors = [r for r in (0, 1) if r not in target]
                deadline = killed_at + args.survivor_grace
                while any(ranks.poll()[r] is None for r in survivors) and time.monotonic() < deadline:
                    time.sleep(0.005)
                for r in survivors:
                    code = ranks.poll()[r]
                    counts["survivor " + ("hung, killed" if code is None else f"exited {code}")] += 1
                    if code is None:  # its stack goes to the log before close() kills it
                        ranks.signal(r, signal.SIGUSR2)
                        time.sleep(0.2)
                where, phase = classify(events, killed_at)
        finally:
            ranks.close()
        counts[where] += 1
        if phase:
            phases[phase] += 1

        # 2. nothing torn
        torn_file = _tear(ckpt) if args.tear else None
        problems = torn_checkpoints(ckpt)
        latest = latest_name(ckpt)
        counts["LATEST none" if latest is None else "LATEST valid" if not problems else "LATEST torn"] += 1
        if problems:
            counts["torn"] += 1
            self_test = f" (self-test tore {torn_file})" if torn_file else ""
            failures.append(f"trial {trial}: torn after a kill {where} ({phase}){self_test}: {'; '.join(problems)}")

        # 3. resume, compare
        resume_args = (ckpt, mode, str(base / "resume.events"), args.phase_sleep, args.every, args.model, args.model_save_format)
        resumed, took = _run_to_end(args.start, resume_args, base / "resume.log", timeout=300)
        if latest is None and resumed == [0, 0]:
            durations[mode].append(took)  # it started from scratch: a whole run
        verdict = "exact"
        if resumed != [0, 0]:
            verdict = "failed"
            failures.append(f"trial {trial}: the resumed run exited {resumed}:\n{_tail(base / 'resume.log')}")
        elif store.leftovers(base):
            verdict = "failed"
            failures.append(f"trial {trial}: left after the resumed run: {store.leftovers(base)}")
        else:
            diff = same(outcome(ckpt, store.logs(base)), reference)
            if diff:
                verdict = "not exact"
                failures.append(f"trial {trial}: resumed run differs from the reference: {diff}")
        counts[f"resumed {verdict}"] += 1
        say(
            f"trial {trial + 1}/{args.trials} {mode} kill {'both' if len(target) == 2 else f'rank {target[0]}'} "
            f"at {args.kill_at_phase or f'{fraction:.2f}'}: {where}{f' ({phase})' if phase else ''}; LATEST {latest or '-'}"
            f"{' TORN' if problems else ''}; resume {verdict}"
        )
        if not problems and verdict == "exact" and not args.dir:
            shutil.rmtree(base, ignore_errors=True)

    elapsed = time.monotonic() - started
    print(f"trials: {args.trials}")
    print(f"start: {args.start}")
    print(f"seed: {args.seed}")
    print(f"model: {args.model} ({args.model_save_format})")
    print(f"store: {args.store}")
    print(f"modes: sync {counts['mode sync']}, async {counts['mode async']}")
    print(f"killed: rank 0 {counts['target rank 0']}, rank 1 {counts['target rank 1']}, both {counts['target both']}")
    print(f"killed before first save: {counts['before first save']}")
    during = ", ".join(f"{name} {phases[name]}" for name in ("snapshot", "staging", "parts", *PUBLISH_PHASES[1:], "returning") if phases[name])
    print(f"killed during a save: {counts['during a save']}" + (f" ({during})" if during else ""))
    print(f"killed between saves: {counts['between saves']}")
    print(f"killed after training: {counts['after training']}")
    print(f"finished before the kill: {counts['finished before the kill']}")
    survivors = ", ".join(f"{k.removeprefix('survivor ')} {v}" for k, v in sorted(counts.items()) if k.startswith("survivor "))
    print(f"survivors: {survivors or 'none'}")
    print(f"LATEST after the kill: none {counts['LATEST none']}, valid {counts['LATEST valid']}, torn {counts['LATEST torn']}")
    print(f"torn checkpoints: {counts['torn']}")
    print(f"resumed exact: {counts['resumed exact']}")
    print(f"resumed not exact: {counts['resumed not exact']}")
    print(f"resume failed: {counts['resumed failed']}")
    print(f"seconds per trial: {elapsed / args.trials:.2f}")
    for line in failures:
        print(f"FAILURE {line}")
    ok = counts["torn"] == 0 and counts["resumed not exact"] == 0 and counts["resumed failed"] == 0
    print(f"result: {'PASS' if ok else 'FAIL'}")
    if not args.dir and ok:
        shutil.rmtree(work, ignore_errors=True)
    elif not ok:
        print(f"kept the failing trials under {work}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
