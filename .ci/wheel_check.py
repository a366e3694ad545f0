"""CI: prewarm as users install it, run from outside the checkout (.ci/run calls this after .ci/setup).

The tests run against the source tree (an editable install); this checks what a pip install delivers:
1. An sdist made from the checkout's files (what a clone has: tracked and untracked-not-ignored files), the wheel built
   from that sdist. Every file of the checkout under prewarm/ and kernels/ (as prewarm_kernels/) must be in both, so
   a subpackage (or a data file) that packaging does not find fails here, whatever its name.
2. The Dockerfile's own install (its RUN line with `pip install`, TARGET=cuda, read from the Dockerfile and expanded
   with its ARG/ENV values, /opt/prewarm mapped to a temp dir, /opt/prewarm/src a copy of those files): a fresh venv
   whose prewarm files must be exactly the wheel's.
3. The third-party libraries a user's image has are shared, not reinstalled (torch's CUDA build alone is ~4 GB):
   the fresh venv reads .venv's site-packages through a dir of links to its entries minus prewarm's own (the
   editable install's dist-info, finder and .pth) and build/sglang, build/vllm through .pth files, as .ci/setup
   does; pip sees the [cuda] extra's torch and triton installed there. Each command asserts that prewarm and
   prewarm_kernels are imported from the fresh venv's site-packages.
4. In a copy of the checkout's other files (manifests, their tables and records; not prewarm/ or kernels/), with that
   venv's bin first on PATH and no PYTHONPATH: an import of every module of the wheel, `prewarm <verb> --help` of
   every verb, the README's main job verbatim (its store in a temp HOME), which must end `clean`, and `prewarm plan`
   of every CUDA manifest in manifests/ (exit 0, or 12: will-fail, each such kernel named).
5. Ascend: the sdist pip-installed into a fresh Python 3.11 venv sharing .venv-ascend's libraries the same way (the
   npu extra's torch_npu needs CANN, so no extra), then `prewarm plan` of every npu manifest.
6. The serving images: into each server as pip installs it (.ci/setup's .venv-sglang, .venv-vllm, standing in for
   the server's image, its python3 the image's), the Dockerfile's serving-image install line (TARGET=serving) with
   the wheel of 1. as the one the image builds: prewarm's files are the wheel's and import from there, and every
   distribution the server had keeps its version (prewarm adds, never changes, the server's environment). The tests
   that run there (tests/real, from .ci/run) use this install.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from dockerfile import expand, read_dockerfile, stage_chain, walk  # noqa: E402
from prewarm.errors import WillFailError  # noqa: E402  (the checkout's, for its exit code)

# where each package dir of the checkout installs
PACKAGE_ROOTS = {"prewarm": "prewarm", "kernels": "prewarm_kernels"}
SERVING_VENVS = [REPO / ".venv-sglang", REPO / ".venv-vllm"]  # the servers as pip installs them (.ci/setup)
T0 = time.monotonic()


def sh(cmd: list[str] | str, *, ok: tuple[int, ...] = (0,), **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, **kw)
    if p.returncode not in ok:
        raise SystemExit(f"wheel check: {cmd} exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def checkout_files() -> list[str]:
    out = sh(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).stdout
    return sorted(f for f in out.split("\0") if f and (REPO / f).is_file())


def installed_name(path: str) -> str | None:
    """Where a checkout file under a package root lands in the wheel (None: not under one)."""
    top, _, rest = path.partition("/")
    return f"{PACKAGE_ROOTS[top]}/{rest}" if top in PACKAGE_ROOTS and rest else None


def build_sdist_and_wheel(src: Path, dist: Path) -> tuple[Path, Path]:
    """The sdist of ``src`` (setuptools' own PEP 517 hook, as `python -m build` calls it) and the wheel pip builds
    from that sdist (so the sdist alone must be enough to build prewarm, its C member loop included)."""
    dist.mkdir()
    name = sh([sys.executable, "-c", "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))",
               str(dist)], cwd=src).stdout.split()[-1]
    sdist = dist / name
    sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(sdist)])
    (wheel,) = dist.glob("prewarm-*.whl")
    return sdist, wheel


def check_contents(files: list[str], sdist: Path, wheel: Path) -> set[str]:
    """Every checkout file under a package dir is in the sdist and in the wheel (at its installed name); returns the
    wheel's package files."""
    with tarfile.open(sdist) as t:
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    with zipfile.ZipFile(wheel) as z:
        in_wheel = {n for n in z.namelist() if ".dist-info/" not in n}
    ours = [f for f in files if installed_name(f)]
    for built, lacking in ((sdist, [f for f in ours if f not in in_sdist]),
                           (wheel, [f for f in ours if installed_name(f) not in in_wheel])):
        dirs = sorted({os.path.dirname(f) for f in lacking})
        assert not lacking, (f"{built.name} lacks {len(lacking)} files of {dirs} (e.g. {lacking[0]}): packaging does "
                             f"not find them (setup.py's package discovery, pyproject.toml's package-data)")
    assert any(n.endswith(".so") for n in in_wheel), f"{wheel.name} has no C member loop (prewarm/_fastunpack.c)"
    return in_wheel


def dockerfile_install(target: str) -> str:
    """The Dockerfile's `pip install` RUN line for TARGET=target, its ARG/ENV values substituted (as Docker)."""
    global_args, stages = read_dockerfile(REPO / "Dockerfile")
    steps, _ = walk(global_args, stage_chain(global_args, stages, {"TARGET": target}), {"TARGET": target}, "/usr/bin")
    (line,) = [expand(text, scope) for kw, text, scope in steps if kw == "RUN" and "pip install" in text]
    return line


def share_libraries(venv_python: Path, libraries: Path, links: Path, extra_paths: list[Path]) -> Path:
    """Make ``libraries`` (a site-packages) importable in the venv of ``venv_python`` through ``links``, a dir of
    links to its entries except prewarm's (dist-info, editable finder and .pth files, whose .pth lines a linked dir
    would not run anyway), plus ``extra_paths``; returns the venv's site-packages."""
    links.mkdir()
    for entry in libraries.iterdir():
        if not re.match(r"(prewarm|__editable__|_*pycache_*$)", entry.name) and entry.suffix != ".pth":
            (links / entry.name).symlink_to(entry)
    site = Path(sh([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "prewarm-ci-shared-libraries.pth").write_text("".join(f"{p}\n" for p in [links, *extra_paths]))
    return site


def user_env(venv: Path, home: Path) -> dict[str, str]:
    """A user's shell: the venv's bin first on PATH, a HOME of its own (the default store), nothing of this run's
    Python or prewarm settings."""
    drop = ("PYTHON", "PREWARM_", "TRITON_", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "PATH": f"{venv / 'bin'}:{env['PATH']}", "HOME": str(home), "VIRTUAL_ENV": str(venv)}


def check_imports(venv: Path, site: Path, modules: list[str], cwd: Path, env: dict[str, str]) -> None:
    """Every module imports, prewarm and prewarm_kernels from ``site`` (not the checkout, not .venv)."""
    code = ("import importlib, sys\n"
            "for m in sys.argv[2:]: importlib.import_module(m)\n"
            "import prewarm, prewarm_kernels, importlib.metadata as md\n"
            "for mod in (prewarm, prewarm_kernels):\n"
            "    assert mod.__file__.startswith(sys.argv[1] + '/'), f'{mod.__name__} from {mod.__file__}'\n"
            "assert str(md.distribution('prewarm').locate_file('')).rstrip('/') == sys.argv[1], 'prewarm metadata'\n")
    sh([str(venv / "bin" / "python"), "-c", code, str(site), *modules], cwd=cwd, env=env)


def shipped_manifests(root: Path) -> dict[str, list[Path]]:
    """Every file of ``root`` (manifests/) by its target backend, the autotune tables manifests name (``[target]
    tuned``) aside: a file that is neither fails, so none is skipped unseen."""
    docs = {m: tomllib.loads(m.read_text()) for m in sorted(root.glob("*"))}
    tables = {(m.parent / d["target"]["tuned"]).resolve() for m, d in docs.items() if "tuned" in d.get("target", {})}
    by_backend: dict[str, list[Path]] = {}
    for m, doc in docs.items():
        if m.resolve() not in tables:
            by_backend.setdefault(doc.get("target", {}).get("backend", f"none ({m.name})"), []).append(m)
    assert set(by_backend) <= {"cuda", "npu"}, f"{root}: files neither a CUDA/npu manifest nor a table: {by_backend}"
    return by_backend


def plan_all(manifests: list[Path], cwd: Path, env: dict[str, str]) -> list[str]:
    """`prewarm plan` of each manifest: exit 0, or 12 (will-fail) with the kernels named."""
    done = []
    for m in manifests:
        p = sh(["prewarm", "plan", str(m)], ok=(0, WillFailError.exit_code), cwd=cwd, env=env)
        if p.returncode == WillFailError.exit_code:
            assert "cannot be keyed by this Triton" in p.stderr, f"plan {m.name} exited 12 without naming kernels"
        done.append(f"{m.name}:{p.returncode}")
    return done


def distributions(python: Path) -> dict[str, str]:
    """Every distribution installed for ``python``: {name: version}."""
    code = ("import importlib.metadata as md, json\n"
            "print(json.dumps({d.metadata['Name'].lower(): d.version for d in md.distributions()}))")
    return json.loads(sh([str(python), "-c", code]).stdout)


def serving_install(wheel: Path, in_wheel: set[str], venv: Path, work: Path, cwd: Path) -> str:
    """The Dockerfile's serving-image install line run in ``venv`` (the server's image: its python3), ``wheel`` in
    /opt/prewarm/dist (mapped to ``work``); prewarm's files must be the wheel's and no distribution of the server's
    may change version. Returns what pip added."""
    assert (venv / "bin" / "python3").exists(), f"{venv} missing: .ci/setup makes it (the server as pip installs it)"
    python = venv / "bin" / "python3"
    (work / "dist").mkdir(parents=True)
    shutil.copy2(wheel, work / "dist")
    sh([str(python), "-m", "pip", "uninstall", "-q", "-y", "prewarm"])  # a previous run's (same version: pip keeps it)
    before = distributions(python)
    env = user_env(venv, work / "home")
    sh(dockerfile_install("serving").replace("/opt/prewarm", str(work)), cwd=cwd, env=env)
    after = distributions(python)
    changed = {n: f"{v} -> {after.get(n, 'removed')}" for n, v in before.items() if after.get(n) != v}
    assert not changed, f"{venv.name}: the serving-image install changed the server's packages: {changed}"
    site = Path(sh([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    record = next(site.glob("prewarm-*.dist-info")) / "RECORD"
    installed = {n for n in (line.split(",")[0] for line in record.read_text().splitlines())
                 if ".dist-info/" not in n and "__pycache__" not in n and not n.startswith("..")}
    assert installed == in_wheel, f"{venv.name}: the serving-image install differs from the wheel: {installed ^ in_wheel}"
    check_imports(venv, site, ["prewarm.cli"], cwd, env)
    return " ".join(sorted(set(after) - set(before)))


def say(what: str) -> None:
    print(f"wheel check [{time.monotonic() - T0:4.0f} s]: {what}", flush=True)


def main() -> None:
    files = checkout_files()
    with tempfile.TemporaryDirectory(prefix="prewarm-wheel-check-") as tmp:
        tmp = Path(tmp)
        image = tmp / "opt-prewarm"  # the image's /opt/prewarm
        src = image / "src"  # COPY . /opt/prewarm/src
        for f in files:
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, src / f)
        sdist, wheel = build_sdist_and_wheel(src, tmp / "dist")
        in_wheel = check_contents(files, sdist, wheel)
        modules = sorted(n[:-3].removesuffix("/__init__").replace("/", ".") for n in in_wheel if n.endswith(".py"))
        say(f"{sdist.name}, {wheel.name}: {len(in_wheel)} files, {len(modules)} modules")

        # the Dockerfile's RUN line verbatim, into a venv made as it makes it beforehand, so that .venv's libraries
        # are shared before its pip runs
        install = dockerfile_install("cuda").replace("/opt/prewarm", str(image))
        venv = image / "venv"
        sh([sys._base_executable, "-m", "venv", "--system-site-packages", str(venv)])  # as the RUN line does it
        site = share_libraries(venv / "bin" / "python", Path(sysconfig.get_paths()["purelib"]), tmp / "cuda-libraries",
                               [REPO / "build" / "sglang", REPO / "build" / "vllm"])
        user = tmp / "user"  # the checkout's other files (manifests, their tables and records), not its packages
        for f in files:
            if not installed_name(f):
                (user / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / f, user / f)
        (user / "home").mkdir()
        env = user_env(venv, user / "home")
        base_bin = tmp / "base-bin"  # `python3` of the RUN line: the Python the venvs are made from (3.12)
        base_bin.mkdir()
        (base_bin / "python3").symlink_to(sys._base_executable)
        sh(install, cwd=user, env={**env, "PATH": f"{base_bin}:{env['PATH']}"})
        record = next(site.glob("prewarm-*.dist-info")) / "RECORD"
        installed = {n for n in (line.split(",")[0] for line in record.read_text().splitlines())
                     if ".dist-info/" not in n and "__pycache__" not in n and not n.startswith("..")}  # ../bin/prewarm
        assert installed == in_wheel, f"the Dockerfile's install differs from the wheel: {installed ^ in_wheel}"
        say(f"the Dockerfile's install ({install.split('&&')[-1].strip()}) = the wheel's files")

        check_imports(venv, site, modules, user, env)
        verbs = sh(["python", "-c", "from prewarm.cli import build_parser; "
                    "print(*build_parser()._subparsers._group_actions[0].choices)"], cwd=user, env=env).stdout.split()
        for verb in verbs:
            sh(["prewarm", verb, "--help"], cwd=user, env=env)
        say(f"{len(modules)} modules import, --help of {len(verbs)} verbs")

        readme = (REPO / "README.md").read_text().split("## Two commands on a fresh machine", 1)[1]
        job = re.search(r"^    bash \.ci/setup && \. \.venv/bin/activate && (.+)$", readme, re.M).group(1)
        out = sh(["bash", "-euo", "pipefail", "-c", job], cwd=user, env=env).stdout
        assert out.rstrip().endswith("\nclean"), f"the README's main job did not end clean:\n{out[-3000:]}"
        say(f"the README's main job ends clean ({job[:60]}...)")
        manifests = shipped_manifests(user / "manifests")
        say(f"plan {' '.join(plan_all(manifests['cuda'], user, env))}")

        for venv in SERVING_VENVS:
            added = serving_install(wheel, in_wheel, venv, tmp / f"serving-{venv.name}", user)
            say(f"{venv.name}: the Dockerfile's serving-image install = the wheel's files, the server's packages "
                f"unchanged, added: {added}")

        # Ascend: the sdist into a fresh Python 3.11 venv, .venv-ascend's libraries shared
        ascend_python = Path(sh([str(REPO / ".venv-ascend" / "bin" / "python"), "-c",
                                 "import sys; print(sys._base_executable)"]).stdout.strip())
        avenv = tmp / "venv-ascend"
        sh([str(ascend_python), "-m", "venv", str(avenv)])
        asite = share_libraries(
            avenv / "bin" / "python",
            Path(sh([str(REPO / ".venv-ascend" / "bin" / "python"), "-c",
                     "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()),
            tmp / "ascend-libraries", [REPO / "build" / "sglang", REPO / "build" / "sgl_kernel_npu"])
        aenv = user_env(avenv, user / "home")
        sh([str(avenv / "bin" / "pip"), "install", "-q", "--no-cache-dir", str(sdist)], cwd=user, env=aenv)
        # prewarm_kernels' modules need a device driver to import under triton-ascend: the plans import what they use
        check_imports(avenv, asite, ["prewarm.cli", "prewarm.planning.plan"], user, aenv)
        say(f"Ascend ({sdist.name} into Python 3.11): plan "
              f"{' '.join(plan_all(manifests['npu'], user, aenv))}")
    say("passed")


if __name__ == "__main__":
    main()
