#!/usr/bin/env bash
# The CUDA checks of issue 19, in one call on the GPU machine (no Rust there):
# made by tools/gpu/bundle.sh here, carried there as target/gpu-bundle, run as
#   bash target/gpu-bundle/check.sh [SECONDS]
# Every step has its own timeout and writes its log; a step that fails is
# recorded and the next one runs. The whole script keeps within SECONDS
# (default 480), leaving device time for a rerun.
# The device tool brings back at most 8 files from $OUT, so $OUT holds only
# summary.txt, logs.tar.gz (every step's log, nvidia-smi, digits.jsonl,
# vs_torch/raw.jsonl; repacked after each step) and vs_torch_table.md. The
# summary is also printed last, for the reply's output tail.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$HERE/../gpu-out}"
mkdir -p "$OUT"
BUDGET="${1:-480}"
START=$(date +%s)
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/memfit-gpu-logs.XXXXXX")"
# CUDA 13 and cuDNN 9.14 for memfit only: PyTorch there brings its own cuDNN
# and refuses the system one (../shared/gpu/FACTS.md).
MEMFIT_LD="/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
LAST_RC=
# Panics print a backtrace with function names (the binaries keep their
# symbols); library backtraces (anyhow) stay off: capturing them costs time.
export RUST_BACKTRACE=1 RUST_LIB_BACKTRACE=0

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
pack() { tar czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null; }

# step NAME LIMIT CMD...: runs CMD with memfit's libraries, at most LIMIT
# seconds (or what is left of the budget), log in $LOGS/NAME.log; its rc in
# LAST_RC.
step() {
  local name="$1" limit="$2"; shift 2
  local l; l=$(left)
  if [ "$l" -le 5 ]; then echo "$name: not run (budget spent)" | tee -a "$SUMMARY"; LAST_RC=skipped; return; fi
  [ "$limit" -gt "$l" ] && limit="$l"
  local t0; t0=$(date +%s)
  local log="$LOGS/$name.log"
  LD_LIBRARY_PATH="$MEMFIT_LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout -k 5 "$limit" "$@" > "$log" 2>&1
  LAST_RC=$?
  local note=""
  [ "$LAST_RC" = 124 ] || [ "$LAST_RC" = 137 ] && note=" TIMED OUT"
  echo "$name: rc=$LAST_RC$note in $(( $(date +%s) - t0 )) s (limit $limit)" | tee -a "$SUMMARY"
  {
    # A test that finds no usable GPU passes with a skip line: say so, or a
    # GPU that was never reached would read as a pass.
    local skips; skips=$(grep -c "skipped: no CUDA device" "$log")
    [ "$skips" -gt 0 ] && echo "    WARNING: $skips test(s) skipped: no CUDA device"
    grep -m 1 "^probe: " "$log" | cut -c1-300 | sed 's/^/    /'
    local why=""
    if [ "$LAST_RC" != 0 ]; then
      why=$(grep -m 2 -A 1 -E "panicked at|^error" "$log" | grep -v '^--$' | cut -c1-300)
      grep -E "^test .* FAILED$" "$log" | head -n 20 | sed 's/^/    /'
    fi
    # The reason of a failure, else the figures (img/s, peaks, epochs, a test
    # binary's result), else the last lines.
    [ -z "$why" ] && why=$(grep -E "^(median |tracked peak: |predicted peak |epoch [0-9]+: |test result: |device: )" "$log" \
      | tail -n 6 | cut -c1-300)
    if [ -n "$why" ]; then echo "$why"; else grep -v '^[[:space:]]*$' "$log" | tail -n 3 | cut -c1-300; fi \
      | sed 's/^/    /'
  } >> "$SUMMARY"
  pack
}

echo "memfit GPU checks, budget $BUDGET s, logs in $OUT/logs.tar.gz" | tee -a "$SUMMARY"
timeout 30 nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1
head -n 12 "$LOGS/nvidia-smi.txt" | grep -E "Driver Version|H100|H200|NVIDIA" | head -n 3 | sed 's/^/    /' >> "$SUMMARY"
B="$HERE/memfit"
step probe 60 "$HERE/cuda_probe" --nocapture
step plan 60 "$HERE/cuda_plan" --nocapture
MEMFIT_REQUIRE_NVRTC=1 step kernels 120 "$HERE/cuda_kernels" --nocapture
MEMFIT_REQUIRE_GPU=1 step vs_cpu 240 "$HERE/cuda_vs_cpu" --nocapture --test-threads=1
# The binary on the GPU: a tiny step, ResNet-50 fp32 at batch 64 (peak and
# prediction), a short training run on the embedded digits.
step bench_tiny 60 "$B" bench step --device cuda --model resnet18 --base-width 8 --image-size 32 --batch-size 8 --steps 2 --warmup 1
step bench_r50_b64 120 "$B" bench step --device cuda --model resnet50 --image-size 224 --batch-size 64 --steps 5 --warmup 2
R50_RC=$LAST_RC
# One read from the device per optimizer step (backend::StepTotals).
grep -h "reads from the device per timed step" "$LOGS"/bench_*.log 2>/dev/null | sed 's/^/    /' >> "$SUMMARY"
step train_digits 120 "$B" train --device cuda --epochs 2 --metrics-jsonl "$LOGS/digits.jsonl"
# Side by side with PyTorch, if time is left and memfit's own ResNet-50 step
# ran on the GPU (else every memfit run there fails too, and the time is
# better kept for a rerun); python3 there has torch. It runs bench max-batch
# under 3.5 GiB too (predictions, minutes of one CPU core, in the
# background). On SIGTERM it writes the sections done so far.
if [ ! -f "$HERE/gpu_vs_torch.py" ]; then
  echo "vs_torch: not run (no gpu_vs_torch.py in the bundle)" | tee -a "$SUMMARY"
elif [ "$R50_RC" != 0 ]; then
  echo "vs_torch: not run (bench_r50_b64 rc=$R50_RC)" | tee -a "$SUMMARY"
elif [ "$(left)" -le 120 ]; then
  echo "vs_torch: not run ($(left) s left)" | tee -a "$SUMMARY"
else
  l=$(( $(left) - 20 ))
  t0=$(date +%s)
  PYTHONUNBUFFERED=1 timeout -k 10 "$l" python3 "$HERE/gpu_vs_torch.py" --memfit "$B" --device cuda --rounds 1 \
    --timeout 90 --max-batch-timeout "$l" --out "$LOGS/vs_torch" > "$LOGS/vs_torch.log" 2>&1
  rc=$?
  echo "vs_torch: rc=$rc in $(( $(date +%s) - t0 )) s (limit $l)" | tee -a "$SUMMARY"
  { grep -m 3 -E "stopped by signal|crashed|failed under|Traceback" "$LOGS/vs_torch.log"; tail -n 1 "$LOGS/vs_torch.log"; } \
    | cut -c1-300 | sed 's/^/    /' >> "$SUMMARY"
  [ -f "$LOGS/vs_torch/table.md" ] && cp "$LOGS/vs_torch/table.md" "$OUT/vs_torch_table.md"
  pack
fi
echo "total $(( $(date +%s) - START )) s" | tee -a "$SUMMARY"
pack && rm -rf "$LOGS"
echo "===== summary.txt"
cat "$SUMMARY"
