"""The fault file several nodes' launchers share (resilience.launch.node_faults), two launchers'
views of one real file, with a fake clock (the two-node runs are in test_watchdog.py)."""

from __future__ import annotations

from pathlib import Path

from resilience.launch.node_faults import NodeFaults, Record, parse


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def views(path: Path, nnodes: int = 2) -> tuple[Clock, list[NodeFaults]]:
    clock = Clock()
    return clock, [NodeFaults(str(path), node, nnodes, clock=clock, sleep=clock.sleep) for node in range(nnodes)]


def test_a_fault_is_seen_by_the_other_node_of_the_same_start_only(tmp_path: Path) -> None:
    clock, (node0, node1) = views(tmp_path / "faults")
    assert node0.peer_fault() is None  # no file yet
    assert node1.record_fault("rank 1 exited with signal SIGKILL", True)
    assert not node1.record_fault("rank 1 exited with code 1", False)  # once per start
    assert node1.peer_fault() is None  # its own record
    assert node0.peer_fault() is None  # read less than READ_INTERVAL_S ago
    clock.now += 1
    seen = node0.peer_fault()
    assert seen == Record("fault", 0, 1, True, "rank 1 exited with signal SIGKILL")
    assert seen.describe() == "node 1's launcher: rank 1 exited with signal SIGKILL"
    node0.begin(1)  # a later start does not see the earlier start's fault
    clock.now += 1
    assert node0.peer_fault() is None


def test_the_restart_barrier_waits_for_every_node_and_an_end_or_the_timeout_cancels_it(tmp_path: Path) -> None:
    clock, (node0, node1) = views(tmp_path / "faults")
    node1._append("restart 1 1")  # node 1 is ready first
    assert node0.wait_for_restart(10) is None
    node0.begin(1)
    node1.begin(1)
    node1.record_end()  # node 1 will not begin start 2
    assert node0.wait_for_restart(10) == "node(s) [1] will not restart"
    clock3, (lone, _, _) = views(tmp_path / "three", nnodes=3)
    assert lone.wait_for_restart(5) == "node(s) [1, 2] did not get ready to restart within 5 s"
    assert clock3.now >= 5


def test_a_kill_on_another_node_is_found_while_it_is_recorded_within_the_settle_time(tmp_path: Path) -> None:
    clock, (node0, node1) = views(tmp_path / "faults")
    node0.record_fault("rank 0 exited with code 1", False)  # its collective failed: a consequence
    assert node1.peer_infrastructure(wait_s=1) is None
    assert clock.now >= 1
    node1.record_fault("rank 1 exited with signal SIGKILL", True)
    assert node0.peer_infrastructure().text == "rank 1 exited with signal SIGKILL"


def test_torn_and_foreign_lines_are_ignored() -> None:
    assert parse("fault 0 1 1 rank 1 exited with signal SIGKILL\n") == Record("fault", 0, 1, True, "rank 1 exited with signal SIGKILL")
    assert parse("restart 2 0\n") == Record("restart", 2, 0)
    for line in ("fault 0 1", "restart x 0", "end 1", "something else entirely", ""):
        assert parse(line) is None
