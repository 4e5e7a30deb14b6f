#!/usr/bin/env bash
# The CUDA checks of issue 19, in one call on the GPU machine (no Rust there):
# made by tools/gpu/bundle.sh here, carried there as target/gpu-bundle, run as
#   bash target/gpu-bundle/check.sh [SECONDS]
# Every step has its own timeout and writes its log under $OUT (or
# target/gpu-out); a step that fails is recorded and the next one runs. The
# whole script keeps within SECONDS (default 480), leaving device time for a
# rerun. Summary: $OUT/summary.txt.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$HERE/../gpu-out}"
mkdir -p "$OUT"
BUDGET="${1:-480}"
START=$(date +%s)
# CUDA 13 and cuDNN 9.14 for memfit only: PyTorch there brings its own cuDNN
# and refuses the system one (../shared/gpu/FACTS.md).
MEMFIT_LD="/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# step NAME LIMIT CMD...: runs CMD with memfit's libraries, at most LIMIT
# seconds (or what is left of the budget), log in $OUT/NAME.log.
step() {
  local name="$1" limit="$2"; shift 2
  local l; l=$(left)
  if [ "$l" -le 5 ]; then echo "$name: not run (budget spent)" >> "$SUMMARY"; return; fi
  [ "$limit" -gt "$l" ] && limit="$l"
  local t0=$(date +%s)
  LD_LIBRARY_PATH="$MEMFIT_LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - t0 )) s (limit $limit)" | tee -a "$SUMMARY"
  tail -n 3 "$OUT/$name.log" | sed 's/^/    /' >> "$SUMMARY"
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
B="$HERE/memfit"
step probe 60 "$HERE/cuda_probe" --nocapture
step plan 60 "$HERE/cuda_plan" --nocapture
MEMFIT_REQUIRE_NVRTC=1 step kernels 120 "$HERE/cuda_kernels" --nocapture
step vs_cpu 240 "$HERE/cuda_vs_cpu" --nocapture --test-threads=1
# The binary on the GPU: a tiny step, ResNet-50 fp32 at batch 64 (peak and
# prediction), a short training run on the embedded digits.
step bench_tiny 60 "$B" bench step --device cuda --model resnet18 --base-width 8 --image-size 32 --batch-size 8 --steps 2 --warmup 1
step bench_r50_b64 120 "$B" bench step --device cuda --model resnet50 --image-size 224 --batch-size 64 --steps 5 --warmup 2
# One read from the device per optimizer step (backend::StepTotals).
grep -h "reads from the device per timed step" "$OUT"/bench_*.log >> "$SUMMARY" 2>/dev/null
step train_digits 120 "$B" train --device cuda --epochs 2 --metrics-jsonl "$OUT/digits.jsonl"
# Side by side with PyTorch, if time is left (python3 there has torch); it
# runs bench max-batch under 3.5 GiB too (predictions, minutes of one CPU
# core, in the background).
if [ -f "$HERE/gpu_vs_torch.py" ] && [ "$(left)" -gt 120 ]; then
  l=$(( $(left) - 10 ))
  timeout "$l" python3 "$HERE/gpu_vs_torch.py" --memfit "$B" --device cuda --rounds 1 --out "$OUT/vs_torch" \
    > "$OUT/vs_torch.log" 2>&1
  echo "vs_torch: rc=$? (limit $l)" | tee -a "$SUMMARY"
fi
echo "total $(( $(date +%s) - START )) s" | tee -a "$SUMMARY"
