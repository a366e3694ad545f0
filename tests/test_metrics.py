"""Guard metrics: a real guarded "server" (tests/fixtures/prewarm_toy/guarded_app.py, real Triton compiles through a
target-only driver) runs under `prewarm guard` with PREWARM_METRICS_TEXTFILE; the file is read back with
prometheus_client's own parser, as node-exporter's textfile collector would serve it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from prewarm.shipping.install import install  # noqa: E402
from prewarm.shipping.pack import pack  # noqa: E402
from prewarm.shipping.scan import scan  # noqa: E402
from prewarm_helpers import copy_cache  # noqa: E402

REPO = FIXTURES.parents[1]
PLANNED = "float32,float32,1000,64"  # the app's own launch of the planned call
BF16_Y = "float32,bfloat16,1000,64"  # not planned: y in bf16
KERNEL = "prewarm_toy.kernels:add_kernel"


@pytest.fixture(scope="module")
def node(toy_cache_master, tmp_path_factory) -> tuple[Path, tuple[str, str]]:
    """A node's cache installed from a bundle of the real toy cache (it holds the app's planned call), and the
    (bundle, digest) `prewarm ls` reports for it."""
    tmp = tmp_path_factory.mktemp("metrics")
    pack(toy_cache_master, tmp / "bundle")
    install(str(tmp / "bundle"), tmp / "cache")
    (installed,) = scan(tmp / "cache").bundles
    return tmp / "cache", (installed.manifest, installed.index_digest)


def serve(cache: Path, textfile: Path, *calls: str, mode: str = "warn",
          command: list[str] | None = None) -> subprocess.CompletedProcess:
    """The app (or ``command``) under `prewarm guard --metrics-textfile`, in fresh processes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env.update(TRITON_CACHE_DIR=str(cache), PYTHONPATH=str(FIXTURES))
    command = command or [sys.executable, "-m", "prewarm_toy.guarded_app", *calls]
    return subprocess.run([sys.executable, "-m", "prewarm.cli", "guard", "--mode", mode, "--metrics-textfile",
                           str(textfile), "--", *command], env=env, capture_output=True, text=True, timeout=300)


def exported(textfile: Path) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}} from the file, through Prometheus' exposition parser."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(textfile.read_text()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_compiles_after_ready_are_counted_per_kernel_across_processes_and_runs(node, tmp_path):
    cache, (name, digest) = node
    textfile = tmp_path / "textfile" / "prewarm.prom"
    textfile.parent.mkdir()
    cache = copy_cache(cache, tmp_path / "cache")  # warn mode compiles into it

    bundle = (("bundle", name), ("cache_dir", str(cache)), ("digest", digest))
    # the planned call is a disk hit (not counted); two uncovered calls compile, one of them in a child process
    p = serve(cache, textfile, PLANNED, BF16_Y, "child:float32,float32,4096,128")
    assert p.returncode == 0 and p.stdout.count("compiles=1") == 2, p.stdout + p.stderr
    metrics = exported(textfile)
    assert metrics["prewarm_guard_compiles_total"] == {(("kernel", KERNEL),): 2.0}
    assert metrics["prewarm_installed_bundle_info"] == {bundle: 1.0}

    p = serve(cache, textfile, "float16,float32,1000,64", mode="error")  # later, refused: counted and added up
    assert p.returncode != 0 and "UncoveredCompile" in p.stderr
    metrics = exported(textfile)
    assert metrics["prewarm_guard_compiles_total"] == {(("kernel", KERNEL),): 3.0}
    assert metrics["prewarm_installed_bundle_info"] == {bundle: 1.0}


def test_an_autotune_benchmark_after_ready_is_counted(tmp_path):
    """tests/fixtures/prewarm_toy/tuned_app.py calls an autotuned kernel whose result no cache holds: the guard's
    autotune detection sees the Autotuner start benchmarking and the metrics count it for that kernel."""
    textfile = tmp_path / "prewarm.prom"
    p = serve(tmp_path / "empty-cache", textfile, command=[sys.executable, "-m", "prewarm_toy.tuned_app", "1000"])
    assert p.returncode == 0 and "benchmarks=1" in p.stdout, p.stdout + p.stderr
    metrics = exported(textfile)
    assert metrics["prewarm_guard_autotune_benchmarks_total"] == {(("kernel", "prewarm_toy.kernels:gain_kernel"),): 1.0}
    assert metrics.get("prewarm_installed_bundle_info", {}) == {}  # nothing installed in that cache dir


def test_a_textfile_node_exporter_would_not_read_is_refused_and_the_process_runs(node, tmp_path):
    cache, _ = node
    program = "import triton, prewarm.node.guard as g; g.autotune_benchmarked('m:k'); print('ran')"
    p = serve(cache, tmp_path / "prewarm.txt", command=[sys.executable, "-c", program])
    assert p.returncode == 0 and "ran" in p.stdout, p.stderr
    assert "does not end in .prom" in p.stderr and not (tmp_path / "prewarm.txt").exists()


def test_the_kubernetes_server_writes_its_metrics_where_node_exporter_reads_them():
    """deploy/k8s-init-container.yaml: the server's PREWARM_METRICS_TEXTFILE is a .prom file on a hostPath volume
    (node-exporter's textfile dir on the node), the path the comment tells node-exporter to read."""
    text = (REPO / "deploy" / "k8s-init-container.yaml").read_text()
    pod = yaml.safe_load(text)["spec"]
    server = pod["containers"][0]
    path = {e["name"]: e["value"] for e in server["env"]}["PREWARM_METRICS_TEXTFILE"]
    mount = next(m for m in server["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert path.endswith(".prom") and "hostPath" in volume
    assert f"--collector.textfile.directory={volume['hostPath']['path']}" in text
