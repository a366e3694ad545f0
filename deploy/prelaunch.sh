#!/bin/sh
# Pre-launch job: make this node's Triton cache complete and verified, then (optionally) start the server.
#
#   deploy/prelaunch.sh                                   # as a job / systemd ExecStartPre=
#   deploy/prelaunch.sh python3 -m sglang.launch_server ...   # the line before the server: exec'd on success
#
# The server starts only if verify is clean (integrity of every installed file, toolchain fingerprint, and
# every planned kernel a hit); otherwise the exit code of the failing step says why (see `prewarm --help`).
# Install takes a lock and is a no-op when already done, so all ranks of a node may run this at once.
#
# Settings (environment):
#   TRITON_CACHE_DIR       the node's cache dir the server will use            (default /var/cache/triton: only a
#                          server exec'd by this script gets the default; one started apart must be given it too)
#   PREWARM_SERVER         sglang: verify also runs the server's own import in a child process with the server's
#                          environment (this job's as given, TRITON_CACHE_DIR unset if it was; with a command: the one
#                          exec'd) and fails (exit 14, naming TRITON_CACHE_DIR) when that process would read Triton's
#                          cache elsewhere: `import sglang` sets ~/.cache/sglang/triton where it is unset (default: none)
#   PREWARM_MANIFEST       the manifest the server is planned by               (default: the image's manifest)
#   PREWARM_SOURCE         bundle to install: a dir, a bundle name in the default store, or any fsspec URL
#                          (s3://..., sftp://...; credentials via FSSPEC_S3 / FSSPEC_SFTP) (default: the image's)
#   PREWARM_JIT_SOURCES    modules past Triton the server builds with nvcc at first use (`prewarm build` puts them
#                          beside its cache dir: <dir>.sglang-jit, <dir>.flashinfer-aot, each packed as its own
#                          bundle): a space-separated list of LAYOUT=SOURCE, each installed where the server's
#                          library reads it, then verified with the Triton cache (--jit-dir: integrity, its
#                          library's factors, in signed mode every signature, and everything that library's loader
#                          could load from the dir) and each planned module looked up by that library's own code:
#                          sglang-jit=...      into SGLANG_JIT_CACHE_DIR (default ~/.cache/sglang/jit, sglang's own;
#                                              exported to a server exec'd by this script)
#                          flashinfer-aot=...  into PREWARM_FLASHINFER_AOT_DIR (required with it: the server's
#                                              flashinfer package's data/aot, which FlashInfer loads without ninja)
#                                                                              (default: none)
#   PREWARM_TRUST          a public key: require the bundle (and each of PREWARM_JIT_SOURCES) to be signed by it,
#                          and verify the node in signed mode, its JIT dirs too: every entry covered by a receipt
#                          whose kept index that key signed (a receipt edited, deleted or forged is exit 6; an entry,
#                          link or module dir nothing signed covers is exit 13). Without it the JIT dirs are checked
#                          against their receipts; what nothing covers is listed, and exit 13 only where a planned
#                          module would be loaded from it
#                                                                              (default: none)
#   PREWARM_ALLOW_UNVERIFIED  1 = in signed mode, list entries no signed bundle covers (device builds, the
#                          runtime's own compiles) instead of refusing to start          (default 0)
#   PREWARM_ALLOW_DOWNGRADE  1 = install an older build (a lower sequence in its signed index) of a bundle than the
#                          one last installed under the same manifest name (a rollback; it is then the latest)
#                                                                     (default 0: refused, exit 15)
#   PREWARM_BUILD_ON_NODE  1 = compile here instead of installing (Ascend: the cache can only be completed on a
#                          node with an NPU). The result is packed into PREWARM_SOURCE and, if PREWARM_PUSH
#                          names store URLs, pushed there so the other nodes install it. Run it once per node
#                          (an init container or a systemd unit), not once per rank.
#   PREWARM_REQUIRE_AUTOTUNE  1 = also refuse to start when a kept autotune result is absent (for bundles built
#                          with the manifest's autotune table, or by a `--mode device` build)   (default 0)
#   TRITON_CACHE_AUTOTUNING  exported to verify and the server alike: 1 = every Triton Autotuner reads the results
#                          the bundle ships (Triton keeps none for an autotuner without cache_results otherwise); verify
#                          refuses to start the server when results are shipped that this environment would not
#                          read                                                   (default 1)
#   PREWARM_REQUIRE_LAUNCHERS  1 = also refuse to start when a launcher / helper module the runtime would build
#                          at first launch is absent (Ascend: g++ and torch_npu headers at first launch, or a crash
#                          where the image has none; the npu image sets it)      (default 0)
#   PREWARM_GUARD          the server runs under `prewarm guard`: every Triton compile the cache lacks, in any of
#                          its processes, is logged on stderr with what differs from the plan and recorded.
#                          warn (default) | error (refuse it: for testing a serving image in CI) | off
#   PREWARM_GUARD_RECORD   where those requests are appended, as `prewarm record` lines: add it to the manifest
#                          (`[[kernels]] record = "..."`) and the next build covers them
#                          (default $TRITON_CACHE_DIR/.prewarm/guard.jsonl: every rank of the node, one file)
#   PREWARM_GUARD_ARM      import (default) | manual: the server calls prewarm.guard.arm() after its own warmup
#   PREWARM_METRICS_TEXTFILE  a .prom file in node-exporter's --collector.textfile.directory: the guard's
#                          Prometheus metrics (compiles and autotune benchmarks after arming, per kernel; the
#                          installed bundles), merged there by every guarded process of the node  (default: off)
set -eu

TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/var/cache/triton}"
PREWARM_MANIFEST="${PREWARM_MANIFEST:-/opt/prewarm/src/manifests/kimi-linear-h200.toml}"
PREWARM_SOURCE="${PREWARM_SOURCE:-/opt/prewarm/bundle}"
TRITON_CACHE_AUTOTUNING="${TRITON_CACHE_AUTOTUNING:-1}"  # read at each kernel module's import: set before both
export TRITON_CACHE_AUTOTUNING
if [ "$#" -gt 0 ]; then
    export TRITON_CACHE_DIR  # the server exec'd below reads the dir installed here; one started apart, its own
fi
SERVER=""
if [ -n "${PREWARM_SERVER:-}" ]; then
    SERVER="--server $PREWARM_SERVER"
fi
AUTOTUNE=""
if [ "${PREWARM_REQUIRE_AUTOTUNE:-0}" = 1 ]; then
    AUTOTUNE="--require-autotune"
fi
LAUNCHERS=""
if [ "${PREWARM_REQUIRE_LAUNCHERS:-0}" = 1 ]; then
    LAUNCHERS="--require-launchers"
fi
DOWNGRADE=""
if [ "${PREWARM_ALLOW_DOWNGRADE:-0}" = 1 ]; then
    DOWNGRADE="--allow-downgrade"
fi
UNVERIFIED=""
if [ "${PREWARM_ALLOW_UNVERIFIED:-0}" = 1 ]; then
    UNVERIFIED="--allow-unverified"
fi
TRUST=""
if [ -n "${PREWARM_TRUST:-}" ]; then
    TRUST="--trust $PREWARM_TRUST --require-signature"
fi

# modules past Triton: each bundle into its library's dir, before the Triton cache (verify below checks each dir, in
# the same mode as the Triton cache, and looks every planned module up)
JIT_DIRS=""
for pair in ${PREWARM_JIT_SOURCES:-}; do
    layout="${pair%%=*}"
    source="${pair#*=}"
    case "$layout" in
        sglang-jit)
            SGLANG_JIT_CACHE_DIR="${SGLANG_JIT_CACHE_DIR:-$HOME/.cache/sglang/jit}"
            export SGLANG_JIT_CACHE_DIR
            dir="$SGLANG_JIT_CACHE_DIR" ;;
        flashinfer-aot)
            dir="${PREWARM_FLASHINFER_AOT_DIR:?set PREWARM_FLASHINFER_AOT_DIR to the server's flashinfer package data/aot dir (PREWARM_JIT_SOURCES has flashinfer-aot)}" ;;
        *)
            echo "PREWARM_JIT_SOURCES: '$pair': expected sglang-jit=SOURCE or flashinfer-aot=SOURCE" >&2
            exit 2 ;;
    esac
    # shellcheck disable=SC2086  # TRUST: flags
    prewarm install "$source" --cache-dir "$dir" $TRUST $DOWNGRADE
    JIT_DIRS="$JIT_DIRS --jit-dir $layout=$dir"
done

if [ "${PREWARM_BUILD_ON_NODE:-0}" = 1 ]; then
    prewarm build "$PREWARM_MANIFEST" --cache-dir "$TRITON_CACHE_DIR"
    prewarm pack "$TRITON_CACHE_DIR" -o "$PREWARM_SOURCE"
    if [ -n "${PREWARM_PUSH:-}" ]; then
        # shellcheck disable=SC2086  # a space-separated list of URLs
        prewarm push "$PREWARM_SOURCE" $PREWARM_PUSH
    fi
    prewarm verify --cache-dir "$TRITON_CACHE_DIR" --bundle "$PREWARM_SOURCE" --plan "$PREWARM_MANIFEST" $AUTOTUNE $LAUNCHERS $SERVER $JIT_DIRS
elif [ -n "${PREWARM_TRUST:-}" ]; then
    prewarm install "$PREWARM_SOURCE" --cache-dir "$TRITON_CACHE_DIR" --trust "$PREWARM_TRUST" --require-signature $DOWNGRADE
    prewarm verify --cache-dir "$TRITON_CACHE_DIR" --plan "$PREWARM_MANIFEST" --trust "$PREWARM_TRUST" --require-signature $AUTOTUNE $LAUNCHERS $SERVER $UNVERIFIED $JIT_DIRS
else
    prewarm install "$PREWARM_SOURCE" --cache-dir "$TRITON_CACHE_DIR" $DOWNGRADE
    prewarm verify --cache-dir "$TRITON_CACHE_DIR" --plan "$PREWARM_MANIFEST" $AUTOTUNE $LAUNCHERS $SERVER $JIT_DIRS
fi

PREWARM_GUARD="${PREWARM_GUARD:-warn}"
PREWARM_GUARD_RECORD="${PREWARM_GUARD_RECORD:-$TRITON_CACHE_DIR/.prewarm/guard.jsonl}"
PREWARM_GUARD_PLAN="${PREWARM_GUARD_PLAN:-$PREWARM_MANIFEST}"
export PREWARM_GUARD PREWARM_GUARD_RECORD PREWARM_GUARD_PLAN
mkdir -p "$(dirname "$PREWARM_GUARD_RECORD")"

if [ "$#" -gt 0 ]; then
    exec prewarm guard -- "$@"
fi
