"""Which cache keys does this Triton give a kernel, launched on a GPU or compiled with no GPU (target only)?

Run it on two machines and compare the JSON: the same key dirs mean one's cache serves the other. Used to check that
the device image's torch beside a carried Triton computes the keys of a node that runs that Triton with the server's
own torch (Triton's key does not include torch), and that prewarm's target-only compile (its offline driver, Triton's
own binder through ``warmup``) on the CPU box gives the keys of a real launch. The kernel is toy-sized; its variants cover the specialization classes (an int equal to 1, divisible by
16, other; two constexpr values; fp32 and bf16 pointers).

    python bench/triton_keys.py launch  --out keys-gpu.json     # needs a GPU
    python bench/triton_keys.py compile --out keys-cpu.json     # no GPU: prewarm's offline driver for sm_90
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

VARIANTS = [("float32", 1, 64), ("float32", 48, 64), ("float32", 50, 128), ("bfloat16", 50, 64)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("launch", "compile"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="triton-keys-")
    os.environ["TRITON_CACHE_DIR"] = cache
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def scale(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(x_ptr + offs, x * 2, mask=offs < n)

    for dtype, n, block in VARIANTS:
        if args.mode == "launch":
            x = torch.ones(n, dtype=getattr(torch, dtype), device="cuda")
            scale[(triton.cdiv(n, block),)](x, n, BLOCK=block)
            torch.cuda.synchronize()
        else:  # prewarm's offline path: a target-only driver, Triton's own binder through warmup
            from prewarm.building import tritoncompat
            from prewarm.building.backends.cuda import activate_offline

            activate_offline("sm_90")
            x = tritoncompat.mock_tensor(getattr(torch, dtype), [n])
            tritoncompat.warmup(scale, (x, n), {"BLOCK": block}, grid=(1,))
    entries = {d: sorted(os.listdir(os.path.join(cache, d))) for d in sorted(os.listdir(cache))}
    report = {
        "mode": args.mode, "python": platform.python_version(), "triton": triton.__version__,
        "torch": torch.__version__, "triton_file": triton.__file__,
        "kernel_keys": sorted(d for d, files in entries.items() if any(f.endswith(".cubin") for f in files)),
        "modules": {d: files for d, files in entries.items() if not any(f.endswith(".cubin") for f in files)},
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
