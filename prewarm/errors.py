"""Errors that reach the user, each with its own exit code (the README's table is generated from EXIT_CODES), and how
another library's exception reads inside one (:func:`describe`)."""
from __future__ import annotations

import os
import sys


class PrewarmError(Exception):
    """Base: a clear message naming what is wrong and where; ``exit_code`` is what the CLI returns."""

    exit_code = 1


class ManifestError(PrewarmError):
    """A manifest or record file is malformed: names the file, the key, the bad value and what was expected."""

    exit_code = 3


class BuildError(PrewarmError):
    """One or more planned requests failed to compile."""

    exit_code = 4


class WillMissError(PrewarmError):
    """A planned kernel is not in the cache (the node would compile it), or (--require-autotune) an autotune result,
    or a shipped one this environment would not read."""

    exit_code = 5


class IntegrityError(PrewarmError):
    """A file, object or index does not match its recorded hash or size, or is missing / unexpected."""

    exit_code = 6


class SignatureError(PrewarmError):
    """A signature is missing where required, does not verify, or was made by an untrusted key."""

    exit_code = 7


class FingerprintMismatch(PrewarmError):
    """The bundle was built under a toolchain that differs from this node's, or this host computes other keys than
    a recording's node did (each factor or key part is named)."""

    exit_code = 8


class UnsafeBundleError(PrewarmError):
    """The bundle holds something that must never be unpacked: escaping paths, links, devices, setuid bits..."""

    exit_code = 9


class StoreError(PrewarmError):
    """A store could not be read or written (after retries): connection dropped, permission, missing bundle."""

    exit_code = 10


class EnvironmentProblem(PrewarmError):
    """The local machine cannot do the job: disk full, lock timeout, a needed tool or package missing."""

    exit_code = 11


class WillFailError(PrewarmError):
    """A planned kernel cannot be keyed or compiled by this node's Triton: the node would crash at its first call
    (kernel, file and line, reason and fix named)."""

    exit_code = 12


class UnverifiedEntries(PrewarmError):
    """Entries no verified install receipt covers (node-local compiles, copies, unsigned bundles; in any dir verified,
    JIT dirs included: a link, a leaf or module dir the server's loader would load that is no entry) where only signed
    bundles are trusted (--require-signature), or a planned compile or module would be served from one (each named;
    --allow-unverified lists them instead)."""

    exit_code = 13


class CacheDirMismatch(PrewarmError):
    """The server process would read another cache dir than the one installed and verified: names the variable to
    set."""

    exit_code = 14


class DowngradeRefused(PrewarmError):
    """The bundle is an older build (its signed sequence) of a bundle name than the one last installed into the cache
    dir: both sequences named (--allow-downgrade installs it)."""

    exit_code = 15


EXIT_CODES = {
    0: "success",
    1: "unexpected internal error (a bug: please report the traceback)",
    2: "bad command line (argparse)",
    **{cls.exit_code: " ".join(cls.__doc__.split()) for cls in PrewarmError.__subclasses__()},
}


def describe(e: BaseException) -> str:
    """``Type: message`` of an exception caught from another library's code (a server's, Triton's). One whose message
    is empty (vLLM's ``NotImplementedError()`` of a platform it could not detect) also says where it was raised: the
    innermost frame of its traceback, as file:line (relative to its sys.path entry: the server's own path) and
    function, since the type alone names no cause."""
    text = str(e).strip()
    if text:
        return f"{type(e).__name__}: {text}"
    tb = e.__traceback__
    if tb is None:
        return f"{type(e).__name__} (no message)"
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    path = os.path.abspath(code.co_filename)
    roots = [os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)]
    root = max((r for r in roots if path.startswith(r + os.sep)), key=len, default=None)
    where = os.path.relpath(path, root) if root else path
    return f"{type(e).__name__} (no message), raised at {where}:{tb.tb_lineno} in {code.co_name}"
