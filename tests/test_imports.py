"""prewarm's modules import one another without a cycle, function-level imports included: every concept has one
owner, and a module that needs another's does not get needed back (the target registry once imported its Ascend
plugin by name while the plugin imported the registry)."""
import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "prewarm"


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source (importing ``a.b.c`` imports ``a.b``)."""
    files = {module_name(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here.split(".")[: len(here.split(".")) - node.level + 1]) if node.level else ""
                module = ".".join(filter(None, [base, node.module]))
                targets = [module] + [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target:  # the module and every package above it
                    if target in files:
                        deps.add(target)
                    target = target.rpartition(".")[0]
        graph[name] = deps - {name} - {n for n in files if name.startswith(n + ".")}  # a submodule's own parents
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_deferred_and_relative_imports(tmp_path):
    """The checker itself: a cycle closed by an import inside a function, through a subpackage, is found."""
    pkg = tmp_path / "prewarm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import c\n")
    (pkg / "c.py").write_text("import os\n\ndef g():\n    from . import a\n")
    assert cycles(import_graph(pkg)) == [frozenset({"prewarm.a", "prewarm.sub", "prewarm.sub.b", "prewarm.c"})]


def test_no_import_cycle_in_prewarm():
    graph = import_graph()
    assert not cycles(graph), f"import cycles: {[sorted(c) for c in cycles(graph)]}"


def test_packing_a_cache_does_not_import_the_node_installer():
    """pack runs on the build host: this node's factors are nodestamp's, the installer is a node's."""
    assert "prewarm.shipping.install" not in import_graph()["prewarm.shipping.pack"]


def test_the_backends_import_in_a_fresh_interpreter_in_any_order():
    """Each backend module first, as guard (npu) and build's workers (the package) import them."""
    for first in ("prewarm.building.backends.npu", "prewarm.building.backends.cuda", "prewarm.building.backends", "prewarm.building.probe"):
        done = subprocess.run([sys.executable, "-c", f"import {first}, prewarm.cli, prewarm.building.build, prewarm.node.willhit"],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"import {first} first: {done.stderr[-2000:]}"
