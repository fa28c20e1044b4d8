#!/usr/bin/env bash
# The CUDA half of the measurement path, checked on a GPU machine in about 8 minutes:
#   1. benchmarks/gpu_probe.py under torchrun (one rank per GPU, at most 8): the names
#      and activity types of the profiler's kernel and NCCL events, their classification
#      as compute / communication, and the allocator's peak against a known extra tensor;
#   2. benchmarks/gpu_check.py: one-GPU bf16 trials of a 1.1B model at five layouts that
#      differ in memory, each against the estimator (peak, state, step time, MFU against
#      the preset's peak and a measured GEMM), a real OutOfMemoryError reported
#      pruned/oom, and benchmarks/GPU.md with every figure.
# Needs torch with CUDA and the project (`pip install -e .`, or --no-deps beside another
# torch). --dry-run runs both on the CPU (gloo, `tiny`), to know the script works before
# a GPU is spent on it; it writes its report to a temporary file.
# Usage: benchmarks/gpu_check.sh [--dry-run]      (PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
STATUS=0
DRY_RUN=()
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=(--dry-run)
    RANKS=2 PROBE=(--cpu)
else
    GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    if [ "$GPUS" -lt 1 ]; then
        echo "gpu_check: no CUDA device visible (--dry-run runs the check on the CPU)" >&2
        exit 2
    fi
    RANKS=$(( GPUS > 8 ? 8 : GPUS )) PROBE=()
fi
echo "== probe on $RANKS rank(s)"
"$PY" -m torch.distributed.run --standalone --nproc-per-node="$RANKS" benchmarks/gpu_probe.py "${PROBE[@]}" || STATUS=1
"$PY" benchmarks/gpu_check.py "${DRY_RUN[@]}" || STATUS=1
echo "== gpu_check: $([ "$STATUS" -eq 0 ] && echo PASS || echo FAIL)"
exit "$STATUS"
