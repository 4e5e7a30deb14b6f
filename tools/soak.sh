#!/usr/bin/env bash
# Soak test of "never lose a training run" (run by hand; not part of cargo
# test). Trains a tiny ResNet-18 with accumulation, f16 + loss scaler and
# frequent checkpoints twice:
#   1. uninterrupted: the reference;
#   2. killed with SIGKILL at random (seeded) times, resumed with --resume
#      each time, until it finishes;
# then checks that both final weight files are byte-identical (cmp), that
# the tracked peak (metrics peak_bytes) is constant after warm-up, and that
# the process RSS (sampled from /proc/PID/status) does not grow between the
# first and the last quarter of the reference run.
#
# Usage: tools/soak.sh [STEPS] [KILLS] [SEED]   (defaults 3000 15 7)
# Env:   SOAK_DIR (work folder, default a fresh mktemp -d), RSS_TOL_PCT (5)
set -euo pipefail

STEPS=${1:-3000}
KILLS=${2:-15}
SEED=${3:-7}
RSS_TOL_PCT=${RSS_TOL_PCT:-5}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${SOAK_DIR:-$(mktemp -d /tmp/memfit-soak.XXXXXX)}
mkdir -p "$WORK"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}

echo "== building release"
(cd "$ROOT" && cargo build --release --quiet)
BIN=$CARGO_TARGET_DIR/release/memfit

FLAGS=(--threads 2 train --model resnet18 --base-width 8 --image-size 16
  --data synthetic --train-size 512 --val-size 64 --classes 6
  --batch-size 16 --micro-batch 4 --precision f16 --scaler-init 1024
  --scaler-growth-interval 50 --steps "$STEPS" --eval-every 20
  --save-every-steps 25 --keep-checkpoints 2 --seed 1)

# Samples VmRSS (kB) of PID every 0.1 s into FILE until it exits.
sample_rss() {
  local pid=$1 file=$2
  while kill -0 "$pid" 2>/dev/null; do
    awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null >>"$file" || true
    sleep 0.1
  done
}

echo "== reference run ($STEPS optimizer steps) in $WORK"
rm -rf "$WORK/ref" && mkdir -p "$WORK/ref"
t0=$(date +%s.%N)
"$BIN" "${FLAGS[@]}" --save-dir "$WORK/ref/ckpt" --metrics-jsonl "$WORK/ref/metrics.jsonl" \
  --save-weights "$WORK/ref/final.safetensors" >"$WORK/ref/stdout" 2>"$WORK/ref/stderr" &
ref_pid=$!
sample_rss "$ref_pid" "$WORK/ref/rss_kb" &
wait "$ref_pid"
wait
ref_secs=$(echo "$(date +%s.%N) - $t0" | bc)
echo "reference: $(printf %.1f "$ref_secs") s"

echo "== killed run: $KILLS SIGKILLs at seeded random times (seed $SEED)"
rm -rf "$WORK/kill" && mkdir -p "$WORK/kill"
RANDOM=$SEED
# Kill delays spread over the run: uniform in [0.3 s, 2 * ref / kills].
max_ms=$(echo "2000 * $ref_secs / $KILLS" | bc)
kills=0 runs=0 stray=0
while true; do
  runs=$((runs + 1))
  resume=()
  if ls "$WORK/kill/ckpt"/ckpt-*.safetensors >/dev/null 2>&1; then
    resume=(--resume "$WORK/kill/ckpt")
  fi
  "$BIN" "${FLAGS[@]}" --save-dir "$WORK/kill/ckpt" "${resume[@]}" \
    --save-weights "$WORK/kill/final.safetensors" >>"$WORK/kill/stdout" 2>>"$WORK/kill/stderr" &
  pid=$!
  if [ "$kills" -lt "$KILLS" ]; then
    delay_ms=$((300 + (RANDOM * 32768 + RANDOM) % (max_ms > 300 ? max_ms - 300 : 1)))
    sleep "$(echo "scale=3; $delay_ms / 1000" | bc)"
    if kill -9 "$pid" 2>/dev/null; then
      wait "$pid" 2>/dev/null || true
      kills=$((kills + 1))
      last=$(ls "$WORK/kill/ckpt" 2>/dev/null | grep -c '^ckpt-' || true)
      echo "  kill $kills after ${delay_ms} ms (checkpoints on disk: $last, newest: $(ls "$WORK/kill/ckpt" 2>/dev/null | grep '^ckpt-' | tail -1))"
      continue
    fi
  fi
  if wait "$pid"; then
    break
  else
    echo "run $runs failed (exit $?); see $WORK/kill/stderr" >&2
    exit 1
  fi
done
stray=$(find "$WORK/kill/ckpt" -name '.*.tmp' | wc -l)
echo "killed run finished after $kills kills, $runs runs ($stray temporary files left by killed writes)"

echo "== results"
status=0
if cmp "$WORK/ref/final.safetensors" "$WORK/kill/final.safetensors"; then
  echo "final weights: IDENTICAL ($(stat -c %s "$WORK/ref/final.safetensors") bytes, cmp)"
else
  echo "final weights: DIFFER"
  status=1
fi

# Tracked peak per step from the metrics (step lines only), after warm-up
# (the first 2 steps allocate the optimizer state).
read -r pmin pmax nsteps < <(grep '^{"step"' "$WORK/ref/metrics.jsonl" | awk -F'"peak_bytes":' '
  { split($2, a, ","); s = $0; sub(/^\{"step":/, "", s); st = s + 0
    if (st > 2) { v = a[1] + 0; if (n == 0 || v < lo) lo = v; if (v > hi) hi = v; n++ } }
  END { print lo, hi, n }')
if [ "$pmin" = "$pmax" ]; then
  echo "tracked peak: constant $pmax bytes over $nsteps steps after warm-up"
else
  echo "tracked peak: NOT constant ($pmin .. $pmax bytes)"
  status=1
fi

# RSS: median of the first and the last quarter of the samples.
n=$(wc -l <"$WORK/ref/rss_kb")
q=$((n / 4))
median() { sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }
first=$(head -n "$q" "$WORK/ref/rss_kb" | median)
lastq=$(tail -n "$q" "$WORK/ref/rss_kb" | median)
maxr=$(sort -n "$WORK/ref/rss_kb" | tail -1)
growth=$(echo "scale=2; 100 * ($lastq - $first) / $first" | bc)
echo "RSS: $n samples; first-quarter median $first kB, last-quarter median $lastq kB (${growth}%), max $maxr kB"
if [ "$(echo "$growth > $RSS_TOL_PCT" | bc)" = 1 ]; then
  echo "RSS grew more than ${RSS_TOL_PCT}%"
  status=1
fi
scale_line=$(grep '^{"step"' "$WORK/ref/metrics.jsonl" | tail -1 | grep -o '"scale":[^,]*' || true)
skipped=$(grep -c '"skipped":true' "$WORK/ref/metrics.jsonl" || true)
echo "f16 scaler at the end: $scale_line; steps skipped by the scaler: $skipped"
echo "reference $(printf %.1f "$ref_secs") s for $STEPS steps; work folder $WORK"
[ "$status" = 0 ] && echo "SOAK PASSED" || echo "SOAK FAILED"
exit "$status"
