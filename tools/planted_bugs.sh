#!/usr/bin/env bash
# Plants three kernel bugs, one at a time, and shows that the CUDA tests on
# the test CUDA library (tools/fakecuda.sh) fail on each: an off-by-one
# loop bound and a missing barrier (reduce.cu's sum of squares), and a wrong launch
# argument (gamma and beta swapped in ops.rs's bn_forward launch). Each
# file is restored with `git checkout` afterwards, so run it on a clean
# tree. Exits non-zero if any planted bug goes unnoticed.
# Usage: tools/planted_bugs.sh <NVRTC 13.0 lib dir>   (takes a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
nvrtc="${1:?usage: tools/planted_bugs.sh <NVRTC 13.0 lib dir>}"
if ! git diff --quiet -- src/backend/cuda; then
  echo "planted_bugs.sh: src/backend/cuda has uncommitted changes; commit or stash them first" >&2
  exit 2
fi
# Whatever ends this script (a failure, Ctrl-C, a killed CI step), the
# planted file goes back to HEAD's text: a bug left in the tree could be
# committed with the next change (it once was).
trap 'git checkout --quiet -- src/backend/cuda' EXIT
fake="$(tools/fakecuda.sh)"
missed=0
# name|file|exact text|replacement (\n: a line break; the text must occur once)
while IFS='|' read -r name file from to; do
  [ -n "$name" ] || continue
  python3 - "$file" "$from" "$to" <<'PY'
import sys
path, old, new = (a.replace("\\n", "\n") for a in sys.argv[1:])
s = open(path).read()
if s.count(old) != 1:
    sys.exit(f"{path}: expected the text {old!r} exactly once")
open(path, "w").write(s.replace(old, new))
PY
  echo "== planted: $name ($file: '$from' -> '$to')"
  set +e
  out="$(LD_LIBRARY_PATH="$fake:$nvrtc" MEMFIT_REQUIRE_GPU=1 cargo test --quiet --features cuda \
    --test cuda_vs_cpu --test cuda_train_cli --no-fail-fast 2>&1)"
  rc=$?
  set -e
  git checkout --quiet -- "$file"
  echo "$out" | grep -E "^test result:|^    [a-z_0-9]+$" | sort -u | sed 's/^/   /' || true
  echo "$out" | grep -E "panicked at|fault|Fault" | head -3 | cut -c1-300 | sed 's/^/   first: /' || true
  if [ "$rc" -eq 0 ]; then
    echo "   NOT CAUGHT: the tests passed with this bug"
    missed=1
  fi
done <<'BUGS'
off-by-one loop bound in sum_squares_partial|src/backend/cuda/kernels/reduce.cu|    for (long long i = start + threadIdx.x; i < end; i += SQ_THREADS) {|    for (long long i = start + threadIdx.x; i <= end; i += SQ_THREADS) {
missing barrier in sum_squares_partial's tree|src/backend/cuda/kernels/reduce.cu|        if (threadIdx.x < stride) lane[threadIdx.x] += lane[threadIdx.x + stride];\n        __syncthreads();|        if (threadIdx.x < stride) lane[threadIdx.x] += lane[threadIdx.x + stride];
gamma and beta swapped in the bn_forward launch|src/backend/cuda/ops.rs|        ptr(rstd),\n        ptr(gamma),\n        ptr(beta),\n        n64(rows),|        ptr(rstd),\n        ptr(beta),\n        ptr(gamma),\n        n64(rows),
BUGS
exit "$missed"
