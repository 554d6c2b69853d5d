#!/usr/bin/env bash
# The release check of a round on two GPUs of one host (device kind nvidia-h200-x2), as two
# calls made back to back (the machine stays warm between them):
#
#   bash scripts/gpu_final.sh suite [FLASHMLA_SAVED]   # GPU 0: the whole suite on compiled kernels,
#                                                     #   then compute-sanitizer memcheck over the
#                                                     #   kernel tests; GPU 1 meanwhile: benchmarks
#   bash scripts/gpu_final.sh dist                    # both GPUs: scripts/gpu_distributed.sh all
#
# Knobs (env): SKIP_VS=1 (no side-by-side table), MODEL_S / MODEL_ARGS and SPEC_S / SPEC_ARGS
# (time limit and arguments of bench_model / bench_spec), MEMCHECK_S.
#
# FLASHMLA_SAVED: a folder with flash_mla.tgz.part* (FlashMLA built earlier on the same image by
# scripts/gpu_vs_flashmla.sh); without it bench_vs_flashmla prints dsv4attn's times alone.
# Logs: one folder, packed into $OUT/<phase>_logs.tgz (the device tool returns few files), plus
# $OUT/<phase>_summary.txt with the tails that matter.
set -uo pipefail
phase=${1:?phase: suite or dist}
saved=${2:-}
out=${OUT:-out}; mkdir -p "$out"
logs=$(mktemp -d)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
summary="$out/${phase}_summary.txt"
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit ${COMMIT:-unknown}"; } > "$summary" 2>&1

if [ "$phase" = suite ]; then
  fm=()
  if [ -n "$saved" ] && ls "$saved"/flash_mla.tgz.part* >/dev/null 2>&1; then
    mkdir -p /tmp/fm && cat "$saved"/flash_mla.tgz.part* | tar xz -C /tmp/fm && fm=(--flashmla-path /tmp/fm)
  fi
  (
    export CUDA_VISIBLE_DEVICES=0
    timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 -rs tests > "$logs/pytest.log" 2>&1
    echo "pytest rc=$?" >> "$logs/pytest.log"
    timeout "${MEMCHECK_S:-200}" compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
      python3 -m pytest -q -p no:cacheprovider tests/test_sparse_attn_sm90.py tests/test_sparse_attn_hardening.py \
      tests/test_indexer_ops.py tests/test_compressor_ops.py tests/test_kv_writers.py > "$logs/memcheck.log" 2>&1
    echo "memcheck rc=$?" >> "$logs/memcheck.log"
  ) &
  (
    export CUDA_VISIBLE_DEVICES=1
    if [ -z "${SKIP_VS:-}" ]; then
      timeout 150 python3 -m benchmarks.bench_vs_flashmla "${fm[@]}" --graphs --json "$logs/vs.json" > "$logs/vs.txt" 2>&1
    fi
    timeout "${MODEL_S:-150}" python3 -m benchmarks.bench_model ${MODEL_ARGS:-} > "$logs/bench_model.txt" 2>&1
    timeout "${SPEC_S:-80}" python3 -m benchmarks.bench_spec ${SPEC_ARGS:-} > "$logs/bench_spec.txt" 2>&1
  ) &
  wait
  { echo "== pytest"; tail -n 25 "$logs/pytest.log"; echo "== memcheck"; grep -E "ERROR SUMMARY|rc=|passed|failed" "$logs/memcheck.log" | tail -n 8
    echo "== vs FlashMLA"; grep -E "^\|" "$logs/vs.txt"; echo "== model"; grep -E "^\||^#" "$logs/bench_model.txt" | head -n 60
    echo "== spec"; grep -E "^\||^#" "$logs/bench_spec.txt"
  } >> "$summary" 2>&1
else
  BUDGET_S=${BUDGET_S:-200} BENCH_ARGS=${BENCH_ARGS:-"--contexts 65536,1048576 --batch 1 --reps 5"} OUT="$logs" \
    bash scripts/gpu_distributed.sh all > "$logs/distributed.log" 2>&1
  echo "gpu_distributed rc=$?" >> "$logs/distributed.log"
  { tail -n 60 "$logs/distributed.log"; cat "$logs"/summary.log 2>/dev/null; } >> "$summary"
fi
tar czf "$out/${phase}_logs.tgz" -C "$logs" .
tail -n 70 "$summary"
