"""The kernel registry is filled by the kernel modules themselves: no import cycle in kernels/, and importing the
kda package registers every kernel a kda module declares."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _module(path: Path) -> str:
    parts = ["prewarm_kernels", *path.relative_to(KERNELS).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The prewarm_kernels modules ``path`` imports anywhere in it (function-level imports included)."""
    here = _module(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            mod = ".".join(p for p in (base, node.module) if p)
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}  # `from . import x` names a module
    return found


def test_no_import_cycle_in_kernels():
    files = {_module(p): p for p in KERNELS.rglob("*.py")}
    graph = {m: sorted(i for i in _imports(p) if i in files and i != m) for m, p in files.items()}
    assert not any(i == "prewarm" or i.startswith("prewarm.") for p in files.values() for i in _imports(p))
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in graph[m]:
            assert state.get(dep) != 1, f"import cycle: {' -> '.join(path[path.index(dep):] + [dep])}"
            if dep not in state:
                visit(dep, path + [dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def _declared_kernels() -> set[str]:
    """Every name a kda module passes to ``register(...)``, read from the source."""
    names = set()
    for path in (KERNELS / "kda").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register":
                names.add(node.args[0].value)
    return names


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_importing_kda_registers_every_declared_kernel():
    p = _fresh("import prewarm_kernels.kda, prewarm_kernels.backend as b; print(' '.join(sorted(b.REGISTRY)))")
    assert p.returncode == 0, p.stderr
    assert set(p.stdout.split()) == _declared_kernels()
    assert len(_declared_kernels()) == 8


def test_select_before_any_kernel_package_is_imported_says_what_to_import():
    p = _fresh("from prewarm_kernels.backend import select; select('cumsum', 'cuda')")
    assert p.returncode == 1
    assert "unknown kernel 'cumsum'" in p.stderr and "import prewarm_kernels.kda" in p.stderr
