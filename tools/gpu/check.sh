#!/usr/bin/env bash
# The CUDA checks of issue 19, in one call on the GPU machine (no Rust there):
# made by tools/gpu/bundle.sh here, carried there as target/gpu-bundle, run as
#   bash target/gpu-bundle/check.sh [SECONDS]
# Every step has its own timeout and writes its log; a step that fails is
# recorded and the next one runs. The whole script keeps within SECONDS
# (default 360, so one call leaves device time for a fix and a second call).
# The device tool brings back at most 8 files from $OUT, so $OUT holds only
# summary.txt, logs.tar.gz (every step's log, nvidia-smi, digits.jsonl,
# vs_torch/raw.jsonl; repacked after each step) and vs_torch_table.md. The
# summary is also printed last, for the reply's output tail.
#   bash check.sh --self-test
# checks the summary's parsers on canned libtest output (no GPU; .ci/run).
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"

# ---------------------------------------------------------------------------
# Parsers of a test binary's log (libtest's output), used by the summary.

# The names in a log's `failures:` list (the block of 4-space-indented
# names just before `test result:`). Not a grep for "FAILED": with
# --nocapture a test's own output lands between "test NAME ..." and its
# verdict, so that line is split and the name is lost. Without
# --nocapture libtest prints a first `failures:` header followed by a
# blank line and the captured outputs; that block holds no names.
failed_names() {
  awk '
    /^failures:$/ { inlist = 1; next }
    inlist && /^    [^ ]/ { sub(/^    /, ""); print; next }
    { inlist = 0 }
  ' "$1" | sort -u
}

# What a test binary's log says: every `test result:` line (the counts,
# pass or fail), the failed names, and, when the binary died before its
# result line (a crash, a timeout), the last test it started.
test_report() {
  local log="$1" results
  results=$(grep -o "test result: .*" "$log" | cut -c1-200)
  if [ -n "$results" ]; then
    echo "$results"
  else
    echo "no test result line (the binary died or was stopped)"
    local last
    last=$(grep -o "^test [^ ]* \.\.\. " "$log" | tail -n 1 | sed 's/^test //; s/ \.\.\. $//')
    [ -n "$last" ] && echo "last test started: $last"
  fi
  local names
  names=$(failed_names "$log")
  [ -n "$names" ] && echo "failed: $(echo "$names" | tr '\n' ' ' | sed 's/ $//')"
  return 0
}

# The tests to re-run alone after a failed binary: the failures list, or,
# when the binary died before printing one, the test it was running.
rerun_names() {
  local names
  names=$(failed_names "$1")
  if [ -z "$names" ] && ! grep -q "test result: " "$1"; then
    names=$(grep -o "^test [^ ]* \.\.\. " "$1" | tail -n 1 | sed 's/^test //; s/ \.\.\. $//')
  fi
  [ -n "$names" ] && echo "$names"
  return 0
}

self_test() {
  local d; d=$(mktemp -d "${TMPDIR:-/tmp}/memfit-check-self-test.XXXXXX")
  # --nocapture output: a test's own lines split "test ... FAILED", two
  # failures, a pass, the list block and the result line.
  cat > "$d/nocapture.log" <<'EOF'

running 4 tests
test round_trip_through_device_memory ... ok
test pools_match_the_cpu ... probe: cuda:0 NVIDIA H200
thread 'pools_match_the_cpu' panicked at tests/cuda_vs_cpu.rs:250:9:
maxpool[3]: gpu 1 cpu 2
FAILED
test linear_matches_the_cpu ... ok
test whole_step_matches_the_cpu ... step 1
FAILED

failures:
    pools_match_the_cpu
    whole_step_matches_the_cpu

test result: FAILED. 2 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 3.21s

EOF
  # Captured output: the first `failures:` block holds outputs, not names.
  cat > "$d/captured.log" <<'EOF'
running 2 tests
test a ... ok
test b ... FAILED

failures:

---- b stdout ----
thread 'b' panicked at x.rs:1:1:
    not a name: indented panic text
failures:

failures:
    b

test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s
EOF
  # A crash: no result line, the last test started is named.
  cat > "$d/crash.log" <<'EOF'
running 3 tests
test a ... ok
test conv_forward ... Segmentation fault (core dumped)
EOF
  cat > "$d/pass.log" <<'EOF'
running 1 test
test a ... ok

test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s
EOF
  local got want rc=0
  got=$(for f in nocapture captured crash pass; do
    echo "== $f"; test_report "$d/$f.log"; echo "-- rerun"; rerun_names "$d/$f.log"
  done)
  want=$(cat <<'EOF'
== nocapture
test result: FAILED. 2 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 3.21s
failed: pools_match_the_cpu whole_step_matches_the_cpu
-- rerun
pools_match_the_cpu
whole_step_matches_the_cpu
== captured
test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s
failed: b
-- rerun
b
== crash
no test result line (the binary died or was stopped)
last test started: conv_forward
-- rerun
conv_forward
== pass
test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s
-- rerun
EOF
)
  if [ "$got" != "$want" ]; then
    echo "check.sh --self-test: summary parsers disagree with the expected output"
    diff <(echo "$want") <(echo "$got")
    rc=1
  else
    echo "check.sh --self-test: ok"
  fi
  rm -rf "$d"
  return "$rc"
}

if [ "${1:-}" = "--self-test" ]; then
  self_test
  exit $?
fi

# ---------------------------------------------------------------------------
# The checks.

OUT="${OUT:-$HERE/../gpu-out}"
mkdir -p "$OUT"
BUDGET="${1:-360}"
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
# The test binaries run the memfit binary of the bundle: the path cargo
# compiled into them does not exist on the GPU machine.
B="$HERE/memfit"
export MEMFIT_BIN="$B"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
pack() { tar czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null; }

# run_logged LOG LIMIT CMD...: CMD with memfit's libraries, at most LIMIT
# seconds, output in LOG; prints its rc.
run_logged() {
  local log="$1" limit="$2"; shift 2
  LD_LIBRARY_PATH="$MEMFIT_LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout -k 5 "$limit" "$@" > "$log" 2>&1
  echo $?
}

# step NAME LIMIT CMD...: runs CMD, at most LIMIT seconds (or what is left
# of the budget), log in $LOGS/NAME.log; its rc in LAST_RC. A test step
# (TEST=1) adds the test binary's counts and failed names to the summary.
step() {
  local name="$1" limit="$2"; shift 2
  local l; l=$(left)
  if [ "$l" -le 5 ]; then echo "$name: not run (budget spent)" | tee -a "$SUMMARY"; LAST_RC=skipped; return; fi
  [ "$limit" -gt "$l" ] && limit="$l"
  local t0; t0=$(date +%s)
  local log="$LOGS/$name.log"
  LAST_RC=$(run_logged "$log" "$limit" "$@")
  local note=""
  { [ "$LAST_RC" = 124 ] || [ "$LAST_RC" = 137 ]; } && note=" TIMED OUT"
  echo "$name: rc=$LAST_RC$note in $(( $(date +%s) - t0 )) s (limit $limit)" | tee -a "$SUMMARY"
  {
    # A test that finds no usable GPU passes with a skip line: say so, or a
    # GPU that was never reached would read as a pass.
    local skips; skips=$(grep -c "skipped: no CUDA device" "$log")
    [ "$skips" -gt 0 ] && echo "    WARNING: $skips test(s) skipped: no CUDA device"
    grep -m 1 "^probe: " "$log" | cut -c1-300 | sed 's/^/    /'
    [ "${TEST:-0}" = 1 ] && test_report "$log" | sed 's/^/    /'
    local why=""
    [ "$LAST_RC" != 0 ] && why=$(grep -m 2 -A 1 -E "panicked at|^error" "$log" | grep -v '^--$' | cut -c1-300)
    # The reason of a failure, else the figures (img/s, peaks, epochs,
    # device), else (not for a test binary: its counts are above) the
    # last lines.
    [ -z "$why" ] && why=$(grep -E "^(median |tracked peak: |predicted peak |epoch [0-9]+: |device: )" "$log" \
      | tail -n 6 | cut -c1-300)
    if [ -n "$why" ]; then echo "$why"; elif [ "${TEST:-0}" != 1 ]; then grep -v '^[[:space:]]*$' "$log" | tail -n 3 | cut -c1-300; fi \
      | sed 's/^/    /'
  } >> "$SUMMARY"
  pack
}

# test_step NAME LIMIT BIN ARGS...: a test binary under
# CUDA_LAUNCH_BLOCKING=1 (a device fault is reported by the launch that
# caused it, not by a later call of another test); when it fails, each
# failed test (or the one it died in) runs again alone in its own process,
# so a fault that poisoned the shared context is not blamed on the tests
# after it. At most 6 reruns of 40 s each, within the budget.
test_step() {
  local name="$1" limit="$2" bin="$3"; shift 3
  # shellcheck disable=SC2097,SC2098
  CUDA_LAUNCH_BLOCKING=1 TEST=1 step "$name" "$limit" "$bin" "$@"
  [ "$LAST_RC" = 0 ] || [ "$LAST_RC" = skipped ] && return
  # A step that ran one test alone already has nothing to re-run.
  [[ " $* " == *" --exact "* ]] && return
  local rc=$LAST_RC n=0 t
  while read -r t; do
    [ -z "$t" ] && continue
    n=$((n + 1))
    [ "$n" -gt 6 ] && { echo "    alone: further reruns left out" >> "$SUMMARY"; break; }
    local l; l=$(left)
    [ "$l" -le 10 ] && { echo "    alone: $t not rerun (budget spent)" >> "$SUMMARY"; continue; }
    local lim=40; [ "$lim" -gt "$l" ] && lim="$l"
    local log="$LOGS/$name.alone.$n.log" r
    # Not the step's own arguments: libtest refuses an option given twice.
    r=$(CUDA_LAUNCH_BLOCKING=1 run_logged "$log" "$lim" "$bin" --exact "$t" --test-threads 1 --nocapture)
    if [ "$r" = 0 ] && grep -q "test result: ok. 1 passed" "$log"; then
      echo "    alone: $t passed (so it failed beside the others)" >> "$SUMMARY"
    else
      local why; why=$(grep -m 1 -A 1 "panicked at" "$log" | tail -n 1)
      [ -z "$why" ] && why=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1)
      echo "    alone: $t FAILED rc=$r: $(echo "$why" | cut -c1-150)" >> "$SUMMARY"
    fi
  done < <(rerun_names "$LOGS/$name.log")
  LAST_RC=$rc
  pack
}

echo "memfit GPU checks, budget $BUDGET s, logs in $OUT/logs.tar.gz" | tee -a "$SUMMARY"
timeout 30 nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1
head -n 12 "$LOGS/nvidia-smi.txt" | grep -E "Driver Version|H100|H200|NVIDIA" | head -n 3 | sed 's/^/    /' >> "$SUMMARY"
# The step limits add up to the default budget; a step that ends early
# leaves its time to the later ones (and the reruns).
# The upload/download round trip first: if device memory cannot be
# written and read back, nothing after it means anything.
MEMFIT_REQUIRE_GPU=1 test_step round_trip 20 "$HERE/cuda_vs_cpu" --exact round_trip_through_device_memory --nocapture --test-threads=1
# Device pages mapped and given back: the card's memory in use follows
# the pool's reserved count.
MEMFIT_REQUIRE_GPU=1 test_step memory 15 "$HERE/cuda_memory" --nocapture
test_step probe 25 "$HERE/cuda_probe" --nocapture
test_step plan 40 "$HERE/cuda_plan" --nocapture
MEMFIT_REQUIRE_NVRTC=1 test_step kernels 45 "$HERE/cuda_kernels" --nocapture
MEMFIT_REQUIRE_GPU=1 test_step vs_cpu 85 "$HERE/cuda_vs_cpu" --nocapture --test-threads=1 --skip round_trip_through_device_memory
# The binary on the GPU: a tiny step, ResNet-50 fp32 at batch 64 (peak and
# prediction; with --profile: host time per op family and the cuDNN
# algorithm and workspace per convolution geometry), a short training run
# on the embedded digits.
step bench_tiny 25 "$B" bench step --device cuda --model resnet18 --base-width 8 --image-size 32 --batch-size 8 --steps 2 --warmup 1 --profile
step bench_r50_b64 60 "$B" bench step --device cuda --model resnet50 --image-size 224 --batch-size 64 --steps 5 --warmup 2 --profile
R50_RC=$LAST_RC
# One read from the device per optimizer step (backend::StepTotals).
grep -h "reads from the device per timed step" "$LOGS"/bench_*.log 2>/dev/null | sed 's/^/    /' >> "$SUMMARY"
# Host time per op family (launch overhead), and cuDNN's algorithm and
# workspace per ResNet-50 convolution geometry.
if [ -f "$LOGS/bench_r50_b64.log" ]; then
  grep -E "^\| " "$LOGS/bench_r50_b64.log" | cut -c1-200 | sed 's/^/    /' >> "$SUMMARY"
  grep -E "^cudnn conv " "$LOGS/bench_r50_b64.log" | cut -c1-300 | sed 's/^/    /' >> "$SUMMARY"
fi
step train_digits 45 "$B" train --device cuda --epochs 2 --metrics-jsonl "$LOGS/digits.jsonl"
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
