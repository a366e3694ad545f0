"""What an entry of a JIT layout may hold, checked by pack (before an object is written) and by install (before an
entry is placed): the module its library's loader opens (``Layout.loads``: sglang's ``<leaf>/<module_name>.so``,
FlashInfer's ``<name>/<name>.so``), which must be native code (an ELF file: a script or text named ``.so`` is
refused), and the JSON metadata beside it (``Layout.metadata``: sglang's ``sgl_deps.json``, which its
``find_prebuilt`` re-hashes, and prewarm's key record). What the library's own build leaves in the dir and no loader
reads (``Layout.leftovers``: ninja's build file, log and depfiles, objects, generated wrapper sources) is left out by
pack and refused by install. Anything else (a ``.py``, a ``.pth``, a shell script, another library, a subdir) is
refused by name, with the bundle reader's exit code (UnsafeBundleError, 9): nothing prewarm ships into a dir the
server dlopens from is there unless that server's loader reads it. Triton's cache (``payload`` off) holds whatever
Triton writes.
"""
from __future__ import annotations

import os
import stat

from ..errors import UnsafeBundleError
from .layouts import Layout

ELF = b"\x7fELF"  # the first bytes of every ELF file: a shared object, an object file


def module(layout: Layout, key: str) -> str:
    """The file (relative to its entry) ``layout``'s loader opens in entry ``key``; "" where it opens the entry dir
    itself (Triton)."""
    path = layout.loads.format(*key.split("/"), key=key)
    return path[len(key) + 1:] if path.startswith(key + "/") else ""


def sort(layout: Layout, key: str, names: list[str], where: str) -> tuple[list[str], list[str]]:
    """An entry's files as pack finds them: (those it ships, the build's leftovers it leaves out), each in the
    given order; UnsafeBundleError naming the first file that is neither (everything ships where ``layout`` has no
    payload rule)."""
    if not layout.payload:
        return list(names), []
    ship, left = [], []
    for name in names:
        if name == module(layout, key) or "/" not in name and layout.metadata.fullmatch(name):
            ship.append(name)
        elif "/" not in name and layout.leftovers.fullmatch(name):
            left.append(name)
        else:
            raise UnsafeBundleError(_refusal(layout, key, name, where))
    return ship, left


def check_listed(layout: Layout, key: str, paths: list[str], where: str) -> None:
    """install: every file a bundle lists for entry ``key`` is its module or metadata (UnsafeBundleError naming the
    first other: a build leftover too, which this prewarm's pack never ships)."""
    if not layout.payload:
        return
    for path in paths:
        if path == module(layout, key) or "/" not in path and layout.metadata.fullmatch(path):
            continue
        if "/" not in path and layout.leftovers.fullmatch(path):
            raise UnsafeBundleError(f"{where}: {key}/{path} is a build leftover {layout.reader} never reads (pack "
                                    f"leaves such files out: re-pack the dir with this prewarm)")
        raise UnsafeBundleError(_refusal(layout, key, path, where))


def check_native(layout: Layout, key: str, head: bytes, where: str) -> None:
    """``head``, the first bytes of entry ``key``'s module, must begin an ELF file (UnsafeBundleError otherwise)."""
    if layout.payload and not head.startswith(ELF):
        raise UnsafeBundleError(f"{where}: {key}/{module(layout, key)} is not native code (it begins {head[:4]!r}, "
                                f"not an ELF header): {layout.reader} would load it; refused")


def read_head(path: str, dir_fd: int | None = None) -> bytes:
    """The first bytes of a regular file, never through a link nor blocking on a FIFO (b"" where it cannot be read:
    then it is no ELF file either)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                     dir_fd=dir_fd)
    except OSError:
        return b""
    try:
        return os.read(fd, len(ELF)) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return b""
    finally:
        os.close(fd)


def _refusal(layout: Layout, key: str, path: str, where: str) -> str:
    mod = module(layout, key)
    return (f"{where}: {key}/{path} is not a file {layout.reader} reads: a {layout.name} entry holds its module "
            f"({mod}, native code) and JSON metadata only; refused")
