#!/usr/bin/env bash
# Side-by-side training-step benchmark: memfit against PyTorch on identical
# ResNet-50 configurations, alternating process by process in one run so both
# see the same machine noise. Prints one Markdown table of medians and ratios.
#
#   tools/bench_vs_torch.sh [--reps N] [--install-torch] [--python PATH]
#                           [--out DIR] [--configs "fp32:224:16 fp32:128:32 bf16:224:16 bf16:128:32"]
#
# PyTorch side: ../shared/baselines/pytorch/resnet_mem.py (the measured
# baseline's own script: seeded random batch, SGD lr 0.1 momentum 0.9, 1
# warm-up + 3 timed steps, median), strategies `plain` (fp32) and `bf16`
# (CPU autocast). memfit side: `memfit bench step` with the same batch,
# resolution, warm-up and step count. Both use every core by default.
#
# --install-torch makes a throw-away venv (/tmp/memfit-torch-venv) and
# installs torch + torchvision from PyPI into it (about 5 GB) unless
# --python names an interpreter that already has them.
set -euo pipefail
cd "$(dirname "$0")/.."

reps=3
python=""
install=0
out=target/bench_vs_torch
configs="fp32:224:16 fp32:128:32 bf16:224:16 bf16:128:32"
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) reps="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --install-torch) install=1; shift ;;
    --out) out="$2"; shift 2 ;;
    --configs) configs="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

baseline=../shared/baselines/pytorch/resnet_mem.py
[ -f "$baseline" ] || { echo "missing $baseline" >&2; exit 1; }
if [ -z "$python" ]; then
  venv=/tmp/memfit-torch-venv
  if [ "$install" = 1 ] && [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch torchvision
  fi
  python="$venv/bin/python"
fi
"$python" -c "import torch, torchvision" 2>/dev/null || {
  echo "no torch for $python: pass --install-torch or --python PATH" >&2; exit 1; }

case " $configs" in
  *" bf16:"*)
    if ! grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null; then
      echo "note: this CPU has no AVX512-BF16: PyTorch's bf16 autocast runs on a slow fallback here (about a minute per ResNet-50 step at 128x128 batch 32 on a 2-core Zen 3), and memfit's bf16 GEMMs are f32 products of rounded operands" >&2
    fi ;;
esac

cargo build --release >&2
memfit=target/release/memfit
mkdir -p "$out"
raw="$out/raw.tsv"
: > "$raw"
echo "# torch $("$python" -c 'import torch; print(torch.__version__)'), memfit $(git rev-parse --short HEAD), $(nproc) cores, $(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | xargs)" | tee "$out/versions.txt" >&2

run_memfit() { # precision res batch
  "$memfit" bench step --model resnet50 --precision "$1" --image-size "$2" --batch-size "$3" \
    --warmup 1 --steps 3 2>/dev/null |
    awk '/s\/step/ {print $2} /tracked peak:/ {print $3, $4}' | paste -sd' '
}
run_torch() { # precision res batch
  local strat=plain; [ "$1" = bf16 ] && strat=bf16
  "$python" "$baseline" --strategy "$strat" --res "$2" --batch "$3" --steps 3 --warmup 1 \
    --tag side-by-side 2>/dev/null |
    "$python" -c 'import json,sys; r=json.loads(sys.stdin.readline()); print(r["s_per_step_median"], r["rss_growth_MB"], r["alloc_peak_step_MB"])'
}

for rep in $(seq 1 "$reps"); do
  for cfg in $configs; do
    IFS=: read -r prec res batch <<< "$cfg"
    m=$(run_memfit "$prec" "$res" "$batch")
    echo -e "$cfg\tmemfit\t$rep\t$m" | tee -a "$raw" >&2
    t=$(run_torch "$prec" "$res" "$batch")
    echo -e "$cfg\ttorch\t$rep\t$t" | tee -a "$raw" >&2
  done
done

python3 - "$raw" "$reps" <<'EOF' | tee "$out/table.md"
import statistics, sys
from collections import defaultdict
rows = defaultdict(lambda: defaultdict(list))
for line in open(sys.argv[1]):
    cfg, who, _rep, vals = line.rstrip("\n").split("\t")
    rows[cfg][who].append(vals.split())
print(f"| config | memfit s/step | PyTorch s/step | memfit img/s | PyTorch img/s | speed ratio (memfit/PyTorch img/s) | memfit tracked peak | PyTorch RSS growth / allocator peak + params·3 |")
print("|---|---|---|---|---|---|---|---|")
for cfg, by in rows.items():
    prec, res, batch = cfg.split(":")
    b = int(batch)
    ms = statistics.median(float(v[0]) for v in by["memfit"])
    ts = statistics.median(float(v[0]) for v in by["torch"])
    mpeak = by["memfit"][-1][1] + " " + by["memfit"][-1][2]
    rss = statistics.median(float(v[1]) for v in by["torch"])
    alloc = statistics.median(float(v[2]) for v in by["torch"])
    print(f"| {prec} {res}x{res} b{b} | {ms:.3f} | {ts:.3f} | {b/ms:.2f} | {b/ts:.2f} | **{ts/ms:.2f}x** | {mpeak} | {rss:.0f} MiB / {alloc + 292.5:.0f} MiB |")
print(f"\nMedians of {sys.argv[2]} alternating runs per side, each a fresh process timing 3 steps after 1 warm-up.")
EOF
