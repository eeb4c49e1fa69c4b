# The README's commands. Everything a fresh Debian machine (Python 3.11, root) needs is set up here.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench gpu-check install clean

install: $(STAMP)

# torch is pinned to the CPU wheel that lies on this machine kind's disk; any other spec
# pulls a multi-GB CUDA build. pyproject.toml allows a range for users elsewhere.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,examples,interop,storage]'
	# shellcheck lints the rendered batch scripts in the tests (skipped where it cannot be had)
	command -v shellcheck >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends shellcheck >/dev/null; } || true
	touch $(STAMP)

# The digits MLP (DDP), then the language model (FSDP2): each preempted through one rank, resumed, compared bitwise.
demo: $(STAMP)
	$(PY) examples/digits/demo.py
	$(PY) examples/llm/demo.py

# Lint first: a ruff violation (style, unused code, a missing docstring in resilience/), an unformatted file or a
# type error in resilience/ (mypy, configured in pyproject.toml; docs/how-it-works.md#type-checking) fails the target.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test: lint
	$(PY) -m pytest

# Twice: on the machine as it is, then beside one CPU-busy process (bench/results/latest.json: loaded.*);
# then the save and resume at 8 to 8,192 simulated ranks (bench/results/scale.json, ~30 min, at low priority);
# then the stop agreement's round at 1,024 and 8,192 ranks from a gloo hop measured here (bench/results/agreement.json);
# then save and load on an S3 endpoint (moto, 127.0.0.1) vs its raw PUT/GET of the same bytes (bench/results/object_store.json).
bench: $(STAMP)
	$(PY) -m bench --load
	nice -n 19 $(PY) -m bench.scale
	$(PY) -m bench.agreement
	$(PY) -m bench.object_store

# What only a CUDA device shows (bench/gpu_check.py, < 5 min, never part of `make test`): a 1-rank FSDP2
# Llama on NCCL preempted and resumed bitwise (CUDA RNG included), the async save's blocked time with
# pinned staging vs one device-to-host copy, the sync save vs the disk, the agreement beside NCCL.
# Needs a CUDA build of torch (this Makefile's venv has the CPU wheel): make gpu-check VENV=/path/to/cuda-venv.
# Exits 3 when torch sees no CUDA device, 1 on any mismatch.
gpu-check:
	$(PY) -m bench.gpu_check

clean:
	rm -rf $(VENV) runs
