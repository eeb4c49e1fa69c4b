#!/usr/bin/env bash
# Write model/consolidated/ -- a Hugging Face bundle (model-0000I-of-0000N.safetensors,
# model.safetensors.index.json, config and tokenizer files) -- from the sharded safetensors in the
# directory holding this script. Written into every safetensors checkpoint by `resilience`.
#
# Works from any working directory and after the checkpoint is moved: it finds its own directory.
# A no-op when a complete model/consolidated/ already exists.
#
#   NPROC_PER_NODE  worker processes, each writing whole output files (default 1)
#   NUM_THREADS     reader threads per worker (default 5); keep NPROC_PER_NODE * NUM_THREADS
#                   within your CPU allocation
#   CAST_DTYPE      bf16 | fp16 | fp32 | fp64: export ordinary float tensors in this dtype
#                   (default: each tensor's original Hugging Face dtype when it was known at save
#                   time, else its saved dtype; FP8 and non-float tensors are never cast)
#   PYTHON          the interpreter with `resilience` installed (default: python3 on PATH)
#
# Further arguments go to `resilience consolidate` (e.g. --output DIR, --no-progress).
#   NPROC_PER_NODE=16 NUM_THREADS=5 CAST_DTYPE=bf16 bash /path/to/epoch_0_step_20/model/consolidate.sh
set -euo pipefail

MODEL_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)"
PY="${PYTHON:-python3}"

if ! "$PY" -c 'import resilience' 2>/dev/null; then
    echo "consolidate.sh: '$PY' cannot import resilience; set PYTHON=/path/to/venv/bin/python" >&2
    exit 2
fi

exec "$PY" -m resilience consolidate "$MODEL_DIR" \
    --nproc "${NPROC_PER_NODE:-1}" \
    --num-threads "${NUM_THREADS:-5}" \
    ${CAST_DTYPE:+--cast-dtype "$CAST_DTYPE"} \
    "$@"
