#!/usr/bin/env bash
# Issue 10's GPU proofs, each as ONE command for the device tool (10 minutes per command at most):
#
#   bash bench/h200_proof.sh traffic BUNDLE     # nvidia-h200: ~7 min
#   bash bench/h200_proof.sh dp-stall [BUNDLE]  # nvidia-h200-x2: ~4 min with BUNDLE, ~6 min without
#   bash bench/h200_proof.sh fla-tune           # nvidia-h200: repeat (machine kept warm) until it prints "table done"
#   bash bench/h200_proof.sh fla-offline        # nvidia-h200, after fla-tune on the same machine: ~5 min
#   bash bench/h200_proof.sh jit DIR            # nvidia-h200: ~4 min
#   bash bench/h200_proof.sh vllm-layer [BUNDLE] # nvidia-h200: ~6 min (~5 with a carried BUNDLE)
#   bash bench/h200_proof.sh sglang-layer DIR   # nvidia-h200: ~5 min
#   bash bench/h200_proof.sh sglang-graph DIR   # nvidia-h200: ~5 min
#   bash bench/h200_proof.sh sglang-jit DIR     # nvidia-h200: the model manifest's sglang modules built here (~3 min)
#   bash bench/h200_proof.sh sglang-model DIR   # nvidia-h200: sglang-graph with the model's components (--model), on
#                                               # the modules sglang-jit built (first if not yet)
#   bash bench/h200_proof.sh vllm-model [BUNDLE] # nvidia-h200: vllm-layer with the model's (bench/vllm_model_traffic.py)
#   bash bench/h200_proof.sh keys               # nvidia-h200: ~1 min
#   bash bench/h200_proof.sh tune MANIFEST...   # nvidia-h200: ~1-3 min a manifest
#
# PREWARM_TRITON_SITE=DIR runs any mode under a Triton the image lacks, unpacked into DIR by bench/carry_triton.sh
# (put first on PYTHONPATH; the image's torch stays: Triton's key does not include torch).
#
# keys: bench/triton_keys.py on this GPU, launched and compiled target-only (compare with the CPU box's JSON).
# tune: `prewarm tune` of each MANIFEST on this GPU into its own [target] tuned table (other devices' rows kept), with
#   the server trees of build/ on the path; each table comes back in $OUT.
#
# traffic: bench/serving_traffic.py installs BUNDLE (a `prewarm pack` dir built on the CPU box) into a fresh node dir
#   per process and runs 5 fresh processes of independent traffic (seeds from the clock, recorded in the JSON), then
#   builds a --mode device bundle on this GPU and runs the first 2 seeds on it; then bench/cold_start.py on that
#   device bundle (cold vs warm, same traffic). Estimate from the previous H200 figures: 5 x ~22 s (install 1.5 s,
#   torch/CUDA init ~8 s, first step ~9 s of autotune on an offline bundle, later steps) + device build and pack
#   ~110 s + 2 x ~12 s + cold_start ~150 s (install + verify ~15 s, warm ~12 s, cold ~120 s) = ~400 s.
#   The device bundle comes back as device-bundle.tar (for the dp-stall run); the key dir of every compile, if any,
#   as compiled-keys.tar (explain each here: `prewarm explain compiled/<bundle>-<seed>/<key> --plan MANIFEST`).
# fla-tune: `prewarm tune manifests/kimi-linear-h200-fla.toml --cache-dir W` (3184 compiles when it ran, 4432 since
#   each index pointer is planned apart; 190 tuning keys: more than one command's 10 minutes): each call resumes in
#   the kept W (nothing compiled or benchmarked twice) and stops itself before the limit; meanwhile an offline
#   build of the same manifest (CUDA_VISIBLE_DEVICES empty: no GPU, as a container step builds it) runs detached (setsid) on the cores the tune leaves. The table comes back in $OUT.
# fla-offline: waits for that offline build, applies the table (`build --tuned`: nothing compiled again), packs it and
#   runs bench/offline_autotune.py on the bundle (5 processes together + 5 one after another, fla traffic).
# jit: past Triton (issue 41). DIR holds bench/jit-h200.toml's three bundles built and packed on the CPU box
#   (bundle, bundle.sglang-jit, bundle.flashinfer-aot) and flashinfer-py.tar.xz (FlashInfer 0.7.2's Python package:
#   the node's FlashInfer, whose data/aot the flashinfer-aot bundle installs into). First the CPU box's sglang-jit
#   bundle is installed here: sglang keys its modules on the image's host compiler and system headers, so a node of
#   another image is refused (the factor named; logged). The sglang modules are then built in this node's image with
#   no GPU visible (CUDA_VISIBLE_DEVICES=, the manifest with pytorch sampling: Triton + sglang-jit) and packed; then
#   bench/sglang_traffic.py runs 5 fresh processes of independent traffic (packed decode at every batch 1..64, 8
#   FlashInfer sampling calls per step) on the CPU box's Triton and FlashInfer bundles and the node-image sglang-jit
#   one, each installed at another path per process, every Triton compile, JIT build and autotune benchmark counted;
#   then the control: one process of the same KDA traffic with sglang's JIT dir left empty (the guard counts the build).
# vllm-layer: issue 49. manifests/kimi-linear-h200-vllm.toml built on this host with no GPU visible
#   (CUDA_VISIBLE_DEVICES=, as a container step builds it) and packed; then bench/vllm_layer_traffic.py: 5 fresh
#   guarded processes, each on its own fresh install of that bundle, of independent layer-level traffic driving vLLM
#   0.34.0's real KimiGatedDeltaNetAttention.forward (build/vllm: the wheel's files) on the GPU.
# sglang-layer: issue 49, sglang's CUDA KDA layer. DIR holds `bundle`, the Triton bundle of
#   manifests/kimi-linear-h200-sglang.toml built and packed on the CPU box (no GPU). sglang's JIT module is built in
#   this node's image with no GPU visible (bench/jit-h200.toml's plan reaches the same module as the manifest's:
#   kda_packed_decode for bf16 batches of 8+), packed; then bench/sglang_layer_traffic.py runs 5 fresh processes of
#   independent layer-level traffic (KDAAttnBackend's prefill/decode/verify with the conv, state tracking, the verify
#   commit and the o_norm; every decode and verify batch 1..128, draft widths 2-4) under the guard, each on its own
#   install of both bundles at another path: every Triton compile, JIT build and autotune benchmark counted.
# sglang-graph: the same with `bench/sglang_layer_traffic.py --graph` (issue 54): the serving path around the layer,
#   decode and target verify replayed from real CUDA graphs captured per --cuda-graph-bs bucket, the fused projection's
#   views, the runner's slot copy/clear and positions, the EAGLE verify commit (tests/traffic/sglang_graph.py).
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
if ! [[ ($mode == traffic && -n $bundle) || ($mode == jit && -n $bundle) || ($mode == sglang-layer && -n $bundle) ||
        ($mode == sglang-graph && -n $bundle) || ($mode == sglang-model && -n $bundle) || $mode == vllm-model ||
        ($mode == sglang-jit && -n $bundle) ||
        $mode == dp-stall || $mode == fla-tune || $mode == fla-offline || $mode == vllm-layer || $mode == keys ||
        ($mode == tune && -n $bundle) ]]; then
  echo "usage: bash bench/h200_proof.sh traffic BUNDLE | jit DIR | sglang-layer DIR | dp-stall [BUNDLE] | fla-tune |" \
    "fla-offline | vllm-layer [BUNDLE] | sglang-graph DIR | keys | tune MANIFEST... | sglang-jit DIR | sglang-model DIR |" \
    "vllm-model [BUNDLE]" >&2
  exit 2
fi
mkdir -p "$out" "$work"

if compgen -G ".whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 11
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

if [ -n "${PREWARM_TRITON_SITE:-}" ]; then
  export PYTHONPATH=$PREWARM_TRITON_SITE${PYTHONPATH:+:$PYTHONPATH}
fi
$py -c 'import torch, triton; print("h200_proof: torch", torch.__version__, "triton", triton.__version__, triton.__file__)'

if [[ $bundle == *.tar ]]; then  # a bundle that came back from an earlier run as one file
  rm -rf "$work/carried" && mkdir -p "$work/carried" && tar -xf "$bundle" -C "$work/carried" || exit 1
  bundle=$work/carried/bundle
fi

# sglang-jit / sglang-model: every sglang module manifests/kimi-linear-h200-sglang.toml plans, built in this node's
# image with no GPU visible (sglang keys them on its host compiler) and packed into $work/bundle.sglang-jit. The
# build dir starts as an install of $1 (the manifest's Triton bundle, built on the CPU box): its compiles are
# present, so only what the bundle lacks is built here. FlashInfer's sampling module is left out (sampling_backend
# pytorch: this image has no FlashInfer; bench/h200_proof.sh jit proves that module).
# the serving image's FlashInfer (sglang's EAGLE sampling and other JIT modules include its headers; a node's image
# has it as sglang's dependency, the device image does not): its Python package and headers, carried as
# /tmp/prewarm-carry/flashinfer-py.tar.xz (bench/h200_triton38.sh receive), unpacked once and put on the path
node_flashinfer() {
  local tar=/tmp/prewarm-carry/flashinfer-py.tar.xz
  [ -f "$tar" ] || return 0
  [ -d "$work/fi/flashinfer" ] || { mkdir -p "$work/fi" && tar -xJf "$tar" -C "$work/fi"; } || return 1
  export PYTHONPATH=$work/fi:$PYTHONPATH
}

node_jit() {
  local manifest=manifests/kimi-linear-h200-sglang.toml
  echo "== the sglang modules of $manifest built in this node's image, no GPU visible"
  sed 's/^sampling_backend = "flashinfer"/sampling_backend = "pytorch"/' $manifest > manifests/.node-sglang.toml
  rm -rf "$work/node-build"* "$work/bundle.sglang-jit"*
  $py -m prewarm.cli install "$1" --cache-dir "$work/node-build" &&
    CUDA_VISIBLE_DEVICES= $py -m prewarm.cli build manifests/.node-sglang.toml --cache-dir "$work/node-build" \
      --workers 16 && $py -m prewarm.cli pack "$work/node-build.sglang-jit" -o "$work/bundle.sglang-jit" &&
    touch "$work/bundle.sglang-jit.model"
  echo "exit $?, $SECONDS s"
}

fla=manifests/kimi-linear-h200-fla.toml
table=$work/kimi-linear-h200-fla.tuned.toml
case $mode in
  fla-tune)
    if [ ! -f "$work/fla-offline.started" ]; then  # the manifest's table is not there yet: built without results
      touch "$work/fla-offline.started"
      setsid bash -c "CUDA_VISIBLE_DEVICES= nice -n 5 $py -m prewarm.cli build $fla --mode offline --workers 8 \
        --cache-dir $work/fla-offline >$work/fla-offline.log 2>&1; echo \$? >$work/fla-offline.rc" \
        </dev/null >/dev/null 2>&1 &
    fi
    timeout $((570 - SECONDS)) $py -m prewarm.cli tune $fla -o "$table" --cache-dir "$work/fla-tune" --workers 10 2>&1 \
      | tee -a "$work/fla-tune.log"
    rc=${PIPESTATUS[0]}
    cp "$work/fla-tune.log" "$out/fla_tune_h200.log"
    [ $rc -eq 0 ] && cp "$table" "$out/" && echo "h200_proof: table done"
    echo "h200_proof: tune exit $rc, offline build: $(cat "$work/fla-offline.rc" 2>/dev/null || echo running), $SECONDS s"
    exit $rc
    ;;
  fla-offline)
    [ -f "$table" ] || { echo "h200_proof: no $table: run fla-tune first" >&2; exit 2; }
    while [ ! -f "$work/fla-offline.rc" ]; do sleep 5; done
    cp "$work/fla-offline.log" "$out/fla_offline_build.log"
    [ "$(cat "$work/fla-offline.rc")" = 0 ] || { echo "h200_proof: offline build failed" >&2; exit 1; }
    cp "$table" manifests/  # the manifest names it ([target] tuned)
    CUDA_VISIBLE_DEVICES= $py -m prewarm.cli build $fla --mode offline --cache-dir "$work/fla-offline" 2>&1 \
      | tee "$out/fla_offline_table.log" || exit 1
    rm -rf "$work/fla-bundle" && $py -m prewarm.cli pack "$work/fla-offline" -o "$work/fla-bundle" || exit 1
    $py bench/offline_autotune.py --bundle "$work/fla-bundle" --manifest $fla --work-dir "$work" \
      --out "$out/offline_autotune_fla.json" 2>&1 | tee "$out/offline_autotune_fla.log"
    rc=${PIPESTATUS[0]}
    echo "h200_proof: offline_autotune exit $rc, $SECONDS s"
    exit $rc
    ;;
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
  jit)
    carried=$bundle
    rm -rf "$work/fi" && mkdir -p "$work/fi" && tar -xJf "$carried/flashinfer-py.tar.xz" -C "$work/fi" || exit 1
    mkdir -p "$work/shim" && ln -sfn "$PWD/kernels" "$work/shim/prewarm_kernels"  # as setup.py maps it
    export PYTHONPATH=$work/fi:$PWD/build/sglang:$work/shim:$PYTHONPATH
    log=$out/jit_traffic.log
    { echo "== the CPU box's sglang-jit bundle on this node (expected: refused, exit 8, the factor named)"
      $py -m prewarm.cli install "$carried/bundle.sglang-jit" --cache-dir "$work/cpu-sglang-jit"
      echo "exit $?"
      echo "== sglang's modules built in this node's image, no GPU visible"
      sed 's/^sampling_backend = "flashinfer"/sampling_backend = "pytorch"/' bench/jit-h200.toml > "$work/jit-h200-sglang.toml"
      rm -rf "$work/node-build"*
      CUDA_VISIBLE_DEVICES= $py -m prewarm.cli build "$work/jit-h200-sglang.toml" --cache-dir "$work/node-build" &&
        $py -m prewarm.cli pack "$work/node-build.sglang-jit" -o "$work/bundle.sglang-jit"
      echo "exit $?"
    } 2>&1 | tee "$log"
    seeds=$(( $(date +%s) % 100000 ))
    seeds=$(seq -s, "$seeds" $((seeds + 4)))
    $py bench/sglang_traffic.py --manifest bench/jit-h200.toml --bundle "$carried/bundle" \
      --jit-bundle "sglang-jit=$work/bundle.sglang-jit" --jit-bundle "flashinfer-aot=$carried/bundle.flashinfer-aot" \
      --sampling 8 --seeds "$seeds" --expect-zero --work-dir "$work" --out "$out/jit_traffic.json" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    # the control: one process of the same KDA traffic on a node without sglang's modules (the guard counts the
    # build; no sampling: this FlashInfer copy has no sources to build from)
    $py bench/sglang_traffic.py --manifest bench/jit-h200.toml --bundle "$carried/bundle" \
      --jit-bundle "sglang-jit=$work/bundle.sglang-jit" --jit-cold --seeds "${seeds%%,*}" --work-dir "$work" \
      --out "$out/jit_traffic_cold.json" 2>&1 | tee -a "$log"
    echo "h200_proof: jit traffic exit $rc, the control exit ${PIPESTATUS[0]}, $SECONDS s" | tee -a "$log"
    exit $rc
    ;;
  vllm-layer|vllm-model)
    mkdir -p "$work/shim" && ln -sfn "$PWD/kernels" "$work/shim/prewarm_kernels"  # as setup.py maps it
    export PYTHONPATH=$PWD/build/vllm:$work/shim:$PWD${PYTHONPATH:+:$PYTHONPATH}
    vllm=manifests/kimi-linear-h200-vllm.toml
    name=${mode/-/_}_traffic
    log=$out/$name.log
    if [ -n "$bundle" ]; then  # a bundle built elsewhere (the CPU box, in vLLM's own venv)
      rm -rf "$work/vllm-bundle" && cp -r "$bundle" "$work/vllm-bundle"
      echo "== the carried bundle $bundle" | tee "$log"
    else
      rm -rf "$work/vllm-build" "$work/vllm-bundle"
      # this node's libcuda dirs (Triton's own lookup), stated as a deployer states them ([target] libcuda_dirs):
      # Triton 3.8 keys cuda_utils by them, and this image's libcuda is not in the manifest's default dir
      dirs=$($py -c 'import json; from triton.backends.nvidia.driver import libcuda_dirs; print(json.dumps(libcuda_dirs()))') &&
        sed "/^\[target\]/a libcuda_dirs = $dirs" $vllm > manifests/.node-vllm.toml || exit 1
      { echo "== $vllm built with no GPU visible, [target] libcuda_dirs = $dirs"
        CUDA_VISIBLE_DEVICES= $py -m prewarm.cli build manifests/.node-vllm.toml --mode offline --workers 14 --cache-dir "$work/vllm-build" &&
          $py -m prewarm.cli pack "$work/vllm-build" -o "$work/vllm-bundle"
        echo "exit $?"; } 2>&1 | tee "$log"
    fi
    [ -f "$work/vllm-bundle/index.json" ] || exit 1
    seeds=$(( $(date +%s) % 100000 ))
    seeds=$(seq -s, "$seeds" $((seeds + 4)))
    $py bench/$name.py --manifest $vllm --bundle "$work/vllm-bundle" --vllm-path build/vllm \
      --seeds "$seeds" --expect-zero --work-dir "$work" --out "$out/$name.json" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "h200_proof: $mode traffic exit $rc, $SECONDS s" | tee -a "$log"
    exit $rc
    ;;
  sglang-jit)
    mkdir -p "$work/shim" && ln -sfn "$PWD/kernels" "$work/shim/prewarm_kernels"  # as setup.py maps it
    export PYTHONPATH=$PWD/build/sglang:$work/shim:$PYTHONPATH
    node_flashinfer || exit 1
    node_jit "$bundle/bundle" 2>&1 | tee "$out/sglang_node_jit.log"
    [ -f "$work/bundle.sglang-jit.model" ]
    ;;
  sglang-layer|sglang-graph|sglang-model)
    graph=() && name=sglang_layer_traffic
    [ "$mode" = sglang-graph ] && graph=(--graph) && name=sglang_graph_traffic
    [ "$mode" = sglang-model ] && graph=(--model) && name=sglang_model_traffic  # PREWARM_GRAPH=0: eager layer
    [ "$mode" = sglang-model ] && [ "${PREWARM_GRAPH:-1}" = 1 ] && graph+=(--graph)
    mkdir -p "$work/shim" && ln -sfn "$PWD/kernels" "$work/shim/prewarm_kernels"  # as setup.py maps it
    export PYTHONPATH=$PWD/build/sglang:$work/shim:$PYTHONPATH
    [ "$mode" = sglang-model ] && { node_flashinfer || exit 1; }
    log=$out/$name.log
    if [ "$mode" = sglang-model ]; then  # every sglang module the model's plan builds (sglang-jit: kept in $work)
      [ -f "$work/bundle.sglang-jit.model" ] || node_jit "$bundle/bundle" 2>&1 | tee "$log"
      [ -f "$work/bundle.sglang-jit.model" ] || exit 1
    else
      { echo "== sglang's JIT module built in this node's image, no GPU visible"
        sed 's/^sampling_backend = "flashinfer"/sampling_backend = "pytorch"/' bench/jit-h200.toml > "$work/jit-node.toml"
        rm -rf "$work/node-build"* "$work/bundle.sglang-jit"*
        CUDA_VISIBLE_DEVICES= $py -m prewarm.cli build "$work/jit-node.toml" --cache-dir "$work/node-build" &&
          $py -m prewarm.cli pack "$work/node-build.sglang-jit" -o "$work/bundle.sglang-jit"
        echo "exit $?"
      } 2>&1 | tee "$log"
    fi
    seeds=$(( $(date +%s) % 100000 ))
    seeds=$(seq -s, "$seeds" $((seeds + 4)))
    calls=96 && [ "$mode" = sglang-model ] && calls=48  # --model: as many model calls again a step
    $py bench/sglang_layer_traffic.py "${graph[@]}" --bundle "$bundle/bundle" --jit-bundle "sglang-jit=$work/bundle.sglang-jit" \
      --calls "${PREWARM_CALLS:-$calls}" --seeds "$seeds" --expect-zero --work-dir "$work" --out "$out/$name.json" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "h200_proof: layer traffic exit $rc, $SECONDS s" | tee -a "$log"
    exit $rc
    ;;
  keys)
    $py bench/triton_keys.py launch --out "$out/triton_keys_gpu.json" >/dev/null &&
      $py bench/triton_keys.py compile --out "$out/triton_keys_gpu_compile.json" >/dev/null
    rc=$?
    $py -c 'import json, sys; a, b = (json.load(open(p)) for p in sys.argv[1:]); print("h200_proof: launch keys == compile keys:", a["kernel_keys"] == b["kernel_keys"], a["kernel_keys"], "modules", list(a["modules"]))' \
      "$out/triton_keys_gpu.json" "$out/triton_keys_gpu_compile.json"
    exit $rc
    ;;
  tune)
    mkdir -p "$work/shim" && ln -sfn "$PWD/kernels" "$work/shim/prewarm_kernels"  # as setup.py maps it
    export PYTHONPATH=$PYTHONPATH:$PWD/build/sglang:$PWD/build/vllm:$work/shim:$PWD
    rc=0
    for manifest in "${@:2}"; do
      table=$($py -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["target"]["tuned"])' "$manifest")
      table=$(dirname "$manifest")/$table
      name=$(basename "$manifest" .toml)
      $py -m prewarm.cli tune "$manifest" -o "$table" --workers 16 --cache-dir "$work/tune-$name" 2>&1 | tee "$out/tune-$name.log"
      [ "${PIPESTATUS[0]}" = 0 ] && cp "$table" "$out/" || rc=1
      echo "h200_proof: tune $manifest, $SECONDS s"
    done
    exit $rc
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
