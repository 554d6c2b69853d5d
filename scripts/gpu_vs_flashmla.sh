#!/usr/bin/env bash
# One GPU call of the attention work (issue 9): get FlashMLA, then run the steps named.
#
#   bash scripts/gpu_vs_flashmla.sh FLASHMLA_SRC SAVED STEP...
#
# FLASHMLA_SRC: the FlashMLA bundle (with build.sh), used when SAVED holds no earlier build.
# SAVED: a folder with flash_mla.tgz.part* from an earlier call (the built package, split to fit
#   the device tool's 16 MiB per file); unpacked into /tmp/fm. Without it, FlashMLA is built in the
#   background (MAX_JOBS=16) while the steps that need no FlashMLA run, and the built package
#   is split into $OUT/flash_mla.tgz.part* for later calls; a later call on the same (still warm)
#   machine waits for that build instead of starting another.
# Steps: pytest (PYTEST_ARGS) | tests (EXTRA_TESTS: more test files) | tests2 (the attention suites again with KernelConfig
#   fields KCFG="field=value,..." in every dispatch) | sweep (scripts/attn_variants.py) | quick (its --quick) |
#   prefill (its --prefill, PREFILL_ARGS=--bf16: bf16 pages only) | report | host (eager host time per call,
#   scripts/host_overhead.py) | vs (the side-by-side table; VS_ARGS: more options, e.g. --back-to-back) |
#   vs2 (it again with KCFG) | vsold (it again with the kernel files in OLD_KERNELS swapped in for the
#   step: a folder of dsv4attn/kernels/*.py from another commit, e.g. filled with `git show REV:path`,
#   so two versions are timed on one machine) | vssweep (both libraries' decode over 4-32 chunks,
#   fitted as fixed + per chunk) | psweep (scripts/prefill_sweep.py at h64, both libraries fitted as a CTA's
#   fixed cost + per chunk; with KCFG set, again with those KernelConfig fields) -- each logs to $OUT/<step>.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1
SRC="$1"; SAVED="$2"; shift 2
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
FM=/tmp/fm
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/smi.txt"
building=0
if ls "$SAVED"/flash_mla.tgz.part* >/dev/null 2>&1; then
  mkdir -p $FM && cat "$SAVED"/flash_mla.tgz.part* | tar xz -C $FM && echo "FlashMLA from $SAVED" | tee -a "$OUT/smi.txt"
elif [[ -f /tmp/flashmla_build.log ]]; then
  echo "FlashMLA: the build an earlier call started on this machine" | tee -a "$OUT/smi.txt"
  building=1
else
  MAX_JOBS=16 FLASHMLA_BUILD_DIR=/tmp/flashmla_build BG=1 bash "$SRC/build.sh"
  building=1
fi
wait_build() {
  if [[ $building == 1 ]]; then
    while [[ ! -f /tmp/flashmla_build.done && ! -f /tmp/flashmla_build.failed ]]; do sleep 5; done
    tail -n 5 /tmp/flashmla_build.log > "$OUT/build_tail.txt"
    if [[ -f /tmp/flashmla_build.done ]]; then
      (cd /tmp/flashmla_build && tar czf /tmp/fm.tgz flash_mla/*.py flash_mla/*.so)
      mkdir -p $FM && tar xzf /tmp/fm.tgz -C $FM
      split -b 15m /tmp/fm.tgz "$OUT/flash_mla.tgz.part"
    else
      cp /tmp/flashmla_build.log "$OUT/build_log.txt"
    fi
    building=0
  fi
}
for step in "$@"; do
  case $step in
    tests) xd=""; python3 -c "import xdist" 2>/dev/null && xd="-n 8"
           timeout "${TESTS_TIMEOUT:-360}" python3 -m pytest -q $xd -p no:cacheprovider tests/test_sparse_attn*.py \
             tests/test_flashmla_compat.py ${EXTRA_TESTS:-} 2>&1 | tail -n 40 > "$OUT/tests.txt"; tail -n 3 "$OUT/tests.txt" ;;
    sweep) timeout 300 python3 -m scripts.attn_variants > "$OUT/sweep.txt" 2>&1; grep -v "^  *[0-9]" "$OUT/sweep.txt" | head -80 ;;
    tests2) # the same suites with KernelConfig fields overridden in every dispatch (tests/conftest.py)
           xd=""; python3 -c "import xdist" 2>/dev/null && xd="-n 8"
           DSV4ATTN_TEST_KERNEL_CONFIG="$KCFG" timeout "${TESTS_TIMEOUT:-360}" python3 -m pytest -q $xd -p no:cacheprovider \
             tests/test_sparse_attn*.py tests/test_flashmla_compat.py 2>&1 | tail -n 40 > "$OUT/tests2.txt"
           echo "with $KCFG:"; tail -n 3 "$OUT/tests2.txt" ;;
    pytest) # PYTEST_ARGS: what to run first (e.g. a new kernel's tests, under its own timeout)
           timeout "${PYTEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider $PYTEST_ARGS 2>&1 | tail -n 30 \
             > "$OUT/pytest.txt"; tail -n 3 "$OUT/pytest.txt" ;;
    quick) timeout "${QUICK_TIMEOUT:-150}" python3 -m scripts.attn_variants --quick > "$OUT/quick.txt" 2>&1; grep -v "^  *[0-9]" "$OUT/quick.txt" | head -40 ;;
    prefill) timeout 200 python3 -m scripts.attn_variants --prefill ${PREFILL_ARGS:-} > "$OUT/prefill.txt" 2>&1; cat "$OUT/prefill.txt" ;;
    report) python3 -m scripts.sm90_report --quick > "$OUT/report.txt" 2>&1 ;;
    host) timeout 120 python3 -m scripts.host_overhead --device cuda 2>&1 | tee "$OUT/host.txt" ;;
    vs) wait_build; timeout "${VS_TIMEOUT:-400}" python3 -m benchmarks.bench_vs_flashmla --flashmla-path $FM --graphs ${VS_ONLY:+--only "$VS_ONLY"} ${VS_ARGS:-} \
          --json "$OUT/vs.json" 2>&1 | tee "$OUT/vs.txt" | grep -v "^  " | tail -n 24 ;;
    vs2) # the side by side again with KernelConfig fields KCFG in every dispatch (a candidate default)
        wait_build; timeout "${VS_TIMEOUT:-400}" python3 -m benchmarks.bench_vs_flashmla --flashmla-path $FM --graphs \
          ${VS_ONLY:+--only "$VS_ONLY"} --kernel-config "$KCFG" --json "$OUT/vs2.json" 2>&1 | tee "$OUT/vs2.txt" \
          | grep -v "^  " | tail -n 24 ;;
    vsold) # the side by side with OLD_KERNELS' files in place of the working tree's, then restored
        wait_build; mkdir -p /tmp/kernels_now && cp dsv4attn/kernels/*.py /tmp/kernels_now/
        cp "$OLD_KERNELS"/*.py dsv4attn/kernels/
        timeout "${VS_TIMEOUT:-400}" python3 -m benchmarks.bench_vs_flashmla --flashmla-path $FM --graphs \
          ${VS_ONLY:+--only "$VS_ONLY"} ${VS_ARGS:-} --json "$OUT/vsold.json" 2>&1 | tee "$OUT/vsold.txt" \
          | grep -v "^  " | tail -n 24
        cp /tmp/kernels_now/*.py dsv4attn/kernels/ ;;
    vssweep) # both libraries' decode at B=1024 over 4-32 chunks, each fitted as fixed + per chunk
        wait_build; timeout "${VS_TIMEOUT:-400}" python3 -m benchmarks.bench_vs_flashmla --flashmla-path $FM --graphs \
          --decode-sweep --json "$OUT/vssweep.json" 2>&1 | tee "$OUT/vssweep.txt" | grep "^fit\|^decode sweep" ;;
    psweep) wait_build; timeout "${PSWEEP_TIMEOUT:-240}" python3 -m scripts.prefill_sweep --flashmla-path $FM --heads 64 \
          > "$OUT/psweep.txt" 2>&1
        if [[ -n "${KCFG:-}" ]]; then
          timeout "${PSWEEP_TIMEOUT:-240}" python3 -m scripts.prefill_sweep --flashmla-path $FM --heads 64 \
            --label "dsv4attn $KCFG" --kernel-config "$KCFG" >> "$OUT/psweep.txt" 2>&1
        fi
        grep "per CTA" "$OUT/psweep.txt" ;;
    *) echo "unknown step $step" ;;
  esac
done
wait_build
