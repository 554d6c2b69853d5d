#!/usr/bin/env bash
# Issue 13 on two GPUs of one host, in one device call (a few minutes):
#   1. the NCCL tests (pytest -m gpu): single layers (fp32 1e-5, bf16 2x rule) and whole-model
#      generate with TP 2 / DCP 2 (fp32, token for token) against one process;
#   2. torchrun --nproc-per-node 2 -m dsv4attn generate --tp 2 / --dcp 2 (fp32; the single run --check)
#      against one process: the --json token lists must be equal;
#   3. benchmarks/bench_distributed.py at 64K and 1M context for TP 1 = DCP 1, TP 2 and DCP 2,
#      printed as one table (decode step time and memory per GPU) for docs/benchmarks.md.
# NVLink multicast stays off (NCCL, PyTorch symmetric memory, NVSHMEM). Logs go to $OUT (or ./out).
#   bash scripts/gpu_distributed.sh [tests|generate|bench|all]
set -uo pipefail
what=${1:-all}
out=${OUT:-out}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
GEN_DEVICE=${GEN_DEVICE:-cuda}  # cpu: a dry run of the script without GPUs
BENCH_ARGS=${BENCH_ARGS:-"--contexts 65536,1048576 --batch 1,8 --reps 10"}
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
rc=0
fail() { echo "FAIL: $*" | tee -a "$out/summary.log"; rc=1; }
BUDGET_S=${BUDGET_S:-420}  # a benchmark run starts only while the call is younger than this
late() { [ $(( $(date +%s) - t_start )) -ge "$BUDGET_S" ] && echo "skipped (over ${BUDGET_S} s): $*" | tee -a "$out/summary.log"; }
t_start=$(date +%s)
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
  echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"; } 2>&1 | tee "$out/env.log"

if [ "$what" = tests ] || [ "$what" = all ]; then
  echo "=== NCCL tests"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -m gpu --durations=5 \
    tests/test_distributed_layers.py tests/test_distributed_model.py 2>&1 | tee "$out/pytest_gpu_distributed.log"
  [ "${PIPESTATUS[0]}" = 0 ] || fail "pytest -m gpu (see pytest_gpu_distributed.log)"
fi

if [ "$what" = generate ] || [ "$what" = all ]; then
  echo "=== torchrun generate equality (fp32)"
  GEN="generate --tiny 0 --num-prompts 10 --max-new-tokens 16 --dtype float32 --device $GEN_DEVICE --json --no-progress"
  timeout 90 python3 -m dsv4attn $GEN --check 2>&1 | tee "$out/generate_single.log"
  [ "${PIPESTATUS[0]}" = 0 ] || fail "single-process generate --check"
  for split in "--tp 2" "--dcp 2"; do
    name=$(echo "$split" | tr -d ' -')
    timeout 120 $TORCHRUN -m dsv4attn $GEN $split 2>&1 | tee "$out/generate_$name.log"
    [ "${PIPESTATUS[0]}" = 0 ] || fail "torchrun generate $split"
    python3 - "$out/generate_single.log" "$out/generate_$name.log" "$split" <<'PY' || fail "generate $split tokens differ from one process"
import json, sys
def tokens(path):
    lines = [ln for ln in open(path) if ln.startswith("[[")]
    return json.loads(lines[-1]) if lines else None
a, b = tokens(sys.argv[1]), tokens(sys.argv[2])
ok = a is not None and a == b
print(f"generate {sys.argv[3]}: {'EQUAL to' if ok else 'DIFFERENT from'} one process ({len(a or [])} prompts)")
sys.exit(0 if ok else 1)
PY
  done
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  echo "=== bench_distributed ($BENCH_ARGS)"
  late "bench tp1 dcp1" || { timeout 120 python3 -m benchmarks.bench_distributed $BENCH_ARGS \
    --json "$out/bench_tp1_dcp1.json" 2>&1 | tee "$out/bench_tp1_dcp1.log" || fail "bench tp1 dcp1"; }
  late "bench tp2" || { timeout 120 $TORCHRUN -m benchmarks.bench_distributed $BENCH_ARGS --tp 2 \
    --json "$out/bench_tp2.json" 2>&1 | tee "$out/bench_tp2.log" || fail "bench tp2"; }
  late "bench dcp2" || { timeout 120 $TORCHRUN -m benchmarks.bench_distributed $BENCH_ARGS --dcp 2 \
    --json "$out/bench_dcp2.json" 2>&1 | tee "$out/bench_dcp2.log" || fail "bench dcp2"; }
  python3 -m benchmarks.bench_distributed --combine "$out/bench_tp1_dcp1.json" "$out/bench_tp2.json" \
    "$out/bench_dcp2.json" 2>&1 | tee "$out/bench_distributed.md"
fi

echo "total $(( $(date +%s) - t_start )) s; $([ $rc = 0 ] && echo ALL PASS || echo 'SOME FAILED (summary.log)')" \
  | tee -a "$out/summary.log"
exit $rc
