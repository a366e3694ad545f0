"""The guard's metrics, the Prometheus way: a file for node-exporter's textfile collector.

    PREWARM_METRICS_TEXTFILE=DIR/prewarm.prom   DIR: node-exporter's --collector.textfile.directory on the node

    prewarm_guard_compiles_total{kernel}                 compiles the cache lacked after the guard was armed
                                                         (warn: compiled; error: refused), every process of the node
    prewarm_guard_autotune_benchmarks_total{kernel}      autotune benchmark runs after arming
    prewarm_guard_jit_builds_total{kernel}               builds of a module past Triton after arming (kernel:
                                                         "library:module", e.g. "sglang:sgl_kernel_jit_...",
                                                         "flashinfer:sampling"; warn: built; error: refused)
    prewarm_installed_bundle_info{cache_dir,bundle,digest} 1   one per bundle installed in a cache dir a guarded
                                                         process uses (bundle: its manifest's name; digest: the
                                                         sha256 of its index, what `prewarm pack` prints)

Why a file and not a port: the guard runs inside every Python process of the server (the launcher, each rank's
scheduler and workers, short-lived helpers); one port can be bound by one of them only, and the one holding it may
exit while another compiles. Every process instead merges its counts into the one file under a file lock (read
it, add, write the whole file to a temp file and rename it: prometheus_client's ``write_to_textfile``), so the
counts of every process of every pod on the node add up, outlive the process that made them (a rank that compiled
then crashed still shows), and node-exporter, already on each node a fleet watches, exports them with the node's
labels. Counters only grow while the file lives; Prometheus' ``increase()`` reads them as it reads any counter.

The file is written from the compile path, never on a launch that hits; a failure to write it (no such dir, lock
held too long) is said on stderr and the server goes on.
"""
from __future__ import annotations

import os
import sys

TEXTFILE = "PREWARM_METRICS_TEXTFILE"
COMPILES = "prewarm_guard_compiles"
BENCHMARKS = "prewarm_guard_autotune_benchmarks"
JIT_BUILDS = "prewarm_guard_jit_builds"
COUNTERS = (COMPILES, BENCHMARKS, JIT_BUILDS)
BUNDLES = "prewarm_installed_bundle_info"
_HELP = {
    COMPILES: "Triton compiles the cache lacked after the prewarm guard was armed (warn: compiled, error: refused)",
    BENCHMARKS: "Triton autotune benchmark runs after the prewarm guard was armed",
    JIT_BUILDS: "Builds of a module past Triton (sglang JIT, FlashInfer) after the prewarm guard was armed",
    BUNDLES: "Bundles installed in a Triton cache dir a guarded process uses (1 per bundle)",
}
_BUNDLE_LABELS = ("cache_dir", "bundle", "digest")
LOCK_TIMEOUT = 10.0  # seconds; past that this update is skipped (and said), the server is not held up longer


def textfile() -> str | None:
    """The file metrics go to, or None (off: unset, or not a ``.prom`` file, which node-exporter would not read)."""
    path = os.environ.get(TEXTFILE, "").strip()
    if path and not path.endswith(".prom"):
        print(f"prewarm metrics: {TEXTFILE}={path!r} does not end in .prom (node-exporter's textfile collector "
              "reads only those): metrics are off", file=sys.stderr)
        return None
    return path or None


def count(metric: str, kernel: str) -> None:
    """One more ``metric`` (one of COUNTERS) for ``kernel`` ("module:qualname"; a JIT build: "library:module"),
    merged into the file."""
    def add(counts, bundles):
        per_kernel = counts.setdefault(metric, {})
        per_kernel[kernel] = per_kernel.get(kernel, 0.0) + 1

    _update(add)


def installed_bundles(cache_dir: str) -> None:
    """Set the bundle series of ``cache_dir`` to what its install receipts say now (other dirs' series kept)."""
    from ..shipping.cachedir import CacheDir

    try:
        current = {(cache_dir, (r.index.manifest or {}).get("name", ""), r.index.digest)
                   for r in CacheDir(cache_dir).receipts(strict=False)}
    except OSError as e:
        print(f"prewarm metrics: cannot read the install receipts of {cache_dir}: {e}", file=sys.stderr)
        return

    def replace(counts, bundles):
        bundles.difference_update({b for b in bundles if b[0] == cache_dir})
        bundles.update(current)

    _update(replace)


def read(path: str) -> tuple[dict[str, dict[str, float]], set[tuple[str, str, str]]]:
    """The counts ({metric: {kernel: value}}) and bundle series a metrics file holds (Prometheus' own parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, dict[str, float]] = {}
    bundles: set[tuple[str, str, str]] = set()
    try:
        text = open(path, encoding="utf-8").read()
    except FileNotFoundError:
        return counts, bundles
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name in COUNTERS and sample.name == family.name + "_total":
                counts.setdefault(family.name, {})[sample.labels["kernel"]] = sample.value
            elif family.name == BUNDLES and sample.value == 1:
                bundles.add(tuple(sample.labels[k] for k in _BUNDLE_LABELS))
    return counts, bundles


class _Snapshot:
    """A collector that yields the merged state (a private registry: the server's own prometheus_client metrics,
    and its global settings, are not touched)."""

    def __init__(self, counts, bundles):
        self.counts, self.bundles = counts, bundles

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name in COUNTERS:
            family = CounterMetricFamily(name, _HELP[name], labels=["kernel"])
            for kernel, value in sorted(self.counts.get(name, {}).items()):
                family.add_metric([kernel], value)
            yield family
        family = GaugeMetricFamily(BUNDLES, _HELP[BUNDLES], labels=list(_BUNDLE_LABELS))
        for labels in sorted(self.bundles):
            family.add_metric(list(labels), 1)
        yield family


def _update(change) -> None:
    """Read the file, apply ``change(counts, bundles)``, write it whole: under the file's lock, never raising."""
    path = textfile()
    if path is None:
        return
    try:
        from filelock import FileLock, Timeout
        from prometheus_client import CollectorRegistry, write_to_textfile
    except ImportError as e:
        print(f"prewarm metrics: {e}: metrics are off (pip install prometheus-client)", file=sys.stderr)
        return
    try:
        with FileLock(path + ".lock", timeout=LOCK_TIMEOUT):
            try:
                counts, bundles = read(path)
            except (ValueError, KeyError, OSError) as e:  # not ours, or damaged: start again, and say so
                print(f"prewarm metrics: {path} is unreadable ({e}): rewriting it", file=sys.stderr)
                counts, bundles = {}, set()
            change(counts, bundles)
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Snapshot(counts, bundles))
            write_to_textfile(path, registry)
    except Timeout:
        print(f"prewarm metrics: {path}.lock held for {LOCK_TIMEOUT:.0f} s: this update is skipped", file=sys.stderr)
    except OSError as e:
        print(f"prewarm metrics: cannot write {path}: {e}", file=sys.stderr)
