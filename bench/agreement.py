"""``python -m bench.agreement``: the stop agreement's round at 1,024 and 8,192 ranks, from a hop measured here.

    python -m bench.agreement            # 9 rounds of 200 all-reduces on 2 and 4 processes
    python -m bench.agreement --quick    # 3 rounds of 30 (the test suite's)

Gloo's all-reduce is a ring: ``2(P - 1)`` sequential hops. On ``P`` = 2 and 4 real gloo processes
on this machine (127.0.0.1) it times back-to-back blocking all-reduces of the agreement's payload
(two int64) and takes per round ``hop = call time / 2(P - 1)``; the median over rounds, with its
distribution-free 95 % interval (:func:`bench.stats.median_interval`), is the hop latency. On 4
processes as 2 "nodes" of 2 (``GROUP_RANK``) it also times the library's own node-group round
(:class:`resilience.stop.node_groups.NodeGroups`) beside the hops its model predicts.

Then, from the model ``hops x hop latency`` (:func:`resilience.stop.node_groups.ring_hops`), the
round at N = 1,024 and 8,192 ranks, 8 per node, for the flat ring and for node groups, with the
interval carried through, and the same from the published per-hop range (0.2-0.4 s for the flat
ring at 1,024 ranks: 98-196 us a hop). A round longer than the time between two agreement
rounds (``agreement_interval_s``, the library's default) would block the update that reads it by the
difference; the cadence floor (``auto``: rounds at least 2 measured rounds apart) removes that
wait and stretches the stop latency instead (within about twice the interval), shown beside it.
On this shared 2-core machine 4 processes wait for CPU, so a hop here is scheduling-bound, not a
network's figure. Writes ``bench/results/agreement.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import REPO
from bench.stats import median_interval
from resilience.config import StepSchedulerConfig

SIZES = (2, 4)
AT_RANKS = (1024, 8192)
PER_NODE = 8
INTERVAL_S = StepSchedulerConfig().agreement_interval_s  # the library's default
PUBLISHED_HOP_S = (0.2 / 2046, 0.4 / 2046)  # 0.2-0.4 s for a flat ring of 1,024 ranks


def _worker(rank: int, world: int, port: int, rounds: int, calls: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from resilience.stop.node_groups import NodeGroups

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    group = dist.new_group(backend="gloo")
    buf = torch.zeros(2, dtype=torch.int64)

    def per_call(fn) -> list[float]:
        for _ in range(calls // 3 + 1):  # warm up the connections and the allocator
            fn()
        times = []
        for _ in range(rounds):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls)
        return times

    report: dict[str, Any] = {"flat": per_call(lambda: dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group))}
    if world >= 4 and world % 2 == 0:  # "2 nodes": keys rank // (world // 2)
        nodes = NodeGroups.build([r // (world // 2) for r in range(world)], rank, 60.0)
        report["node_groups"] = per_call(lambda: nodes.start(buf).result())
        report["node_groups_layout"] = [nodes.nodes, nodes.per_node]
        nodes.close()
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(report))


def _measure(world: int, rounds: int, calls: int, tmp: Path) -> dict[str, Any]:
    from resilience.launch import resolve_master_port

    port = resolve_master_port(None, {})
    out = tmp / f"agreement_{world}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    args = [str(world), str(port), str(rounds), str(calls), str(out)]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.agreement", "--worker", str(r), *args], cwd=REPO, env=env) for r in range(world)]
    try:
        codes = [proc.wait(timeout=600) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if codes != [0] * world:
        raise RuntimeError(f"bench.agreement: the {world} processes exited {codes}")
    return json.loads(out.read_text())


def _scaled(interval: dict[str, Any], hops: int) -> dict[str, Any]:
    """A round of ``hops`` hops from a per-hop interval (seconds), and what it blocks an update by."""
    keys = ("median", "ci_low", "ci_high")
    round_s = {k: (interval[k] * hops if interval[k] is not None else None) for k in keys}
    blocks = {k: (max(0.0, v - INTERVAL_S) if v is not None else None) for k, v in round_s.items()}
    floor = {k: (max(INTERVAL_S, 2 * v) if v is not None else None) for k, v in round_s.items()}
    return {
        "hops": hops,
        "round_s": round_s,
        "blocks_update_s": blocks,  # at the default interval between rounds
        "floor_interval_s": floor,  # auto with the floor: the time between rounds; no update waits
        "stop_within_s": {k: (2 * v if v is not None else None) for k, v in floor.items()},
        "confidence": interval["confidence"],
    }


def model(hop: dict[str, Any]) -> dict[str, Any]:
    """Per N of :data:`AT_RANKS`: the flat ring's and the node groups' round from ``hop`` (a
    :func:`median_interval` of per-hop seconds), and from the published per-hop range."""
    from resilience.stop.node_groups import ring_hops

    published = {"median": sum(PUBLISHED_HOP_S) / 2, "ci_low": PUBLISHED_HOP_S[0], "ci_high": PUBLISHED_HOP_S[1], "confidence": None}
    out = {}
    for n in AT_RANKS:
        flat, grouped = ring_hops(n), ring_hops(n, PER_NODE)
        out[str(n)] = {
            "flat": _scaled(hop, flat),
            "node_groups": _scaled(hop, grouped),
            "published_flat": _scaled(published, flat),
            "published_node_groups": _scaled(published, grouped),
        }
    return out


def run(rounds: int, calls: int, tmp: Path) -> dict[str, Any]:
    """Measure on :data:`SIZES` processes, then model; the JSON document."""
    from resilience.stop.node_groups import ring_hops

    measured: dict[str, Any] = {}
    for world in SIZES:
        raw = _measure(world, rounds, calls, tmp)
        hops = ring_hops(world)
        cell = {"call_s": median_interval(raw["flat"]), "hop_s": median_interval([t / hops for t in raw["flat"]]), "hops": hops}
        if "node_groups" in raw:
            nodes, per_node = raw["node_groups_layout"]
            cell["node_groups"] = {"round_s": median_interval(raw["node_groups"]), "hops": ring_hops(world, per_node), "nodes": nodes}
            cell["node_groups"]["model_round_s"] = cell["hop_s"]["median"] * cell["node_groups"]["hops"]
        measured[str(world)] = cell
    hop = measured[str(max(SIZES))]["hop_s"]  # the most hops per call: the least per-call overhead per hop
    return {
        "measured": measured,
        "hop_s": hop,
        "per_node": PER_NODE,
        "interval_s": INTERVAL_S,
        "model": model(hop),
        "rounds": rounds,
        "calls_per_round": calls,
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def table(doc: dict[str, Any]) -> str:
    """The figure as a Markdown table (milliseconds)."""
    hop = doc["hop_s"]
    lines = [
        f"gloo hop here: {1e6 * hop['median']:.1f} us (95 % interval {1e6 * hop['ci_low']:.1f}-{1e6 * hop['ci_high']:.1f}, {hop['n']} rounds); "
        f"{doc['per_node']} ranks per node; an update blocks when the round exceeds {doc['interval_s']} s",
        "",
        "| N | scheme | hops | round here, ms (interval) | blocks an update, ms | with the floor: stop within, s | round at published hops, ms |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for n, cells in doc["model"].items():
        for scheme in ("flat", "node_groups"):
            here, pub = cells[scheme], cells[f"published_{scheme}"]
            r, p = here["round_s"], pub["round_s"]
            lines.append(
                f"| {n} | {scheme} | {here['hops']} | {_ms(r['median'])} ({_ms(r['ci_low'])}-{_ms(r['ci_high'])}) | "
                f"{_ms(here['blocks_update_s']['median'])} | {here['stop_within_s']['median']:.2f} | {_ms(p['ci_low'])}-{_ms(p['ci_high'])} |"
            )
    four = doc["measured"].get("4", {}).get("node_groups")
    if four:
        lines += ["", f"4 processes as 2 nodes: node-group round {_ms(four['round_s']['median'])} ms measured, {_ms(four['model_round_s'])} ms modelled"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        rank, world, port, rounds, calls, out = argv[1:7]
        _worker(int(rank), int(world), int(port), int(rounds), int(calls), out)
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.agreement", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 30 calls")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "agreement.json"), help="where the JSON goes")
    args = parser.parse_args(argv)
    rounds, calls = (3, 30) if args.quick else (9, 200)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-agreement-") as tmp:
        doc = run(rounds, calls, Path(tmp))
    out.write_text(json.dumps(doc, indent=1))
    print(table(doc))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
