#!/usr/bin/env bash
# Runs every target for $1 seconds (default 240), one after another, and
# keeps each log in logs/<target>.log. Corpora grow in corpus/<target>
# (ignored by git); crashes land in artifacts/<target>.
set -u
cd "$(dirname "$0")"
secs=${1:-240}
mkdir -p logs
for t in weights idx image; do
  mkdir -p "corpus/$t"
  cp -n seeds/"$t"/* "corpus/$t/" 2>/dev/null
  cargo +nightly fuzz run -O "$t" "corpus/$t" -- \
    -max_total_time="$secs" -max_len=16384 -rss_limit_mb=1024 -malloc_limit_mb=512 \
    -timeout=10 -print_final_stats=1 > "logs/$t.log" 2>&1
  echo "$t: exit $? ($(grep -c '^#' "logs/$t.log") status lines)"
done
