"""A small Dockerfile reader (the stages, the ARG/ENV values each instruction sees, Docker's variable substitution) and
a build step run without Docker (:func:`bake`: the `prewarm` RUN lines of a build-arg's stages, image paths mapped
to a temp dir). The deployment tests (tests/test_deploy.py, tests/real) run the Dockerfile's `prewarm` lines with it
and CI's wheel check (.ci/wheel_check.py) its `pip install` lines, so all run what the file says, not a copy."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, rest of the line)


def read_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with continuation lines joined and comment lines dropped (as Docker)."""
    logical, buf = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or (buf and not line.strip()):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        if buf.strip():
            logical.append(buf.strip())
        buf = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for text in logical:
        keyword, _, rest = text.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else f"stage{len(stages)}"
            stages.append(Stage(name, words[0]))
        elif not stages:
            assert keyword == "ARG", f"{path}: only ARG may precede the first FROM, found {keyword}"
            key, _, default = rest.partition("=")
            global_args[key.strip()] = default.strip()
        else:
            stages[-1].instructions.append((keyword, rest))
    return global_args, stages


_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def expand(text: str, values: dict[str, str]) -> str:
    """Docker's ${VAR}, ${VAR:-default} and $VAR substitution (unknown names expand to '')."""
    return _VAR.sub(lambda m: values.get(m.group(1) or m.group(3)) or (m.group(2) or ""), text)


def stage_chain(global_args: dict[str, str], stages: list[Stage], build_args: dict[str, str]) -> list[Stage]:
    """The stages the final image is built from, root first (FROM names resolved with the build args)."""
    args = {**global_args, **build_args}
    by_name = {s.name: s for s in stages}
    chain, stage = [], stages[-1]
    while True:
        chain.append(stage)
        base = expand(stage.base, args)
        if base not in by_name:
            return chain[::-1]
        stage = by_name[base]


def walk(global_args: dict[str, str], chain: list[Stage], build_args: dict[str, str], base_path: str):
    """Each instruction of the chain with the ARG+ENV values visible to it (as Docker scopes them), and the
    image's final ENV."""
    env = {"PATH": base_path}
    steps = []
    for stage in chain:
        scope = dict(env)
        for keyword, rest in stage.instructions:
            if keyword == "ARG":
                key, eq, default = rest.partition("=")
                key = key.strip()
                scope[key] = build_args.get(key, expand(default.strip(), scope) if eq else global_args.get(key, ""))
            elif keyword == "ENV":
                for pair in shlex.split(rest):
                    key, _, value = pair.partition("=")
                    env[key] = scope[key] = expand(value, scope)
            steps.append((keyword, rest, dict(scope)))
    return steps, env


# --- a build step run without Docker --------------------------------------------------------------------------------


def prewarm_verbs_in_shell(text: str) -> list[str]:
    """The `prewarm` commands of a shell text, in order (the verb of each)."""
    verbs = []
    for segment in re.split(r"&&|\|\||;|\n|\bthen\b|\belse\b|\bdo\b", text):
        words = segment.split()
        words = words[1:] if words[:1] == ["exec"] else words
        if words[:1] == ["prewarm"] and len(words) > 1:
            verbs.append(words[1])
    return verbs


@dataclass
class Image:
    """A temp dir standing in for the image's filesystem paths, and the logging ``prewarm`` wrapper."""

    root: Path
    log: Path

    def path(self, value: str) -> str:
        """Map image paths to this test's dirs (/opt/prewarm/src is the checkout itself: COPY . /opt/prewarm/src)."""
        value = value.replace("/opt/prewarm/src", str(REPO))
        value = value.replace("/opt/prewarm", str(self.root / "opt-prewarm"))
        return value.replace("/run/secrets", str(self.root / "secrets"))

    def install_tool(self, real_prewarm: Path, at: str = "/opt/prewarm/venv/bin") -> Path:
        """What the image's install provides: `prewarm` in the image dir ``at`` (here: logged, then ``real_prewarm``);
        returns that dir."""
        bin_dir = Path(self.path(at))
        bin_dir.mkdir(parents=True, exist_ok=True)
        wrapper = bin_dir / "prewarm"
        log, real = shlex.quote(str(self.log)), shlex.quote(str(real_prewarm))
        wrapper.write_text(f'#!/bin/sh\necho "$1" >> {log}\nexec {real} "$@"\n')
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        return bin_dir

    def verbs_run(self) -> list[str]:
        verbs = self.log.read_text().split() if self.log.exists() else []
        self.log.unlink(missing_ok=True)
        return verbs


def clean_env(**values: str) -> dict[str, str]:
    """The host environment without any Triton / prewarm setting of the outer test run, plus ``values``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "PREWARM_", "FSSPEC_"))}
    env.update(values)
    return env


def run(cmd: list[str], env: dict[str, str], what: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3000, cwd=cwd)
    assert p.returncode == 0, f"{what} exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


def assert_clean(p: subprocess.CompletedProcess, what: str) -> None:
    assert re.search(r"^clean$", p.stdout, re.M), f"{what}: verify did not report clean:\n{p.stdout[-3000:]}"


def small_manifest(shipped: Path, dest: Path, buckets: Sequence[int] = (1,)) -> Path:
    """The shipped manifest with only ``buckets`` as decode batches (no prefill, no drafts): same target, model, server
    settings, kernels and autotune table (its own text, with `[spec.serving]`'s table replaced; the table copied
    beside it)."""
    text = shipped.read_text()
    name = tomllib.loads(text).get("name", shipped.stem)
    head, tail = text.split("[spec.serving]", 1)
    head = re.sub(r"^name = .*$", f'name = "{name}-deploy-test"', head, count=1, flags=re.M)
    serving = f"[spec.serving]\nprefill = false\ndecode_batch_buckets = {list(buckets)}\ndraft_widths = []\n\n"
    dest.write_text(head + serving + tail[re.search(r"^\[", tail, re.M).start():])  # from the next table on
    tuned = tomllib.loads(text).get("target", {}).get("tuned")
    if tuned:  # its autotune table, which the manifest names relative to itself
        shutil.copy2(shipped.parent / tuned, dest.parent / tuned)
    return dest


def bake(image: Image, build_args: dict[str, str], manifest_override: Path | None = None,
         base_path: str | None = None, env: dict[str, str] | None = None) -> tuple[dict, list[str]]:
    """Run the Dockerfile's `prewarm` RUN lines of the stages ``build_args`` select, each with ``/bin/sh -c`` (as
    Docker) in the ARG/ENV values it sees (image paths mapped; ``base_path``: the base image's PATH, default this
    process's) over ``env`` (the base image's environment; default :func:`clean_env`), PREWARM_MANIFEST replaced by
    ``manifest_override`` where given; returns the final ENV and the verbs found in those lines."""
    global_args, stages = read_dockerfile(DOCKERFILE)
    chain = stage_chain(global_args, stages, build_args)
    steps, final_env = walk(global_args, chain, build_args, base_path or os.environ["PATH"])
    shipped = Path(image.path(final_env["PREWARM_MANIFEST"]))
    assert shipped.is_file(), f"the Dockerfile's default manifest for {build_args} is missing: {shipped}"
    found = []
    for keyword, text, scope in steps:
        if keyword != "RUN" or not prewarm_verbs_in_shell(text):
            continue
        while text.startswith("--"):  # RUN flags (--mount=type=secret,...)
            text = text.split(None, 1)[1]
        found += prewarm_verbs_in_shell(text)
        run_env = {**(clean_env() if env is None else env), **{k: image.path(v) for k, v in scope.items()}}
        if manifest_override is not None:
            run_env["PREWARM_MANIFEST"] = str(manifest_override)
        run(["/bin/sh", "-c", image.path(text)], run_env, f"Dockerfile RUN {text[:80]}", cwd=image.root)
    return final_env, found
