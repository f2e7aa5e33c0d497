#!/usr/bin/env bash
# Runs torch's own FSDP2 unit tests on CPU (gloo, world size <= 2) with torch's
# FSDP2 or with fsdp-rs substituted for its public names; see README.md.
#   tools/upstream_fsdp2/run.sh torch|fsdprs TESTS_DIR [test_file.py ...]
# Per-file JUnit XML and logs go to $OUT/<mode>/ (default: upstream-out/).
set -u
MODE=${1:?mode: torch or fsdprs}
TESTS=${2:?TESTS_DIR: the directory of the upstream test_fully_shard_*.py files}
shift 2
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-upstream-out}
export PYTHONPATH="$HERE:$REPO/python${PYTHONPATH:+:$PYTHONPATH}"
export FSDP_IMPL=$MODE FSDP_MAX_WORLD_SIZE=${FSDP_MAX_WORLD_SIZE:-2} OMP_NUM_THREADS=1
export DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=${PER_TEST_TIMEOUT:-240}
FILES=("$@")
[ ${#FILES[@]} -eq 0 ] && FILES=("$TESTS"/test_fully_shard_*.py)
mkdir -p "$OUT/$MODE"
for f in "${FILES[@]}"; do
    b=$(basename "$f" .py)
    echo "=== $MODE $b"
    timeout -k 10 "${PER_FILE_TIMEOUT:-3000}" python -m pytest -p no:cacheprovider -rA -q \
        --junitxml="$OUT/$MODE/$b.xml" "$f" > "$OUT/$MODE/$b.log" 2>&1
    echo "    rc=$? $(tail -1 "$OUT/$MODE/$b.log")"
done
