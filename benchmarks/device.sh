#!/usr/bin/env bash
# The accelerator's figures in one run (issue 46 item 6), in <= 9 minutes on one GPU:
#   1. the byte-level LM's step-time profile T(M) on this device, stored under
#      benchmarks/profiles/ (adaptive_batch.py --measure-profile);
#   2. the frontier benchmark's --quick figures, priced on that profile
#      (frontier_run.py finds the stored profile itself);
#   3. bfloat16 against float32 tokens per second on the LM (precision.py);
#   4. the sharded code path on a (1, 1) mesh against the replicated step
#      (sharded.py prints sharded_path_ratio on a GPU host);
#   5. accumulated micro-steps against one compiled step of their batch.
# Each part has its own time limit and the script goes on past a failed one; the
# logs go to $OUT when it is set (else benchmarks/device-logs/). Without a GPU
# (jax sees none) it says so and exits 0: CPU runs skip it.
#
# Usage: bash benchmarks/device.sh [--dry-run]   (--dry-run: print the commands only)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-benchmarks/device-logs}
DRY=${1:-}

platform=$($PY -c 'import jax; print(jax.devices()[0].platform)' 2>/dev/null || echo none)
if [ "$platform" != "gpu" ] && [ "$DRY" != "--dry-run" ]; then
  echo "benchmarks/device.sh: jax sees no GPU (platform: $platform); skipped"
  exit 0
fi
if [ "$DRY" != "--dry-run" ]; then
  mkdir -p "$LOGS"
  # the project itself, without touching the machine's own jax (no network there)
  $PY -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 ||
    echo "device.sh: pip install -e . failed (see $LOGS/install.log); running from the tree"
fi

part() {  # part NAME SECONDS COMMAND...: one figure, its own limit, its own log
  local name=$1 limit=$2
  shift 2
  if [ "$DRY" = "--dry-run" ]; then
    echo "timeout $limit $*"
    return 0
  fi
  echo "== $name (<= ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 4 "$LOGS/$name.log"
  echo "== $name: rc=$rc, $((SECONDS - t0)) s"
}

part profile 90 $PY benchmarks/adaptive_batch.py --measure-profile --devices 1
part frontier 240 $PY benchmarks/frontier_run.py --quick --devices 1
part precision 75 $PY benchmarks/precision.py --size gpu --steps 60 --devices 1
part sharded 75 $PY benchmarks/sharded.py --quick --size gpu
part accumulate 60 $PY benchmarks/accumulate.py --devices 1 --size base --rounds 10
[ "$DRY" = "--dry-run" ] || ls -l benchmarks/profiles/
