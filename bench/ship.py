"""Ship benchmark: pack, install and verify throughput on a synthetic Triton-like cache, against baselines
measured in the same run on the same bytes (a plain recursive copy; single-core hashlib sha256), plus the time of
a repeated (no-op) install, in-process and as a fresh `prewarm install` process. Prints one JSON document.

    python bench/ship.py [--small] [--out bench/results/ship.json]

The cache mimics Triton's: one key dir (base32 of a sha256) per compile holding .source/.ttir/.ttgir/.llir/.ptx
(text, compressible), .cubin (mostly random: poorly compressible), .json metadata and __grp__<name>.json with
absolute child paths; ~265 KB per entry as measured on the H200 (~300 KB per compile).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_OPS = ["arith.addf", "arith.mulf", "tt.load", "tt.store", "tt.dot", "arith.select", "tt.splat", "tt.broadcast",
        "arith.cmpi slt", "tt.make_range", "tt.addptr", "scf.for", "math.exp", "tt.reduce", "arith.truncf"]


def _text(rng: random.Random, n_bytes: int, flavour: str) -> bytes:
    lines, size = [], 0
    while size < n_bytes:
        line = (f"    %{rng.randrange(1 << 16)} = {rng.choice(_OPS)} %{rng.randrange(4096)}, %{rng.randrange(4096)}"
                f" : tensor<{rng.choice((16, 32, 64, 128))}x{rng.choice(('f32', 'bf16', 'i32'))}> loc(#{flavour}{rng.randrange(999)})\n")
        lines.append(line)
        size += len(line)
    return "".join(lines).encode()[:n_bytes]


def make_cache(root: Path, entries: int, seed: int = 0, scale: float = 1.0) -> int:
    """Write ``entries`` Triton-like key dirs under ``root``; returns the total bytes written."""
    rng = random.Random(seed)
    total = 0
    for i in range(entries):
        key = base64.b32encode(hashlib.sha256(f"{seed}-{i}".encode()).digest()).decode().rstrip("=")
        d = root / key
        d.mkdir(parents=True)
        name = f"kernel_{i % 37}"
        cubin = bytearray(os.urandom(int(rng.randrange(100_000, 170_000) * scale)))
        cubin[:4096] = bytes(4096)  # ELF header and tables compress a little, the code does not
        files = {
            f"{name}.source": _text(rng, int(2_000 * scale), "src"),
            f"{name}.ttir": _text(rng, int(10_000 * scale), "ttir"),
            f"{name}.ttgir": _text(rng, int(15_000 * scale), "ttgir"),
            f"{name}.llir": _text(rng, int(35_000 * scale), "llir"),
            f"{name}.ptx": _text(rng, int(60_000 * scale), "ptx"),
            f"{name}.cubin": bytes(cubin),
            f"{name}.json": json.dumps({"name": name, "num_warps": 4, "num_stages": 3, "hash": key,
                                        "target": {"backend": "cuda", "arch": 90, "warp_size": 32},
                                        "shared": rng.randrange(1 << 16)}).encode(),
        }
        files[f"__grp__{name}.json"] = json.dumps({"child_paths": {n: str(d / n) for n in files}}).encode()
        for n, data in files.items():
            (d / n).write_bytes(data)
            total += len(data)
    return total


def _timed(fn):
    os.sync()  # start each measurement clean: nobody pays for the previous step's writeback
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _best(n: int, fn):
    """Fastest of ``n`` runs (``fn(i)``): the box is shared, so the minimum is the least disturbed figure."""
    runs = [_timed(lambda: fn(i)) for i in range(n)]
    return min(runs, key=lambda r: r[0])


def sha256_tree(root: Path) -> int:
    n = 0
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb", buffering=0) as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    n += len(chunk)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a quick check: 200 entries, ~50 MB")
    ap.add_argument("--entries", type=int)
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--workdir", help="where to build (default: a temp dir); same filesystem for all steps")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the fastest counts")
    args = ap.parse_args()
    entries = args.entries or (200 if args.small else 2000)

    from prewarm import fingerprint
    from prewarm.install import install
    from prewarm.pack import pack
    from prewarm.verify import verify

    work = Path(tempfile.mkdtemp(prefix="prewarm-ship-", dir=args.workdir))
    try:
        cache = work / "cache"
        size = make_cache(cache, entries)
        files = sum(1 for p in cache.rglob("*") if p.is_file())
        fingerprint.current()  # warm: torch import and triton_key are paid once per process, not per stage
        mb = size / 1e6

        n = args.repeat
        t_pack, packed = _best(n, lambda i: pack(cache, work / f"bundle{i}"))
        bundle = str(work / "bundle0")
        # interleaved pairs (baseline, ours), so that a burst of load from other users hits both sides alike
        copies, installs, shas, verifies = [], [], [], []
        for i in range(n):
            copies.append(_timed(lambda: shutil.copytree(cache, work / f"copy{i}")))
            installs.append(_timed(lambda: install(bundle, work / f"node{i}")))
        for i in range(n):
            shas.append(_timed(lambda: sha256_tree(cache)))
            verifies.append(_timed(lambda: verify(work / "node0")))
        (t_copy, _), (t_inst, inst), (t_sha, hashed), (t_ver, rep) = (
            min(r, key=lambda x: x[0]) for r in (copies, installs, shas, verifies))
        assert inst.installed == entries and hashed == size
        assert rep.ok and rep.bytes_hashed == packed.bytes_in, rep.to_json()
        t_noop, noop = _best(n, lambda i: install(bundle, work / "node0"))
        assert noop.noop
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "prewarm.cli", "install", bundle, "--cache-dir", str(work / "node0")],
                       check=True, capture_output=True)
        t_noop_cli = time.perf_counter() - t0

        copy_rate, sha_rate = mb / t_copy, mb / t_sha
        result = {
            "cache": {"entries": entries, "files": files, "bytes": size,
                      "bundle_bytes": packed.bytes_out, "compression_ratio": round(size / packed.bytes_out, 3)},
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "load_avg_1m": os.getloadavg()[0],
                        "runs_per_measurement": n},
            "baseline": {"copy_mb_s": round(copy_rate, 1), "sha256_single_core_mb_s": round(sha_rate, 1)},
            "pack": {"seconds": round(t_pack, 3), "mb_s": round(mb / t_pack, 1), "vs_copy": round(t_copy / t_pack, 3)},
            "install": {"seconds": round(t_inst, 3), "mb_s": round(mb / t_inst, 1),
                        "vs_copy": round(t_copy / t_inst, 3), "target_vs_copy": 0.5, "durable_sync": True},
            "verify": {"seconds": round(t_ver, 3), "mb_s": round(mb / t_ver, 1),
                       "vs_sha256": round(t_sha / t_ver, 3), "target_vs_sha256": 0.8},
            "noop_install": {"in_process_seconds": round(t_noop, 4), "target_seconds": 0.5,
                             "fresh_cli_process_seconds": round(t_noop_cli, 3)},
        }
        result["targets_met"] = {
            "install": result["install"]["vs_copy"] >= 0.5,
            "verify": result["verify"]["vs_sha256"] >= 0.8,
            "noop_install": t_noop < 0.5,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
