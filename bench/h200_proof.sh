#!/usr/bin/env bash
# Issue 10's GPU proofs, each as ONE command for the device tool (10 minutes per command at most):
#
#   bash bench/h200_proof.sh traffic BUNDLE     # nvidia-h200: ~7 min
#   bash bench/h200_proof.sh dp-stall [BUNDLE]  # nvidia-h200-x2: ~4 min with BUNDLE, ~6 min without
#
# traffic: bench/serving_traffic.py installs BUNDLE (a `prewarm pack` dir built on the CPU box) into a fresh node dir
#   per process and runs 5 fresh processes of independent traffic (seeds from the clock, recorded in the JSON), then
#   builds a --mode device bundle on this GPU and runs the first 2 seeds on it; then bench/cold_start.py on that
#   device bundle (cold vs warm, same traffic). Estimate from the previous H200 figures: 5 x ~22 s (install 1.5 s,
#   torch/CUDA init ~8 s, first step ~9 s of autotune on an offline bundle, later steps) + device build and pack
#   ~110 s + 2 x ~12 s + cold_start ~150 s (install + verify ~15 s, warm ~12 s, cold ~120 s) = ~400 s.
#   The device bundle comes back as device-bundle.tar (for the dp-stall run); the key dir of every compile, if any,
#   as compiled-keys.tar (explain each here: `prewarm explain compiled/<bundle>-<seed>/<key> --plan MANIFEST`).
# dp-stall: bench/dp_stall.py, 2 ranks on 2 GPUs over NCCL, scenarios A (rank 0 cold) and B (both prewarmed);
#   BUNDLE is the device-bundle.tar (or dir) of the traffic run; without one a device bundle is built here (~110 s).
#
# Results (JSON + logs) go to $OUT (the device tool's return folder), else bench/results. Wheels in .whl/ (packages
# the node lacks: zstandard, cryptography, cffi, pycparser) are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
bundle=${2:-}
out=${OUT:-bench/results}
work=${PREWARM_BENCH_WORK:-/tmp/prewarm-proof}
py=${PYTHON:-python3}
export PREWARM_BENCH_WORK=$work PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ! [[ ($mode == traffic && -n $bundle) || $mode == dp-stall ]]; then
  echo "usage: bash bench/h200_proof.sh traffic BUNDLE | dp-stall [BUNDLE]" >&2
  exit 2
fi
mkdir -p "$out" "$work"

if compgen -G ".whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 11
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

if [[ $bundle == *.tar ]]; then  # a bundle that came back from an earlier run as one file
  rm -rf "$work/carried" && mkdir -p "$work/carried" && tar -xf "$bundle" -C "$work/carried" || exit 1
  bundle=$work/carried/bundle
fi

case $mode in
  traffic)
    [ -f "$bundle/index.json" ] || { echo "h200_proof: traffic needs a bundle dir (no $bundle/index.json)" >&2; exit 2; }
    seeds=$(( $(date +%s) % 100000 ))
    seeds=$(seq -s, "$seeds" $((seeds + 4)))
    rm -rf "$work/compiled"
    $py bench/serving_traffic.py --bundle "$bundle" --seeds "$seeds" --device-runs 2 --expect-zero \
      --keep-compiled "$work/compiled" --work-dir "$work" --out "$out/serving_traffic.json" 2>&1 \
      | tee "$out/serving_traffic.log"
    rc_traffic=${PIPESTATUS[0]}
    [ -d "$work/compiled" ] && tar -cf "$out/compiled-keys.tar" -C "$work" compiled
    [ -f "$work/bundle/index.json" ] && tar -cf "$out/device-bundle.tar" -C "$work" bundle
    warm=$work/bundle  # the device bundle; if its build failed, the offline one (then the warm run autotunes)
    [ -f "$warm/index.json" ] || warm=$bundle
    left=$((585 - SECONDS))  # the device tool stops a command at 600 s: cold_start ends (JSON written) before
    if [ $left -gt 180 ]; then
      timeout $left $py bench/cold_start.py --bundle "$warm" --work-dir "$work" --timeout $((left - 60)) \
        --out "$out/cold_start.json" 2>&1 | tee "$out/cold_start.log"
      rc_cold=${PIPESTATUS[0]}
    else
      echo "h200_proof: cold_start not run (only $left s left)"; rc_cold=1
    fi
    echo "h200_proof: serving_traffic exit $rc_traffic, cold_start exit $rc_cold, $SECONDS s"
    [ $rc_traffic -eq 0 ] && [ $rc_cold -eq 0 ]
    ;;
  dp-stall)
    args=()
    [ -n "$bundle" ] && args=(--bundle "$bundle")
    $py bench/dp_stall.py "${args[@]}" --ranks 2 --scenarios A,B --work-dir "$work" \
      --out "$out/dp_stall.json" 2>&1 | tee "$out/dp_stall.log"
    rc=${PIPESTATUS[0]}
    echo "h200_proof: dp_stall exit $rc, $SECONDS s"
    exit $rc
    ;;
esac
