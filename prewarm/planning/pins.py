"""Autotune pins: one reviewed config per kernel and device, for a Triton that keeps no autotune results.

triton-ascend 3.2's Autotuner has no result cache: every serving process benchmarks every candidate at its first
call of each tuning key, on every node (the stall of ``../shared/docs/user-report.txt``), and no cache can ship a
winner it would read. A ``[[pinned]]`` row of the manifest's autotune table (``[target] tuned``; its ``[[tuned]]``
rows and the result files built from them are :mod:`prewarm.building.autotune`'s) names the config instead: the plan compiles
that config alone (``prewarm.planning.plan.expand``) and the guard gives the kernel's Autotuner that config alone before its
first call in every serving process (:func:`pin_chooser` for ``tritoncompat.pin_autotuners``), so it never
benchmarks. This module imports nothing of the planner: the plan reads pins, and the autotune module plans.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..building import tritoncompat
from ..errors import ManifestError

PIN_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")  # a pinned config's triton.Config options


@dataclass(frozen=True)
class PinnedRow:
    """One kernel's config on one device, chosen by hand (``source``: where from; ``reason``: why, where it is a
    choice): its Autotuner runs this config alone, for every tuning key."""

    device: str
    kernel: str
    config: dict  # the meta-parameters its configs set, and PIN_OPTIONS, as triton.Config takes them
    source: str
    reason: str = ""

    def triton_config(self):
        from triton import Config

        options = {k: v for k, v in self.config.items() if k in PIN_OPTIONS}
        return Config({k: v for k, v in self.config.items() if k not in PIN_OPTIONS}, **options)

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.config.items())


_PIN_KEYS = ("device", "kernel", "config", "source", "reason")


def parse_pins(path: Path, rows: Any) -> list[PinnedRow]:
    """The ``[[pinned]]`` rows, checked (ManifestError naming the file, the row and the key)."""
    if not isinstance(rows, list):
        raise ManifestError(f"{path}: pinned: expected an array of [[pinned]] tables")
    out: list[PinnedRow] = []
    for i, row in enumerate(rows):
        where = f"{path}: pinned[{i}]"
        if not isinstance(row, dict):
            raise ManifestError(f"{where} = {row!r}: expected a table")
        unknown = sorted(set(row) - set(_PIN_KEYS))
        if unknown:
            raise ManifestError(f"{where}.{unknown[0]}: no such key (known: {', '.join(_PIN_KEYS)})")
        for key in ("device", "kernel", "source"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise ManifestError(f"{where}.{key} = {row.get(key)!r}: expected a non-empty string"
                                    + (" saying where the choice comes from" if key == "source" else ""))
        if not isinstance(row.get("reason", ""), str):
            raise ManifestError(f"{where}.reason = {row['reason']!r}: expected a string")
        config = row.get("config")
        if not isinstance(config, dict) or not config:
            raise ManifestError(f"{where}.config = {config!r}: expected a table of the kernel's meta-parameters and "
                                f"{', '.join(PIN_OPTIONS)}, e.g. {{ BS = 64, num_warps = 4, num_stages = 3 }}")
        for name, value in config.items():
            scalar = isinstance(value, (bool, int, float, str)) and not (name in PIN_OPTIONS and (
                isinstance(value, bool) or not isinstance(value, int)))
            if not scalar:
                raise ManifestError(f"{where}.config.{name} = {value!r}: expected "
                                    + ("an int" if name in PIN_OPTIONS else "a number, a bool or a string"))
        if any((r.device, r.kernel) == (row["device"], row["kernel"]) for r in out):
            raise ManifestError(f"{where}: a second pin for device {row['device']!r}, kernel {row['kernel']}: "
                                f"expected one pinned config per device and kernel")
        out.append(PinnedRow(row["device"], row["kernel"], dict(config), row["source"], row.get("reason", "")))
    return out


def load_table(path: Path) -> dict:
    """The autotune table at ``path`` as TOML (ManifestError naming the file where it cannot be read or parsed)."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ManifestError(f"{path}: cannot read the autotune table: {e.strerror}") from e
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: not valid TOML: {e}") from e


def read_pins(path: Path) -> list[PinnedRow]:
    """The ``[[pinned]]`` rows of the autotune table at ``path`` (its other rows are prewarm.building.autotune's)."""
    return parse_pins(path, load_table(path).get("pinned", []))


def pinned_config(tuner, pin: PinnedRow):
    """The pin as the triton.Config ``tuner`` is to run; ManifestError (exit 3) where it does not fit the kernel:
    another set of meta-parameters than its configs set, or options this Triton's Config does not take."""
    names = sorted({k for c in tuner.configs for k in c.kwargs})
    pinned = sorted(k for k in pin.config if k not in PIN_OPTIONS)
    where = f"autotune pin of {pin.kernel} for {pin.device} ({pin.config})"
    if pinned != names:
        raise ManifestError(f"{where}: sets meta-parameters {pinned}, but the kernel's configs set {names}: expected "
                            f"a value for each of those, and num_warps / num_stages / num_ctas / maxnreg")
    try:
        return pin.triton_config()
    except TypeError as e:
        raise ManifestError(f"{where}: this Triton's Config refuses it: {e}") from e


def pin_chooser(pins: dict[str, PinnedRow]):
    """``choose(tuner)`` for :func:`prewarm.building.tritoncompat.pin_autotuners`: the pinned config of the tuner's kernel,
    None where it is not pinned (it keeps its configs) or the pin does not fit (said on stderr; it benchmarks)."""
    import sys

    def choose(tuner):
        pin = pins.get(tritoncompat.kernel_ref(tuner))
        if pin is None:
            return None
        try:
            return pinned_config(tuner, pin)
        except ManifestError as e:
            print(f"prewarm guard: not pinned: {e}", file=sys.stderr)
            return None

    return choose
