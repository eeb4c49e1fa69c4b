"""The save and the resume read top to bottom: traced on a real run, every call between the
package's modules goes down (the graph of "module A called a function of module B" has no cycle:
no callback climbs back into a caller's module), and the loop reaches the checkpoint package only
through ``Checkpointer``. docs/how-it-works.md walks the same path.

Traced with ``sys.setprofile``/``threading.setprofile`` (the parts' writer thread included), on
one process: Linear + SGD with momentum, a periodic save at step 2 and the final save at step 4
(which also writes the Hugging Face bundle), then a second run resuming from it.
"""

from __future__ import annotations

import collections
import sys
import threading

import pytest
import torch

from resilience.checkpoint import Checkpointer
from resilience.loop import ResilientLoop
from tiny_runs import train_xy

pytestmark = pytest.mark.usefixtures("no_launcher_environment")


def _package_of(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name.startswith("resilience") else None


class CallGraph:
    """Calls between ``resilience`` modules while a traced method runs: {(caller, callee): functions}."""

    def __init__(self):
        self.edges: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
        self.modules: set[str] = set()

    def profile(self, frame, event, arg):
        if event != "call" or (callee := _package_of(frame)) is None:
            return
        self.modules.add(callee)
        caller = frame.f_back
        while caller is not None and _package_of(caller) is None:  # through torch, threading, ...
            caller = caller.f_back
        if caller is not None and _package_of(caller) != callee:
            self.edges[(_package_of(caller), callee)].add(frame.f_code.co_name)

    def wrap(self, method):
        def traced(*args, **kwargs):
            sys.setprofile(self.profile)
            threading.setprofile(self.profile)
            try:
                return method(*args, **kwargs)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)

        return traced

    def cycles(self) -> list[str]:
        """Each edge A -> B where B reaches A again, as ``"A -> B.fn"``."""
        graph = collections.defaultdict(set)
        for caller, callee in self.edges:
            graph[caller].add(callee)

        def reaches(start: str, goal: str) -> bool:
            seen, todo = set(), [start]
            while todo:
                node = todo.pop()
                if node == goal:
                    return True
                if node not in seen:
                    seen.add(node)
                    todo.extend(graph[node])
            return False

        return [f"{a} -> {b}.{sorted(self.edges[(a, b)])}" for a, b in sorted(self.edges) if reaches(b, a)]


@pytest.fixture
def traced(monkeypatch):
    graphs = {"save": CallGraph(), "resume": CallGraph()}
    monkeypatch.setattr(ResilientLoop, "_save", graphs["save"].wrap(ResilientLoop._save))
    monkeypatch.setattr(ResilientLoop, "_resume", graphs["resume"].wrap(ResilientLoop._resume))
    return graphs


def _run(tmp_path, max_steps: int):
    config = {"checkpoint": {"checkpoint_dir": str(tmp_path)}, "step_scheduler": {"ckpt_every_steps": 2, "max_steps": max_steps}}
    torch.manual_seed(0)
    return train_xy(config, batches=8)


@pytest.mark.parametrize("path", ["save", "resume"])
def test_every_call_between_modules_goes_down_and_the_loop_enters_checkpointing_only_through_checkpointer(tmp_path, traced, path):
    assert _run(tmp_path, 4).exit_code == 0
    assert _run(tmp_path, 6).exit_code == 0  # resumes from step 4
    graph = traced[path]
    assert "resilience.checkpoint.storage.durable" in graph.modules, f"the {path} was not traced down to the files"
    assert graph.cycles() == [], f"calls that climb back up during a {path}:\n" + "\n".join(graph.cycles())
    entered = {fn for (caller, callee), fns in graph.edges.items() if caller == "resilience.loop" and callee.startswith("resilience.checkpoint") for fn in fns}
    assert entered and all(hasattr(Checkpointer, fn) for fn in entered), f"the loop called into checkpointing around Checkpointer: {entered}"
