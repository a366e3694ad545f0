"""The requirements a wheel declares for a plain install (its METADATA's Requires-Dist, minus those of an extra), one a
line, with named replacements: what `pip install WHEEL` asks for, for a release one of whose pins the package index
cannot satisfy (.ci/setup: vLLM 0.34.0 pins flashinfer-python==0.7.3, which is not on the index).

    python .ci/requires.py WHEEL [--replace OLD NEW]... > requirements.txt

OLD must be one of the wheel's requirements as its METADATA spells it (exit 1 otherwise), so that a new release's
pins are looked at again rather than replaced unseen.
"""
from __future__ import annotations

import argparse
import sys
import zipfile
from email.parser import HeaderParser

from packaging.requirements import Requirement


def requires(wheel: str) -> list[str]:
    """The wheel's Requires-Dist lines that no extra guards."""
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        lines = HeaderParser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
    return [line for line in lines if not (Requirement(line).marker and "extra" in str(Requirement(line).marker))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel")
    ap.add_argument("--replace", nargs=2, action="append", default=[], metavar=("OLD", "NEW"))
    args = ap.parse_args()
    lines = requires(args.wheel)
    for old, new in args.replace:
        if old not in lines:
            same = [line for line in lines if Requirement(line).name == Requirement(old).name]
            sys.exit(f"{args.wheel}: no requirement {old!r} to replace (of that name it has: {same or 'none'})")
        lines[lines.index(old)] = new
    print("\n".join(lines))


if __name__ == "__main__":
    main()
