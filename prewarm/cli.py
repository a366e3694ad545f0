"""The `prewarm` command: a thin shell over the library. Each verb parses, calls one stage, formats the result.

People get rich tables and progress on stderr/stdout; machines get ``--json`` (one JSON document on stdout).
Errors are PrewarmError subclasses: their message goes to stderr and their exit code is returned.
"""
from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from . import __version__
from .errors import PrewarmError

out = Console()
err = Console(stderr=True)


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


# --- verbs ---------------------------------------------------------------------------------------------------
# (each cmd_* returns the process exit code)


def cmd_plan(args) -> int:
    raise NotImplementedError


def cmd_build(args) -> int:
    raise NotImplementedError


def cmd_record(args) -> int:
    raise NotImplementedError


def cmd_pack(args) -> int:
    raise NotImplementedError


def cmd_push(args) -> int:
    raise NotImplementedError


def cmd_install(args) -> int:
    raise NotImplementedError


def cmd_verify(args) -> int:
    raise NotImplementedError


def cmd_keygen(args) -> int:
    raise NotImplementedError


def cmd_fingerprint(args) -> int:
    raise NotImplementedError


def cmd_lower(args) -> int:
    raise NotImplementedError


# --- parser --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prewarm", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"prewarm {__version__}")
    sub = p.add_subparsers(dest="verb", required=True)

    def verb(name, fn, help):
        sp = sub.add_parser(name, help=help, description=help)
        sp.add_argument("--json", action="store_true", help="print one JSON document for machines")
        sp.set_defaults(func=fn)
        return sp

    sp = verb("plan", cmd_plan, "list the exact compile requests a manifest makes")
    sp.add_argument("manifest")

    sp = verb("build", cmd_build, "compile a manifest's requests into a Triton cache dir")
    sp.add_argument("manifest")
    sp.add_argument("--cache-dir", required=True)

    sp = verb("record", cmd_record, "run a command and log every Triton compile request it makes")
    sp.add_argument("-o", "--output", required=True)
    sp.add_argument("command", nargs=argparse.REMAINDER)

    sp = verb("pack", cmd_pack, "pack a cache dir into a content-addressed bundle")
    sp.add_argument("cache_dir")
    sp.add_argument("-o", "--output", required=True)

    sp = verb("push", cmd_push, "copy a bundle to one or more stores (any fsspec URL)")
    sp.add_argument("bundle")
    sp.add_argument("urls", nargs="*")

    sp = verb("install", cmd_install, "install a bundle into a node's cache dir, atomically")
    sp.add_argument("source")
    sp.add_argument("--cache-dir")

    sp = verb("verify", cmd_verify, "check a cache dir: integrity, compatibility, will-hit")
    sp.add_argument("--cache-dir")
    sp.add_argument("--plan", metavar="MANIFEST")

    sp = verb("keygen", cmd_keygen, "make an Ed25519 signing key pair")

    sp = verb("fingerprint", cmd_fingerprint, "show this environment's toolchain fingerprint")

    sp = verb("lower", cmd_lower, "take every planned request through the compiler front end (no device)")
    sp.add_argument("manifest")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PrewarmError as e:
        err.print(f"[bold red]error[/]: {e}", highlight=False)
        if getattr(args, "json", False):
            emit_json({"error": type(e).__name__, "message": str(e), "exit_code": e.exit_code})
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
