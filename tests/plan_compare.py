"""Is a plan made inside a server's real install the scaffold's plan? (CI's check of the real-install venvs.)

``python tests/plan_compare.py REAL.json SCAFFOLD.json`` reads two ``prewarm plan --json`` outputs of one manifest
(one planned where the server is pip-installed with its dependencies, one in ``.venv`` over ``.ci/setup``'s
assembled trees) and exits 0 when they plan the same work: the same request ids, each the same kernel with the same
arguments (dtype + shape per tensor, every constexpr: its launch specialization) and label, the same compile count
(Triton's own expansion, one per autotune config) and the same JIT modules; else 1, each difference on a line. It
prints one summary line either way (requests, compiles, JIT modules of each).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def plan_differences(real: dict, scaffold: dict, limit: int = 20) -> list[str]:
    """What differs between two ``prewarm plan --json`` outputs (at most ``limit`` request lines); empty when
    equal."""
    out = []
    mine = {r["id"]: r for r in real["requests"]}
    theirs = {r["id"]: r for r in scaffold["requests"]}
    for name, a, b in (("only in the real install's plan", mine, theirs),
                       ("only in the scaffold's plan", theirs, mine)):
        out += [f"{name}: request {i} {a[i]['kernel']} ({a[i]['label']})" for i in sorted(set(a) - set(b))][:limit]
    for i in sorted(set(mine) & set(theirs)):
        for key in ("kernel", "args", "kwargs", "label"):
            if mine[i][key] != theirs[i][key]:
                out.append(f"request {i}: {key} {mine[i][key]!r} (real) != {theirs[i][key]!r} (scaffold)")
                break
    if len(out) > limit:
        out = out[:limit] + [f"... {len(out) - limit} more"]
    if real["counts"]["compiles"] != scaffold["counts"]["compiles"]:
        out.append(f"compiles: {real['counts']['compiles']} (real) != {scaffold['counts']['compiles']} (scaffold)")
    jit = [sorted(j["name"] for j in plan.get("jit", [])) for plan in (real, scaffold)]
    if jit[0] != jit[1]:
        out.append(f"JIT modules: {jit[0]} (real) != {jit[1]} (scaffold)")
    return out


def summary(plan: dict) -> str:
    return f"{len(plan['requests'])} requests, {plan['counts']['compiles']} compiles, {len(plan.get('jit', []))} JIT"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python tests/plan_compare.py REAL.json SCAFFOLD.json (prewarm plan --json outputs)",
              file=sys.stderr)
        return 2
    real, scaffold = (json.loads(Path(p).read_text()) for p in argv)
    differences = plan_differences(real, scaffold)
    print(f"real install: {summary(real)}; scaffold: {summary(scaffold)}; "
          f"{'equal' if not differences else f'{len(differences)} differences'}")
    for line in differences:
        print(f"  {line}")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
