#!/usr/bin/env bash
# Issue 52/53/54's GPU proofs under Triton 3.8, on the device machine (its image: torch 2.11 + triton 3.6), with
# Triton 3.8 carried by bench/carry_triton.sh and the bundles built on the CPU box in the servers' own venvs.
#
#   here:          bash bench/h200_triton38.sh flashinfer            # .carry/sglang-gpu/flashinfer-py.tar.xz (sglang-jit)
#   calls 1..N-1:  bash bench/h200_triton38.sh receive PATH...      # triton parts and bundle parts, kept in /tmp
#   call N:        bash bench/h200_triton38.sh unpack                # triton at the build venvs' paths, bundles joined
#                  (PREWARM_CARRY_VENVS=vllm, later =sglang: one server's unpack per call, parts still in /tmp)
#   then:          bash bench/h200_triton38.sh run vllm own          # up to 10 min a call: one or more proofs
#                  bash bench/h200_triton38.sh run sglang-graph sglang-layer tune
#
# Triton 3.8 keys cuda_utils by its own install path and the node's libcuda dirs: the carried tree is unpacked at the
# path of the CPU box venv that built each bundle (/work/real/{vllm,sglang}/lib/python3.12/site-packages), so that the
# bundles' cuda_utils (built for this machine's libcuda dirs, [target] libcuda_dirs) is found as the nodes' would be.
# Each proof: >= 5 fresh processes, each on its own fresh install at another path, every Triton compile, JIT build,
# autotune benchmark and C module build counted (bench/_common.py).
set -uo pipefail
cd "$(dirname "$0")/.."
verb=${1:-}
keep=/tmp/prewarm-carry
out=${OUT:-bench/results}
# the build venvs' root on the CPU box: .ci/setup's server venvs (.venv-sglang, .venv-vllm) in the checkout, /work/main
# here (PREWARM_BUILD_ROOT=/work/real with PREWARM_VENV_PREFIX= for the 2026-12-05 runs' /work/real/{vllm,sglang})
site() { echo "${PREWARM_BUILD_ROOT:-/work/main}/${PREWARM_VENV_PREFIX-.venv-}$1/lib/python3.12/site-packages"; }
case $verb in
  flashinfer)  # here: the serving image's FlashInfer for sglang's JIT modules (its Python files and the headers they
    # include, 10 MB as xz) from .venv-sglang, into .carry/sglang-gpu/; a device call carries it, `receive` keeps it
    fi_site=$(site sglang) && list=$(mktemp) && mkdir -p .carry/sglang-gpu || exit 1
    (cd "$fi_site" && { find flashinfer -name '*.py' -not -path 'flashinfer/data/*'
      find flashinfer/data/include flashinfer/data/cutlass/include flashinfer/data/cutlass/tools/util/include \
        flashinfer/data/spdlog/include -type f
      find flashinfer/data/csrc -type f \( -name '*.h' -o -name '*.cuh' -o -name '*.hpp' -o -name '*.inc' \)
      find flashinfer_python-*.dist-info -type f; } | sort -u > "$list" &&
      tar -cf - -T "$list" | xz -T2 -6 > "$OLDPWD/.carry/sglang-gpu/flashinfer-py.tar.xz") || exit 1
    rm -f "$list" && ls -l .carry/sglang-gpu/flashinfer-py.tar.xz
    ;;
  receive)
    mkdir -p "$keep"
    for path in "${@:2}"; do cp -r "$path" "$keep/"; done
    ls "$keep"
    ;;
  unpack)
    # .whl/ travels once (13 MiB): a later unpack on the same warm machine (another server's bundle) reuses /tmp/site
    if compgen -G ".whl/*.whl" >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 11
    fi
    export PYTHONPATH=/tmp/site
    for venv in ${PREWARM_CARRY_VENVS:-vllm sglang}; do bash bench/carry_triton.sh unpack 3.8.0 "$(site $venv)" || exit 1; done
    if compgen -G "$keep/sglang.tar.part-*" >/dev/null; then  # the sglang bundle, in parts (over one call's 64 MiB)
      (cd "$keep" && cat sglang.tar.part-* > sglang.tar && sha256sum -c sglang.SHA256SUMS --ignore-missing &&
        mkdir -p /tmp/bundles/sglang && tar -xf sglang.tar -C /tmp/bundles/sglang &&
        mv /tmp/bundles/sglang/sglang /tmp/bundles/sglang/bundle) || exit 1
    fi
    for b in kimi-linear-h200 kimi-linear-h200-vllm; do [ -d "$keep/$b" ] && cp -r "$keep/$b" /tmp/bundles/; done
    ls /tmp/bundles/*
    ;;
  run)
    export PYTHONPATH=/tmp/site
    rc=0
    for proof in "${@:2}"; do
      case $proof in
        own)
          mkdir -p /tmp/prewarm-proof/shim && ln -sfn "$PWD/kernels" /tmp/prewarm-proof/shim/prewarm_kernels
          seeds=$(( $(date +%s) % 100000 ))
          PYTHONPATH=$(site vllm):/tmp/site:/tmp/prewarm-proof/shim:$PWD python3 bench/serving_traffic.py \
            --bundle /tmp/bundles/kimi-linear-h200 --seeds "$(seq -s, $seeds $((seeds + 4)))" --device-runs 0 --expect-zero \
            --work-dir /tmp/prewarm-proof --out "$out/serving_traffic_triton38.json" 2>&1 | tee "$out/serving_traffic_triton38.log"
          r=${PIPESTATUS[0]}
          ;;
        vllm|vllm-model)
          PREWARM_TRITON_SITE=$(site vllm) bash bench/h200_proof.sh "$([ "$proof" = vllm ] && echo vllm-layer || echo "$proof")" \
            $([ -d /tmp/bundles/kimi-linear-h200-vllm ] && echo /tmp/bundles/kimi-linear-h200-vllm)
          r=$?
          ;;
        sglang-layer|sglang-graph|sglang-model|sglang-jit)
          PREWARM_TRITON_SITE=$(site sglang) bash bench/h200_proof.sh "$proof" /tmp/bundles/sglang
          r=$?
          ;;
        tune)
          PREWARM_TRITON_SITE=$(site vllm) bash bench/h200_proof.sh tune manifests/kimi-linear-h200-vllm.toml \
            manifests/kimi-linear-h200-sglang.toml
          r=$?
          ;;
        *) echo "unknown proof $proof" >&2; r=2 ;;
      esac
      echo "h200_triton38: $proof exit $r, $SECONDS s"
      [ "$r" = 0 ] || rc=1
    done
    exit $rc
    ;;
  *)
    echo "usage: bash bench/h200_triton38.sh flashinfer | receive PATH... | unpack | run vllm|vllm-model|own|sglang-layer|sglang-graph|sglang-jit|sglang-model|tune..." >&2
    exit 2
    ;;
esac
