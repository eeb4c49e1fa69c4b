"""Our gloo collectives on 2 real ranks, torch's object collectives counted (bytes by pickling).

Usage: collectives.py OUT_DIR. Each rank writes OUT_DIR/rank_<R>.json: what each call returned
or raised, and how often torch's all_gather_object / gather / broadcast / all_reduce ran.
"""

import collections
import json
import sys
from pathlib import Path

import torch.distributed as dist

import ranks  # this folder's shared rank start
from resilience.distributed import DistContext

world, rank = ranks.join()
calls: collections.Counter[str] = collections.Counter()
for name in ("all_gather_object", "gather", "broadcast", "all_reduce", "all_gather", "send", "recv"):
    original = getattr(dist, name)

    def counted(*args, _original=original, _name=name, **kwargs):
        calls[_name] += 1
        return _original(*args, **kwargs)

    setattr(dist, name, counted)

ctx = DistContext.from_env(timeout_s=30)
out: dict = {}


def fail(detail: str) -> RuntimeError:
    return RuntimeError(f"failed: {detail}")


def record(label: str, fn) -> None:
    calls.clear()
    try:
        out[label] = {"result": fn()}
    except RuntimeError as exc:
        out[label] = {"raised": str(exc)}
    out[label]["calls"] = dict(calls)


records = [f"model/shard-{rank}.safetensors", f"rng/rank_{rank}.safetensors"] * (1 + 50 * rank)  # unequal sizes
record("healthy_verdict", lambda: ctx.gather_or_raise(None, fail=fail))
record("records_to_root", lambda: ctx.gather_to_root_or_raise(None, records, fail=fail))
record("verdict_with_share", lambda: ctx.verdict_from_root(None, ["epoch_0_step_1"] if rank == 0 else None, fail=fail))
record("verdict_without_share", lambda: ctx.verdict_from_root(None, None, fail=fail))
record("one_rank_fails_records", lambda: ctx.gather_to_root_or_raise("disk full" if rank == 1 else None, records, fail=fail))
record("one_rank_fails_verdict", lambda: ctx.verdict_from_root("rename failed" if rank == 0 else None, ["x"] if rank == 0 else None, fail=fail))
record("payload_everywhere", lambda: ctx.gather_or_raise(None, rank * 10, fail=fail))
record("to_leaders_of_2", lambda: ctx.gather_to_leaders([f"rank_state/rank_{rank}"] * (1 + 50 * rank), 2))
record("to_leaders_of_1", lambda: ctx.gather_to_leaders([f"rank_state/rank_{rank}"], 1))
Path(sys.argv[1], f"rank_{rank}.json").write_text(json.dumps(out))
ctx.close()
dist.destroy_process_group()
