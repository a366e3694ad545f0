"""The README is what a new user reads first: its exit-code table and verb list must match the tool."""
from __future__ import annotations

import re
from pathlib import Path

from prewarm.cli import build_parser
from prewarm.errors import EXIT_CODES

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def section(title: str) -> str:
    return README.split(f"### {title}\n", 1)[1].split("\n#", 1)[0]


def test_exit_code_table_matches_the_errors_module():
    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", section("Exit codes"), re.M))
    assert {int(k): v for k, v in rows.items()} == EXIT_CODES


def test_every_cli_verb_is_documented_with_an_example():
    verbs = set(build_parser()._subparsers._group_actions[0].choices)
    table = README.split("## The pipeline", 1)[1].split("### Where it runs", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \| `prewarm \1", table, re.M))
    assert documented == verbs
