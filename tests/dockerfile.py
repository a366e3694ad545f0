"""A small Dockerfile reader: the stages, the ARG/ENV values each instruction sees, Docker's variable substitution.
The deployment tests (tests/test_deploy.py) run the Dockerfile's `prewarm` lines with it and CI's wheel check
(.ci/wheel_check.py) its `pip install` line, so both run what the file says, not a copy."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


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
