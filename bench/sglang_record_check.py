"""Recordings that check themselves, on the H200: does every process that keys sglang's KDA kernels compute the key
the serving process computed, and where one does not, which part of the key differs?

    python3 bench/sglang_record_check.py [--manifest manifests/kimi-linear-h200-sglang.toml] [--seed 1] [--calls 60]
    python3 bench/sglang_record_check.py --plan-only RECORDING [--mode offline]      (the build box: no GPU needed)

On the GPU node:
1. a fresh "server" process under ``prewarm record`` runs ``--calls`` seeded calls of sglang's ``TritonKDAKernel``
   (``traffic.sglang_cuda``: written from sglang's call sites, not from the planner's provider) within
   the manifest's envelope on cuda:0, with an empty TRITON_CACHE_DIR; each record line carries the key that
   process's Triton computed, the key's parts and the device;
2. the recorded keys are checked against the key dirs that process compiled into (``server_keys_match``);
3. a record-only manifest of the recording (no ``[target] device``: it takes the recorded device) is planned in a
   fresh ``prewarm plan --compiles --json`` process per ``--mode`` (device: as ``verify --plan`` runs on the node;
   offline: as a build box plans): every recorded key must be reproduced, and each one that is not is listed with
   the parts that differ (``prewarm.building.keys``: a global the kernel reads, an option, an env var, ptxas, a line).
The recording is kept beside ``--out`` (``.jsonl``); ``--plan-only`` runs step 3 on it elsewhere (the CPU box).
Writes ``{"recorded", "server_keys_match", "device", "plan": {MODE: {"exit_code", "compiles", "drifted",
"parts", "key_drift"}}}``; exits 1 where the server's keys were not recorded or a mode reproduced fewer than all.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO, bench_parser, child_env, child_main, fresh_dir, init_device, load_spec, log, result_header, run_calls,
    run_cli, write_json,
)

DEFAULT_SGLANG_MANIFEST = REPO / "manifests" / "kimi-linear-h200-sglang.toml"
RECORD_ONLY = '[target]\nbackend = "cuda"\narch = "{arch}"\n\n[[kernels]]\nrecord = "{record}"\n'


def child(args) -> dict:
    """The recorded server: sglang's backend API on the GPU. sglang's CUDA JIT packed decode is skipped (a no-op): it is
    C++ with no Triton key, and building it needs the serving stack the device does not carry."""
    torch = init_device()
    from prewarm.providers.sglang.common import jit_skipped
    from traffic.sglang_cuda import calls

    with jit_skipped() as skipped:
        labels = run_calls(calls(load_spec(Path(args.manifest)), args.seed, args.calls, "cuda"), args.calls, None,
                           torch.cuda.synchronize)
    return {"calls": len(labels), "jit_skipped": len(skipped)}


def plan_modes(recording: Path, arch: str, modes: list[str], work: Path, timeout: float) -> dict:
    """Step 3: the recording's record-only manifest planned in a fresh process per mode; the recorded keys each
    reproduces or not, with the differing parts."""
    manifest = work / "recorded.toml"
    manifest.write_text(RECORD_ONLY.format(arch=arch, record=recording.resolve()))
    out = {}
    for mode in modes:
        cmd = [sys.executable, "-m", "prewarm.cli", "plan", "--compiles", "--json", "--mode", mode, str(manifest)]
        log("$ prewarm " + " ".join(cmd[3:]))
        done = subprocess.run(cmd, cwd=REPO, env=child_env(work), capture_output=True, text=True, timeout=timeout)
        try:
            doc = json.loads(done.stdout)
        except ValueError:
            out[mode] = {"exit_code": done.returncode, "error": done.stderr[-3000:]}
            continue
        drift = doc.get("key_drift", [])
        parts = Counter(f"{d['kind']} {d['name']}" for x in drift for d in x["differences"])
        out[mode] = {"exit_code": done.returncode, "compiles": len(doc.get("compiles", [])), "drifted": len(drift),
                     "parts": dict(parts.most_common()), "key_drift": drift}
        log(f"{mode}: {len(drift)} of {len(doc.get('compiles', []))} recorded keys not reproduced"
            + "".join(f"\n  {n} x {part}" for part, n in parts.most_common()))
    return out


def main() -> int:
    p = bench_parser(__doc__, "sglang_record_check", DEFAULT_SGLANG_MANIFEST)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--calls", type=int, default=60, help="server calls to record (a mix of every path)")
    p.add_argument("--mode", action="append", choices=("device", "offline"),
                   help="the plan modes of step 3 (default: device and offline; --plan-only: offline)")
    p.add_argument("--plan-only", metavar="RECORDING", help="only step 3, on a recording made elsewhere")
    p.add_argument("--arch", default="sm_90")
    args = p.parse_args()
    if args.child:
        return child_main(child, args)
    from prewarm.planning.record import read

    work = fresh_dir(Path(args.work_dir) / "sglang-record-check")
    out = {**result_header(Path(args.manifest)), "seed": args.seed, "calls": args.calls}
    if args.plan_only:
        recording = work / "recording.jsonl"
        shutil.copyfile(args.plan_only, recording)
        out["recording"] = str(args.plan_only)
    else:
        recording, server = work / "recording.jsonl", work / "server-cache"
        t0 = time.perf_counter()
        run_cli(["record", "-o", str(recording), "--", sys.executable, str(Path(__file__).resolve()), "--child",
                 "--manifest", args.manifest, "--seed", str(args.seed), "--calls", str(args.calls), "--result",
                 str(work / "child.json")], child_env(work, TRITON_CACHE_DIR=str(server)), args.timeout)
        out["record_s"] = round(time.perf_counter() - t0, 2)
        kept = Path(args.out).with_suffix(".jsonl")
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(recording, kept)
        out["recording"] = str(kept)
        compiled = {d.name for d in server.iterdir() if d.is_dir()}
        recorded = {line.key.key for line in read(recording) if line.key is not None and line.key.key}
        out["server_keys_match"] = recorded <= compiled
        out["recorded_keys_not_compiled_by_the_server"] = sorted(recorded - compiled)
    lines = read(recording)
    out["recorded"] = len(lines)
    out["with_key"] = sum(line.key is not None and bool(line.key.key) for line in lines)
    out["key_errors"] = sorted({line.key.error for line in lines if line.key is not None and line.key.error})
    out["device"] = next((line.device for line in lines if line.device), None)
    modes = args.mode or (["offline"] if args.plan_only else ["device", "offline"])
    out["plan"] = plan_modes(recording, args.arch, modes, work, args.timeout)
    write_json(args.out, out)
    bad = out.get("server_keys_match") is False or out["with_key"] < out["recorded"] or any(
        m.get("drifted", 1) or m["exit_code"] not in (0,) for m in out["plan"].values())
    log(f"{'PROBLEM' if bad else 'ok'}: {out['recorded']} recorded, {out['with_key']} with a key; "
        + ", ".join(f"{mode}: {m.get('drifted', '?')} not reproduced" for mode, m in out["plan"].items())
        + f" -> {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
