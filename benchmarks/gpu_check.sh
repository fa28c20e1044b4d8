#!/usr/bin/env bash
# The CUDA half of the measurement path, checked on a GPU machine in a few minutes:
#   1. benchmarks/gpu_probe.py under torchrun (one rank per GPU, at most 8): the names
#      and activity types of the profiler's kernel and NCCL events, their classification
#      as compute / communication, and the allocator's peak against a known extra tensor;
#   2. `autotune trial --device cuda --json` for a few layouts, each result checked
#      (status, device, MFU formula, peak memory, comm fraction zero on one GPU and
#      positive with data parallel on several);
#   3. a memory budget far below the model's needs: the allocator's per-process
#      fraction makes it a real OutOfMemoryError, reported pruned/oom.
# Needs torch with CUDA and the project's dependencies (`pip install -e .`).
# Usage: benchmarks/gpu_check.sh            (PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore
STATUS=0

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 1 ]; then
    echo "gpu_check: no CUDA device visible" >&2
    exit 1
fi
RANKS=$(( GPUS > 8 ? 8 : GPUS ))
echo "== probe on $RANKS GPU(s)"
"$PY" -m torch.distributed.run --standalone --nproc-per-node="$RANKS" benchmarks/gpu_probe.py || STATUS=1

# trial JSON -> checked summary line; exit 1 if a check fails
check_trial() {
    "$PY" - "$1" "$2" <<'EOF'
import json, sys
path, expect = sys.argv[1], sys.argv[2]
r = json.load(open(path))
print(json.dumps(r, indent=1))
failures = []
if expect == "oom":
    if (r["status"], r["reason"]) != ("pruned", "oom"):
        failures.append(f"expected pruned/oom, got {r['status']}/{r['reason']}: {r.get('error')}")
else:
    if r["status"] != "complete":
        failures.append(f"{r['status']}/{r['reason']}: {r.get('error')}")
    else:
        mfu = r["flops_per_token"] * r["tokens_per_s"] / (r["world_size"] * r["peak_tflops"] * 1e12)
        if r["device"] != "cuda": failures.append("device is not cuda")
        if abs(mfu - r["mfu"]) > 1e-9 * mfu: failures.append(f"mfu {r['mfu']} != formula {mfu}")
        if not 0 < r["mfu"] < 1: failures.append(f"mfu {r['mfu']} out of (0, 1)")
        if not r["peak_mem_bytes"] > max(r["resident_mem_bytes_per_rank"]) > 0: failures.append("peak memory")
        if r["world_size"] == 1 and r["comm_fraction"] != 0: failures.append("comm on one GPU")
        if r["world_size"] > 1 and not r["comm_fraction"] > 0: failures.append("no comm with several GPUs")
print(f"{'FAIL' if failures else 'PASS'} trial {r.get('layout', '')} ({expect}): "
      + ("; ".join(failures) if failures else
         f"{r['tokens_per_s']:.0f} tokens/s, mfu {r['mfu']:.3f} (peak {r['peak_tflops']} TFLOP/s from "
         f"{r['peak_tflops_source']}), peak {r['peak_mem_bytes'] / 2**30:.2f} GiB, "
         f"comm {r['comm_fraction']:.3f}, exposed {r['exposed_comm_fraction']:.3f}"))
sys.exit(1 if failures else 0)
EOF
}

OUT_DIR=$(mktemp -d)
run_trial() {  # gpus expect args...
    local gpus=$1 expect=$2 file
    shift 2
    file="$OUT_DIR/trial$((++TRIALS)).json"
    echo "== autotune trial --gpus $gpus $*"
    "$PY" -m autotune.cli trial --device cuda --gpus "$gpus" --steps 3 --warmup 2 --json "$@" > "$file" || true
    check_trial "$file" "$expect" || STATUS=1
}
TRIALS=0
run_trial 1 complete --model tiny --layout "mbs=1"
run_trial 1 complete --model tiny --layout "mbs=4" --trace "$OUT_DIR/trace"
ls "$OUT_DIR/trace" || STATUS=1
if [ "$RANKS" -ge 2 ]; then
    run_trial "$RANKS" complete --model tiny --layout "dp=$RANKS,mbs=2"
fi
run_trial 1 oom --model tiny --layout "mbs=4" --memory-budget-gb 0.0005

echo "== gpu_check: $([ "$STATUS" -eq 0 ] && echo PASS || echo FAIL)"
exit "$STATUS"
