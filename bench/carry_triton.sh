#!/usr/bin/env bash
# Carries a Triton release the device machine's image lacks (Triton 3.8.0: 248 MB as a wheel, over one device call's
# 64 MiB) as a slim tree split into parts, one part per device call while the machine stays warm.
#
#   here:   bash bench/carry_triton.sh pack [VERSION [MB]]   # -> .carry/triton-VERSION/part-NN + SHA256SUMS (MB-sized parts, 44)
#   device: bash bench/carry_triton.sh receive PART          # each call carries one part (`carry`): kept in /tmp there
#   device: bash bench/carry_triton.sh unpack VERSION SITE   # after the last part: joined, sha256 checked, unpacked
#
# The machine stays warm 30 s after a call: send the calls back to back; a machine that went back lost /tmp.
#
# The slim tree is the cp312 manylinux wheel with what a CUDA node never loads left out: CUPTI (profiling), the
# Blackwell ptxas (sm_100+ only; sm_90 compiles with `ptxas`), nvdisasm, proton's library and instrumentation's test
# library. Nothing Triton hashes into its key is left out: `triton_key()` hashes every Python module under
# compiler/ and backends/ (the AMD backend's .py files included), language/ and libtriton.so; the CUDA backend's hash
# is `ptxas --version` (the same binary). The dist-info stays (prewarm reads Triton's version from it).
# Triton's key does not include torch: the device image's torch beside the carried Triton computes a node's keys.
set -euo pipefail
cd "$(dirname "$0")/.."
verb=${1:-}
case $verb in
  pack)
    version=${2:-3.8.0}
    part_mb=${3:-44}  # a call carries 64 MiB with the working tree: smaller parts leave room for bundles
    dir=.carry/triton-$version
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$work" "triton==$version"
    (cd "$work" && unzip -q triton-*.whl -x 'triton/backends/nvidia/lib/cupti*' 'triton/backends/nvidia/bin/ptxas-blackwell' \
      'triton/backends/nvidia/bin/nvdisasm' 'triton/_C/libproton.so' 'triton/instrumentation/*.so' && rm triton-*.whl)
    rm -rf "$dir" && mkdir -p "$dir"
    tar -C "$work" -cf - . | zstd -q -19 -T0 -o "$dir/triton.tar.zst"
    (cd "$dir" && split -b ${part_mb}m -d triton.tar.zst part- && sha256sum triton.tar.zst part-* > SHA256SUMS && rm triton.tar.zst)
    ls -l "$dir"
    ;;
  receive)
    part=${2:?part path}
    mkdir -p /tmp/prewarm-carry
    cp "$part" /tmp/prewarm-carry/
    cp "$(dirname "$part")/SHA256SUMS" /tmp/prewarm-carry/
    (cd /tmp/prewarm-carry && grep " $(basename "$part")\$" SHA256SUMS | sha256sum -c -)
    ;;
  unpack)
    version=${2:?version}
    site=${3:?site dir}
    dir=/tmp/prewarm-carry
    (cd "$dir" && cat part-* > triton.tar.zst && sha256sum -c SHA256SUMS)
    mkdir -p "$site"
    # the device image has no zstd binary for sure: Python's zstandard (carried in .whl/ with prewarm's other needs)
    python3 -c 'import sys, tarfile, zstandard
with open(sys.argv[1], "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as r:
    tarfile.open(fileobj=r, mode="r|").extractall(sys.argv[2], filter="tar")' "$dir/triton.tar.zst" "$site"
    rm -f "$dir/triton.tar.zst"
    PYTHONPATH=$site python3 -c "import triton; print('carried triton', triton.__version__, 'from', triton.__file__)"
    ;;
  *)
    echo "usage: bash bench/carry_triton.sh pack [VERSION [MB]] | receive PART | unpack VERSION SITE" >&2
    exit 2
    ;;
esac
