#!/usr/bin/env bash
# Builds what tools/gpu/check.sh runs on the GPU machine (which has no Rust)
# and puts it in target/gpu-bundle (ignored by git, under the 64 MiB a
# device call may carry): the memfit binary with --features cuda, the five
# CUDA test binaries, check.sh and the PyTorch side-by-side script. Not
# stripped: the symbols (about 4.5 MiB in all) give a panic's backtrace its
# function names on the GPU machine (check.sh sets RUST_BACKTRACE=1). Then,
# with the device tool:
#   run(command="bash target/gpu-bundle/check.sh 360", carry=["target/gpu-bundle"], timeout_s=420)
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=target/gpu-bundle
rm -rf "$DEST"; mkdir -p "$DEST"
cargo build --release --features cuda
# Where cargo put it: CARGO_TARGET_DIR when set, else target/.
cp "${CARGO_TARGET_DIR:-target}/release/memfit" "$DEST/"
TESTS=(cuda_vs_cpu cuda_probe cuda_plan cuda_kernels cuda_memory)
ARGS=(); for t in "${TESTS[@]}"; do ARGS+=(--test "$t"); done
# json-render-diagnostics: compile errors still reach the terminal.
cargo test --release --features cuda "${ARGS[@]}" --no-run --message-format=json-render-diagnostics \
  | python3 -c '
import json, shutil, sys
want = set(sys.argv[2:])
for m in map(json.loads, sys.stdin):
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"])
' "$DEST" "${TESTS[@]}"
cp tools/gpu/check.sh "$DEST/"
[ -f tools/gpu_vs_torch.py ] && cp tools/gpu_vs_torch.py "$DEST/"
du -sh "$DEST"; ls -la "$DEST"
for t in memfit "${TESTS[@]}"; do [ -x "$DEST/$t" ] || { echo "missing $t" >&2; exit 1; }; done
bash -n "$DEST/check.sh"
bash "$DEST/check.sh" --self-test
[ ! -f "$DEST/gpu_vs_torch.py" ] || python3 "$DEST/gpu_vs_torch.py" --self-test
