#!/usr/bin/env bash
# serval on CUDA, checked in one call on a machine lent a GPU (bench/gpu/README.md): installs the carried wheels,
# then runs bench/gpu/probe.py, whose JSON lines (and stderr, and the server's log) land in $OUT.
# From the checkout, after bench/gpu/prepare.sh here:  bash bench/gpu/check.sh [probe.py arguments]
# carrying .device; about 6-8 minutes with the defaults (PROBE_TIMEOUT bounds the probe).
set -u
T0=$(date +%s)
elapsed() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
OUT=${OUT:-/tmp/serval-gpu-out}
mkdir -p "$OUT"
carried=$root/.device
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$carried"/whl/*.whl || exit 1
# The native CPU kernels serve the CPU only; they need not (and may not) build on the GPU machine.
export PYTHONPATH=/tmp/site:$root PYTHONUNBUFFERED=1 SERVAL_DISABLE_NATIVE_KERNELS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
elapsed setup
timeout "${PROBE_TIMEOUT:-450}" python3 bench/gpu/probe.py --tokenizer-gguf "$carried/tokenizer.gguf" \
  --out-dir "$OUT" "$@" 2> "$OUT/probe.err" | tee "$OUT/probe.jsonl"
status=${PIPESTATUS[0]}
elapsed "probe done (exit $status)"
tail -40 "$OUT/probe.err"
exit "$status"
