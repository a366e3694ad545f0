"""prewarm.providers: one registry of integrations (name -> "module:Class") and one written contract, checked once
when loaded. A manifest naming a provider module of an earlier release still plans; a module or a registry row
missing a hook is refused naming the module and the hook; a server added as one module and one registry row is
served by `prewarm manifest` with nothing else changed (no list of servers elsewhere)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prewarm import providers
from prewarm.errors import ManifestError
from prewarm.planning.manifest import load
from prewarm.planning.manifestgen import generate

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
KIMI_LINEAR = FIXTURES / "model-configs" / "kimi-linear-48b-a3b-instruct"


@pytest.fixture
def registry(monkeypatch, tmp_path):
    """The registry with rows a test adds (modules written under ``tmp_path``, importable), loaded afresh."""
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = dict(providers.KNOWN_IMPLEMENTATIONS)
    monkeypatch.setattr(providers, "KNOWN_IMPLEMENTATIONS", rows)
    providers.integration.cache_clear()
    providers.provider.cache_clear()
    yield rows
    providers.integration.cache_clear()
    providers.provider.cache_clear()


def test_every_registry_row_loads_and_meets_its_contract():
    loaded = providers.integrations()
    assert [i.name for i in loaded] == list(providers.KNOWN_IMPLEMENTATIONS)
    for i in loaded:  # each provider of its own kernels is a module the planner accepts
        for module in i.kernel_providers.values():
            assert callable(providers.provider(module).launches)
    assert set(providers.servers()) == {"sglang", "vllm"}
    assert set(providers.jit_libraries()) == {"sglang", "flashinfer"}


def test_a_manifest_naming_an_old_provider_module_plans_what_the_new_name_plans(tmp_path):
    """fla's provider moved (prewarm.providers.fla_kda -> prewarm.providers.fla.kda): a user's manifest keeps its
    plan, request for request, in a fresh process as `prewarm plan` runs it."""
    shipped = REPO / "manifests" / "kimi-linear-h200-fla.toml"
    assert 'provider = "prewarm.providers.fla.kda"' in shipped.read_text()
    old = tmp_path / "old.toml"
    old.write_text(shipped.read_text().replace("prewarm.providers.fla.kda", "prewarm.providers.fla_kda"))

    def requests(path: Path) -> list:
        done = subprocess.run([sys.executable, "-m", "prewarm.cli", "plan", str(path), "--json"],
                              capture_output=True, text=True, cwd=REPO)
        assert done.returncode == 0, done.stderr[-3000:]
        return [(r["kernel"], r["args"], r["kwargs"]) for r in json.loads(done.stdout)["requests"]]

    new_plan = requests(shipped)
    assert new_plan and requests(old) == new_plan


def test_a_provider_module_without_launches_is_refused_naming_it(registry, tmp_path):
    (tmp_path / "half_provider.py").write_text("def options(spec):\n    return []\n")
    (tmp_path / "m.toml").write_text('[target]\nbackend = "cuda"\narch = "sm_90"\n[[kernels]]\n'
                                     'provider = "half_provider"\n')
    from prewarm.planning.plan import plan

    with pytest.raises(ManifestError, match=r"kernels\[0\]: provider 'half_provider' \(half_provider\): no "
                                            r"launches\(spec\) function"):
        plan(load(tmp_path / "m.toml"))


def test_a_registry_row_whose_server_lacks_a_hook_is_refused_naming_module_and_hook(registry, tmp_path):
    (tmp_path / "halfserver.py").write_text(textwrap.dedent("""
        from prewarm.providers.contract import Server

        class Half(Server):
            name = "half"
            version = "half 1.0"

            def add_flags(self, parser):
                pass

            def parallel(self, args, argv):
                return {}
    """))
    registry["half"] = "halfserver:Half"
    with pytest.raises(ManifestError, match=r"KNOWN_IMPLEMENTATIONS\['half'\].*halfserver\.Half lacks serving"):
        providers.integration("half")


def test_a_fourth_server_is_one_module_and_one_registry_row(registry, tmp_path):
    """A server that exists nowhere in prewarm, registered by one row: `prewarm manifest --server` reads its flags
    and defaults through its class alone (the core names no server)."""
    (tmp_path / "toyserve.py").write_text(textwrap.dedent("""
        from prewarm.planning.manifestgen import Sourced, flag_source, positive_int_arg
        from prewarm.providers.contract import Server

        class ToyServe(Server):
            name = "toyserve"
            version = "toyserve 0.1"

            def add_flags(self, parser):
                parser.add_argument("--shards", type=positive_int_arg)
                parser.add_argument("--batch", type=positive_int_arg, nargs="+")

            def parallel(self, args, argv):
                return {"tensor_parallel": Sourced(args.shards or 1, flag_source(argv, "--shards")),
                        "attention_dp": Sourced(1, "toyserve has no DP attention")}

            def serving(self, args, argv, profile, arch):
                return {"decode_batch_buckets": Sourced(args.batch or [1], flag_source(argv, "--batch"))}, None, []
    """))
    registry["toyserve"] = "toyserve:ToyServe"
    gen = generate(KIMI_LINEAR, "toyserve", "own", "cuda:sm_90", ["--shards", "4", "--batch", "1", "8", "--other"])
    spec = gen.spec_table()
    assert spec["parallel"] == {"tensor_parallel": 4, "attention_dp": 1}
    assert spec["serving"] == {"decode_batch_buckets": [1, 8]} and gen.ignored == ("--other",)
    assert "tensor_parallel = 4" in gen.toml() and "# --shards 4" in gen.toml()
    with pytest.raises(ManifestError, match=r"--kernels: required with --server toyserve"):
        generate(KIMI_LINEAR, "toyserve", None, "cuda:sm_90", [])


def test_verify_server_refuses_a_jit_dir_of_a_library_the_server_never_builds(registry, tmp_path):
    """`verify --server S --jit-dir LAYOUT=DIR` checks where S's processes read that library's modules: a server
    whose processes reach no such library (its Server.jit_libraries) is told so, before any probe runs."""
    from prewarm.errors import EnvironmentProblem
    from prewarm.node.serverenv import server_cache_dirs, server_imports

    (tmp_path / "plainserve.py").write_text(textwrap.dedent("""
        from prewarm.providers.contract import Server

        class PlainServe(Server):
            name = "plainserve"
            version = "plainserve 1.0"
            imports = "json"

            def add_flags(self, parser):
                pass

            def parallel(self, args, argv):
                return {}

            def serving(self, args, argv, profile, arch):
                return {}, None, []
    """))
    registry["plainserve"] = "plainserve:PlainServe"
    assert server_imports()["plainserve"] == "json"
    with pytest.raises(EnvironmentProblem, match=r"--server plainserve: a plainserve process builds no sglang "
                                                 r"modules \(it reaches no JIT library\)"):
        server_cache_dirs("plainserve", tmp_path / "cache", jit_installed={"sglang": str(tmp_path / "jit")})
