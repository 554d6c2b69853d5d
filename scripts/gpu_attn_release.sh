#!/usr/bin/env bash
# One device call (~230 s on a fresh H200) that records the attention side-by-side table (issue 9):
#   bash scripts/gpu_attn_release.sh [FLASHMLA_SRC]     (default .flashmla: a copy of ../shared/flashmla)
# FlashMLA is built from source in the background (~150-180 s) while a smoke test of the
# warp-specialised kernel and the attention tests run on compiled kernels; then the Gluon kernels
# are timed side by side (scripts/attn_variants.py --quick) and both libraries on the same inputs
# (benchmarks.bench_vs_flashmla through scripts/gpu_vs_flashmla.sh). Logs go to $OUT or ./out.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
SRC="${1:-.flashmla}"
OUT="${OUT:-out}"; mkdir -p "$OUT"; export OUT
start=$(date +%s)
MAX_JOBS=16 FLASHMLA_BUILD_DIR=/tmp/flashmla_build BG=1 bash "$SRC/build.sh" > "$OUT/build_start.txt" 2>&1
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_sparse_attn_sm90.py -k "ws and (h64-idx+idx or h40)" \
  > "$OUT/smoke.txt" 2>&1 || { echo "smoke test failed: see $OUT/smoke.txt"; tail -n 20 "$OUT/smoke.txt"; exit 1; }
echo "smoke ok at $(( $(date +%s) - start )) s"
TESTS_TIMEOUT=150 bash scripts/gpu_vs_flashmla.sh "$SRC" /nonexistent tests
echo "tests at $(( $(date +%s) - start )) s"
timeout 60 python3 -m scripts.attn_variants --quick > "$OUT/variants.txt" 2>&1
echo "variants at $(( $(date +%s) - start )) s"; grep "^decode\|splits" "$OUT/variants.txt" | sed 's/KernelConfig.*//'
VS_TIMEOUT=${VS_TIMEOUT:-200} bash scripts/gpu_vs_flashmla.sh "$SRC" /nonexistent vs
echo "vs at $(( $(date +%s) - start )) s"
