"""One verdict everywhere: will-hit of one installed cache in device mode and in offline mode, on the GPU node.

    python3 bench/verdict.py --bundle BUNDLE --manifest MANIFEST [--out JSON]

Installs BUNDLE into a fresh node dir, then runs ``prewarm.node.willhit.check`` on it twice, each in a fresh process:
``--mode device`` (the node's real driver, as the pre-launch job's verify runs there) and ``--mode offline`` (the
target-only driver a build box uses). Both must compute the same key for every planned compile and give the same
hit / miss. Writes ``{"same", "device": {...}, "offline": {...}, "differences": [...]}``; exits 1 when they differ.
Found on the H200 (2026-12-01): a fresh process's device-mode check named the cuda_utils key for kernels and
computed other keys for sglang's inter_solve kernel than the server does (``prewarm.building.backends.cuda.start_driver``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    bench_parser, child_env, child_main, fresh_dir, install_bundle, log, run_child, write_json,
)


def child(args) -> dict:
    from prewarm.node.willhit import check

    report = check(args.manifest, args.cache_dir, args.mode)
    return {"mode": args.mode, "target": report.target, "hits": report.hits, "misses": report.misses,
            "results": [{"label": r.label, "key": r.key, "hit": r.hit, "detail": r.detail} for r in report.results]}


def main() -> int:
    p = bench_parser(__doc__, "verdict")
    p.add_argument("--bundle", help="a `prewarm pack` dir built from --manifest (e.g. on a CPU box)")
    p.add_argument("--mode", default="device", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.child and not args.bundle:
        p.error("--bundle is required")
    if args.child:
        return child_main(child, args)
    work = Path(args.work_dir)
    node = fresh_dir(work / "verdict-node")
    install_bundle(Path(args.bundle).resolve(), node, work)
    env = child_env(work)
    runs = {}
    for mode in ("device", "offline"):
        log(f"will-hit in {mode} mode")
        runs[mode] = run_child(Path(__file__), ["--child", "--mode", mode, "--manifest", args.manifest, "--cache-dir",
                                                str(node)], env, work / f"verdict-{mode}.json", args.timeout)
    pairs = zip(runs["device"]["results"], runs["offline"]["results"])
    differences = [{"label": d["label"], "device": [d["key"], d["hit"]], "offline": [o["key"], o["hit"]],
                    "device_detail": d["detail"]} for d, o in pairs if (d["key"], d["hit"]) != (o["key"], o["hit"])]
    same = not differences and len(runs["device"]["results"]) == len(runs["offline"]["results"])
    write_json(args.out, {"same": same, "differences": differences,
                          **{m: {k: v for k, v in r.items() if k != "results"} for m, r in runs.items()}})
    log(f"device {runs['device']['hits']} hit / {runs['device']['misses']} miss, offline {runs['offline']['hits']} "
        f"hit / {runs['offline']['misses']} miss: {'the same verdict' if same else f'{len(differences)} differ'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
