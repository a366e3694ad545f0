# syntax=docker/dockerfile:1.7
# A serving image with the Triton cache of a shipped manifest baked in (cache + its bundle), so no node compiles
# on first use.
#
#   NVIDIA:          docker build -t kda-serving:cuda .
#   Ascend:          docker build --build-arg TARGET=npu -t kda-serving:npu .
#   signed bundle:   docker build --secret id=prewarm_key,src=prewarm-signing.key -t kda-serving:cuda .
#                    (key pair from `prewarm keygen`; nodes then install with --trust prewarm-signing.pub)
#   another manifest: --build-arg CUDA_MANIFEST=<file in manifests/> (or NPU_MANIFEST)
#   a server's own image (its Python, torch, Triton and server as its image has them; prewarm goes into that
#   environment, the server manifest is planned, built, packed and verified there):
#     sglang:        docker build --build-arg TARGET=serving -t sglang-prewarmed .
#     vLLM:          docker build --build-arg TARGET=serving --build-arg SERVING_IMAGE=vllm/vllm-openai:v0.34.0 \
#                      --build-arg SERVING_MANIFEST=kimi-linear-h200-vllm.toml -t vllm-prewarmed .
#
# Base images. Neither was pulled while writing this file (no Docker engine on that machine):
#   CUDA:   nvidia/cuda:13.0.2-devel-ubuntu24.04: CUDA 13.0 for torch 2.11.0+cu130; Ubuntu 24.04's python3 is
#           3.12.3 like the H200 nodes'. The Python minor matters: libtriton differs per Python minor and is part
#           of every cache key, so a cache built under another Python would miss on the node.
#   Ascend: quay.io/ascend/cann:8.5.0-a3-ubuntu22.04-py3.11: CANN for Atlas A3 with Python 3.11
#           (triton-ascend 3.2.0 ships cp311 wheels only).
#   Serving: the server's published image, sglang's (lmsysorg/sglang:v0.5.23) or vLLM's (vllm/vllm-openai:v0.34.0):
#           the cache's keys are its Triton's (3.8 with torch 2.14), sglang's JIT modules are keyed on its torch,
#           compiler and headers, so only a build in that image ships what its nodes look up. It must have a C
#           compiler (Triton's launchers) and, for sglang's JIT modules, the CUDA toolkit (CUDA_HOME, nvcc).
#
# tests/test_deploy.py parses this file and runs every RUN line that calls `prewarm` (ARG/ENV values from here,
# /opt/prewarm mapped to a temp dir) against the CPU target, so these commands cannot rot; tests/real runs the
# serving stage's in venvs holding each server as pip installs it (.ci/setup --servers), and .ci/wheel_check.py its
# install line there.

ARG TARGET=cuda
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04
ARG CANN_IMAGE=quay.io/ascend/cann:8.5.0-a3-ubuntu22.04-py3.11
ARG SERVING_IMAGE=lmsysorg/sglang:v0.5.23

FROM ${CUDA_IMAGE} AS os-cuda
# gcc: the offline build compiles each kernel's launcher .so and cuda_utils.so with it (Triton builds them at
# first launch otherwise); a node serving only planned kernels then runs no C compiler.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*
ARG CUDA_MANIFEST=kimi-linear-h200.toml
ENV PREWARM_EXTRA=cuda \
    PREWARM_MANIFEST=/opt/prewarm/src/manifests/${CUDA_MANIFEST}

FROM ${CANN_IMAGE} AS os-npu
ARG NPU_MANIFEST=kimi-k3-ascend-a3.toml
ENV PREWARM_EXTRA=npu \
    PREWARM_MANIFEST=/opt/prewarm/src/manifests/${NPU_MANIFEST}

FROM os-${TARGET} AS tool
# TRITON_CACHE_AUTOTUNING=1: every Triton Autotuner in the image (the server's included) reads the autotune results
# the bundle ships, also those without cache_results; verify refuses shipped results this environment would not read.
ENV PREWARM_CACHE=/opt/prewarm/cache \
    PREWARM_BUNDLE=/opt/prewarm/bundle \
    TRITON_CACHE_AUTOTUNING=1 \
    PATH=/opt/prewarm/venv/bin:${PATH}
COPY . /opt/prewarm/src
# --system-site-packages: on the CANN image the toolkit's own Python packages stay visible (nothing is there on
# the CUDA image).
RUN python3 -m venv --system-site-packages /opt/prewarm/venv \
    && /opt/prewarm/venv/bin/pip install --no-cache-dir "/opt/prewarm/src[${PREWARM_EXTRA}]"

FROM tool AS tool-cuda

# --- A server's own image: prewarm in the server's Python environment --------------------------------------------
# The planner imports the server's own modules (sglang, vLLM) and compiles with its Triton: prewarm goes into the
# environment the image's `python3` runs, from its wheel, without the cuda extra (which pins another torch/Triton);
# pip adds only what prewarm needs and the server lacks. PIP_BREAK_SYSTEM_PACKAGES: an image whose system Python is
# marked externally managed (PEP 668) serves from that Python; older pips ignore the variable.
FROM ${SERVING_IMAGE} AS tool-serving
ARG SERVING_MANIFEST=kimi-linear-h200-sglang.toml
ENV PREWARM_MANIFEST=/opt/prewarm/src/manifests/${SERVING_MANIFEST} \
    PREWARM_CACHE=/opt/prewarm/cache \
    PREWARM_BUNDLE=/opt/prewarm/bundle \
    TRITON_CACHE_AUTOTUNING=1
COPY . /opt/prewarm/src
RUN python3 -m pip wheel --no-deps --no-cache-dir -w /opt/prewarm/dist /opt/prewarm/src
RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir /opt/prewarm/dist/prewarm-*.whl

# --- NVIDIA: build + pack at image build time -----------------------------------------------------------------
FROM tool-${TARGET} AS bake-cuda
# `docker build` has no GPU: the offline target compiles every planned kernel (every autotune config) to cubin
# through Triton's real JIT path, plus their launcher .so files, and writes the autotune result of every planned
# tuning key the manifest's table covers (`[target] tuned`, measured once by `prewarm tune` on one GPU node).
# A plan reaching modules past Triton (sglang's JIT modules, FlashInfer's sampling module) also builds those, with
# the library's own code and this image's toolchain, beside the cache: ${PREWARM_CACHE}.sglang-jit,
# ${PREWARM_CACHE}.flashinfer-aot; each is packed as its own bundle beside the Triton one (${PREWARM_BUNDLE}.<layout>).
RUN prewarm build "${PREWARM_MANIFEST}" --cache-dir "${PREWARM_CACHE}" --mode offline
RUN --mount=type=secret,id=prewarm_key \
    if [ -s /run/secrets/prewarm_key ]; then sign="--sign /run/secrets/prewarm_key"; else sign=""; fi \
    && for dir in "${PREWARM_CACHE}" "${PREWARM_CACHE}".*; do \
         suffix=${dir#"$PREWARM_CACHE"}; \
         if [ -d "$dir" ]; then prewarm pack "$dir" -o "${PREWARM_BUNDLE}${suffix}" ${sign} || exit 1; fi; \
       done
# Fail the image build unless each baked dir matches its bundle and every planned kernel and module would be a hit.
RUN jit_dirs="" \
    && for dir in "${PREWARM_CACHE}".*; do \
         suffix=${dir#"$PREWARM_CACHE"}; \
         if [ -d "$dir" ]; then \
           prewarm verify --cache-dir "$dir" --bundle "${PREWARM_BUNDLE}${suffix}" || exit 1; \
           jit_dirs="$jit_dirs --jit-dir ${suffix#.}=$dir"; \
         fi; \
       done \
    && prewarm verify --cache-dir "${PREWARM_CACHE}" --bundle "${PREWARM_BUNDLE}" --plan "${PREWARM_MANIFEST}" ${jit_dirs}
# The baked caches are usable in place (built at these paths; FlashInfer reads its AOT modules only inside its own
# package: the node installs that bundle there); the pre-launch job installs the bundles into the node's own dirs
# instead (deploy/prelaunch.sh, deploy/k8s-init-container.yaml).
ENV TRITON_CACHE_DIR=/opt/prewarm/cache \
    SGLANG_JIT_CACHE_DIR=/opt/prewarm/cache.sglang-jit

# --- Ascend: ship the tool, the manifest and the plan; the node builds ------------------------------------------
FROM tool AS bake-npu
# The last compile stage (bishengir-compile) asks the NPU for its SoC whatever TRITON_ASCEND_ARCH says, and the
# launchers need torch_npu and a device: an Ascend cache can only be completed on a node with an NPU. The image
# therefore carries the exact plan and proves every request gets through the compiler front end (TTIR ->
# linalg, no device); the node's pre-launch job builds the cache (deploy/prelaunch.sh with
# PREWARM_BUILD_ON_NODE=1), packs it and can push it so the other nodes install instead of compiling.
RUN prewarm plan "${PREWARM_MANIFEST}" --json > /opt/prewarm/plan.json
RUN prewarm lower "${PREWARM_MANIFEST}"
# A CANN build host without an NPU can also compile every kernel binary now (`prewarm build M --mode offline`: the
# manifest's SoC is given to bishengir-compile); tested only up to a stand-in compiler, so the image does not yet.
# The node's launchers, npu_utils and precompiled header must be there before serving: verify requires them.
ENV TRITON_CACHE_DIR=/var/cache/triton \
    PREWARM_REQUIRE_LAUNCHERS=1

FROM bake-cuda AS bake-serving

FROM bake-${TARGET}
