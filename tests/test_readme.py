"""The README and docs/ are what a new user reads first: the CLI reference must match the tool (every verb with an
example, every option, the exit codes), every relative link must lead somewhere, and the README stays a page."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from prewarm.cli import build_parser
from prewarm.errors import EXIT_CODES

ROOT = Path(__file__).resolve().parents[1]
CLI = (ROOT / "docs" / "cli.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VERBS = build_parser()._subparsers._group_actions[0].choices


def section(text: str, heading: str) -> str:
    """The body under the line `heading` up to the next heading of any level."""
    return text.split(f"{heading}\n", 1)[1].split("\n#", 1)[0]


def test_exit_code_table_matches_the_errors_module():
    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", section(CLI, "## Exit codes"), re.M))
    assert {int(k): v for k, v in rows.items()} == EXIT_CODES


def test_every_cli_verb_is_documented_with_an_example():
    table = CLI.split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \| `prewarm \1", table, re.M))
    assert documented == set(VERBS)


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_option_of_a_verb_is_in_its_section(verb):
    body = section(CLI, f"## `{verb}`")
    assert re.search(rf"^    prewarm {verb}\b", body, re.M), f"docs/cli.md's `{verb}` section has no example"
    options = {o for a in VERBS[verb]._actions for o in a.option_strings if o.startswith("--")} - {"--help", "--json"}
    missing = sorted(o for o in options if not re.search(rf"`{re.escape(o)}\b", body))
    assert not missing, f"docs/cli.md's `{verb}` section does not mention {missing}"


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    prose = re.sub(r"`[^`\n]*`", "", page.read_text())  # a `kernel[grid](...)` in code is no link
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_stays_a_page():
    """Reference goes under docs/: the README is what and why, the two commands, the pipeline and the servers."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_manifest_example_is_the_shipped_manifest():
    """docs/manifest.md shows kimi-linear-h200.toml without its comments: the same values, so it cannot drift."""
    example = re.search(r"```toml\n(.*?)```", (ROOT / "docs" / "manifest.md").read_text(), re.S).group(1)
    assert tomllib.loads(example) == tomllib.loads((ROOT / "manifests" / "kimi-linear-h200.toml").read_text())
