"""A cache dir's layout: how its entries are named and found, and where a server reads it. One owner for the three
kinds of dir prewarm packs, ships and installs with the same code (bundle.py, pack.py, install.py, verify.py):

- ``triton``: Triton's cache. An entry is a top-level key dir (``KEY_RE``; a bundle's keys have the form of
  the Triton its fingerprint names: ``tritoncompat.key_dir_form``), its group files rewritten to where it is
  installed. The node's dir: ``TRITON_CACHE_DIR``, else ``~/.triton/cache``. The default, everywhere.
- each JIT library's (``sglang-jit``, ``flashinfer-aot``), declared beside its library's code in its integration's
  folder (``prewarm/providers/<name>/jit.py``: ``JitLibrary.cache_layout``) and found through prewarm.providers'
  registry (:func:`known`).

A dir states its layout in ``<dir>/.prewarm/layout`` (one line, written once: ``mark``, by whoever builds such a dir
and by install; absent: triton). A bundle has one layout: its index's ``"layout"`` field, written only when not
triton (every Triton bundle keeps its bytes). Every part of a key matches its form: no key can name ``..``, an
absolute path or an empty part, nor anything outside its entry dir. ``.prewarm`` (prewarm's own files in a cache dir,
cachedir.py's) is no entry of any layout. Imports nothing of prewarm's but its errors (Triton's key forms, and the
JIT libraries' layouts through the registry, where asked for): the format's reader (bundle.py) and the dir's owner
(cachedir.py) both use it, so this node's factors for a layout are nodestamp's (``nodestamp.node_factors``), which may
import the libraries' code.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..errors import EnvironmentProblem, IntegrityError

META = ".prewarm"  # prewarm's own dir in a cache dir of any layout (cachedir.py's files): never an entry
LAYOUT_FILE = "layout"  # in META: the dir's layout, where not Triton's
KEY_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_=-]{0,127}")  # (fullmatch) a Triton dir prewarm treats as an entry


# A JIT entry's files besides its module (Layout.metadata, Layout.leftovers; a library may narrow them): JSON beside
# the module (sglang's ``sgl_deps.json``, which ``find_prebuilt`` re-hashes, prewarm's key record), and what a ninja
# build dir holds that no loader reads (sglang publishes its build dir as the leaf: ``build.ninja``, ninja's log and
# deps, objects and depfiles, the generated wrapper sources; sglang/kernels/jit/utils/compile/ninja.py).
JIT_METADATA = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.json")
BUILD_LEFTOVERS = re.compile(
    r"build\.ninja|\.ninja_(?:log|deps)|[A-Za-z0-9_][A-Za-z0-9_.+-]*\.(?:o|o\.d|c|cc|cpp|cxx|cu|h|hpp|cuh)")


class NoNodeDir(ValueError):
    """A layout whose node dir no variable names (flashinfer-aot): the dir must be given (``--cache-dir``)."""


@dataclass(frozen=True)
class Layout:
    name: str
    parts: tuple[re.Pattern, ...]  # each part of a key, outermost first (fullmatch)
    form: str  # the key's form, for messages
    env_var: str | None  # what moves the dir the server reads (None: no variable does)
    default_dir: str | None  # where it reads without it ("~" expanded)
    expands_env: bool  # whether the server expands "~" in the variable's value (sglang does, Triton does not)
    own_names: re.Pattern | None = None  # what the library itself keeps beside its entries: not an entry, not stray
    groups: bool = False  # Triton's group files: stored relative, installed pointing at their entry
    # The server's own lookup, as its code resolves names (links followed): each part of a path it could load from
    # (fullmatch; () : ``parts``), what it opens there (a format over the path's parts, ``{0}``..., and ``{key}``),
    # and who reads it, for messages. Wider than ``parts``: every name the library could ask for, of any length and
    # character it allows. :meth:`reachable` walks a dir by it.
    loader: tuple[re.Pattern, ...] = ()
    loads: str = "{key}"
    reader: str = "Triton's cache manager"
    # What an entry may hold (prewarm.shipping.payload: pack and install refuse anything else, by name). ``payload``:
    # only the module ``loads`` names (native code: an ELF file) and ``metadata`` beside it; what the library's own
    # build leaves in the dir and no loader reads (``leftovers``) is left out by pack, refused by install. Not
    # ``payload`` (Triton's cache): whatever Triton writes.
    payload: bool = True
    metadata: re.Pattern = JIT_METADATA
    leftovers: re.Pattern = BUILD_LEFTOVERS

    @property
    def nested(self) -> bool:
        return len(self.parts) > 1

    def node_dir(self, environ: Mapping[str, str] = os.environ) -> Path:
        """The dir a server process with ``environ`` reads this layout's entries from ("~" as that process's HOME
        expands it); NoNodeDir where no variable names it."""
        if self.env_var and (value := environ.get(self.env_var)):
            return _home(value, environ) if self.expands_env else Path(value)
        if self.default_dir is None:
            raise NoNodeDir(f"a {self.name} bundle has no default cache dir (it is inside the server's package, no "
                            f"variable names it): give it with --cache-dir")
        return _home(self.default_dir, environ)

    def key_check(self, fingerprint: Mapping[str, str]) -> tuple[re.Pattern, str]:
        """(what a bundle's key must fullmatch, what that is in words) for a bundle of ``fingerprint``."""
        if self is TRITON:  # the Triton the bundle names decides the form of its keys
            from ..building.tritoncompat import key_dir_form

            form, words = key_dir_form(fingerprint.get("triton.distribution"), fingerprint.get("triton.version"))
            built_by = " ".join(filter(None, (fingerprint.get("triton.distribution"),
                                              fingerprint.get("triton.version")))) or "any Triton 3.2+"
            return form, f"a cache key of {built_by} ({words})"
        return self.key_re, f"a key of the {self.name} layout ({self.form})"

    @functools.cached_property
    def key_re(self) -> re.Pattern:
        """Any key of this layout (a receipt's: Triton's of any version)."""
        return re.compile("/".join(f"(?:{p.pattern})" for p in self.parts))

    def entries(self, root: Path) -> tuple[list[str], list[str]]:
        """The keys of the entries under ``root``, sorted, and the names that are not entries nor the library's own
        (stray files, links, dirs of another form: "/"-separated paths), sorted. ``.prewarm`` is neither. Never
        follows a link."""
        keys, skipped = [], []

        def walk(rel: str, depth: int) -> None:
            try:
                items = list(os.scandir(root / rel if rel else root))
            except OSError:
                if not rel:
                    raise
                skipped.append(rel.rstrip("/"))  # an unreadable dir below the root
                return
            for d in items:
                if not rel and d.name == META or self.own_names and self.own_names.fullmatch(d.name):
                    continue
                if not (d.is_dir(follow_symlinks=False) and self.parts[depth].fullmatch(d.name)):
                    skipped.append(rel + d.name)
                elif depth + 1 == len(self.parts):
                    keys.append(rel + d.name)
                else:
                    walk(f"{rel}{d.name}/", depth + 1)

        walk("", 0)
        return sorted(keys), sorted(skipped)

    def reachable(self, root: Path) -> tuple[list["Loadable"], list[str], list[str]]:
        """``root`` walked as the server's loader resolves names (``loader``, links followed): (every path it could
        load from, its entries included and marked; every other link, and any dir it cannot read; every name it
        never reads, stray: files and dirs of no form it looks up), each "/"-separated, sorted. A link is never an
        entry: where the loader would load from it, it is a :class:`Loadable` reached through it; elsewhere it is
        listed, whatever it leads to (its target can change after any check). ``.prewarm`` and the library's own
        names are none of these. Bounded by the loader's depth, so a link cycle ends there."""
        parts = self.loader or self.parts
        found: list[Loadable] = []
        links: list[str] = []
        stray: list[str] = []

        def walk(rel: tuple[str, ...], path: str, link: str) -> None:
            depth = len(rel)
            try:
                items = list(os.scandir(path))
            except OSError:
                if not rel:
                    raise
                if not link:
                    links.append("/".join(rel))  # what the loader would find there is unknown
                return
            for d in items:
                if not rel and d.name == META or self.own_names and self.own_names.fullmatch(d.name):
                    continue
                name = (*rel, d.name)
                key = "/".join(name)
                is_link = d.is_symlink()
                try:
                    is_dir = d.is_dir()  # followed, as the loader follows it
                except OSError:
                    is_dir = False
                read = parts[depth].fullmatch(d.name)  # a name the loader looks up here
                via = link or (f"{key} -> {_target(d.path)}" if is_link else "")
                if read and depth + 1 == len(parts) and (is_dir or is_link):
                    found.append(Loadable(key, self.loads.format(*name, key=key), via,
                                          not via and all(p.fullmatch(n) for p, n in zip(self.parts, name))))
                    continue
                if not link and (is_link or not (read and is_dir)):  # below a link, that link is reported
                    (links if is_link else stray).append(key)
                if read and is_dir:
                    walk(name, d.path, via)

        walk((), os.fspath(root), "")
        return sorted(found, key=lambda x: x.key), sorted(links), sorted(stray)


@dataclass(frozen=True)
class Loadable:
    """A path under a cache dir the server's loader could load from (:meth:`Layout.reachable`)."""

    key: str  # "/"-separated under the root: the key dir, leaf or module dir the loader resolves
    loads: str  # "/"-separated under the root: what it opens there (a module file; Triton: the key dir's files)
    link: str = ""  # the first link on the way ("NAME -> TARGET"), "" where none
    entry: bool = False  # a plain dir of the layout's own form (``parts``): an entry, its receipt's to judge


def _target(path: str) -> str:
    """Where the link ``path`` points, for messages."""
    try:
        return os.readlink(path)
    except OSError as e:
        return f"unreadable ({e.strerror})"


def _home(path: str, environ: Mapping[str, str]) -> Path:
    """``path`` with a leading "~" expanded as a process with ``environ`` expands it."""
    if (path == "~" or path.startswith("~/")) and environ.get("HOME"):
        return Path(environ["HOME"] + path[1:])
    return Path(path).expanduser()


TRITON = Layout("triton", (KEY_RE,), "a Triton cache key", "TRITON_CACHE_DIR", "~/.triton/cache", False, groups=True,
                payload=False)


@functools.cache
def known() -> dict[str, Layout]:
    """Every layout prewarm knows, by name: Triton's, then each JIT library's (prewarm.providers' registry)."""
    from .. import jit

    return {TRITON.name: TRITON, **{lib.layout: lib.cache_layout for lib in map(jit.library, jit.library_names())}}


def get(name: str) -> Layout:
    """The layout of that name; ValueError naming the known ones."""
    try:
        return known()[name]
    except (KeyError, TypeError):
        raise ValueError(f"layout {name!r} is not one prewarm knows ({', '.join(known())})") from None


def stated(root: str | os.PathLike) -> Layout | None:
    """The layout ``root`` states (``.prewarm/layout``), None where it states none; IntegrityError naming the file
    where it names no layout (a write a crash cut short, or an edit)."""
    path = Path(root, META, LAYOUT_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            name = os.read(fd, 65).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:  # a link, a dir, a FIFO, unreadable
        raise IntegrityError(f"{path}: unreadable ({e.strerror})") from None
    try:
        return get(name)
    except ValueError as e:
        raise IntegrityError(f"{path}: {e}: the file names the dir's layout; where the dir holds only what that "
                             f"layout's server wrote, delete the file (install or `layouts.mark` writes it again)"
                             ) from None


def mark(root: str | os.PathLike, layout: str) -> None:
    """State that ``root`` is a dir of ``layout``: what a builder of a dir past Triton does before filling it, and
    install before filling a dir, so that pack, install, verify and ls read it as one. Written once, created
    exclusively (of two racing claims one wins, the other is refused); refused (EnvironmentProblem, naming both)
    where the dir states another layout."""
    want = get(layout)
    path = Path(root, META, LAYOUT_FILE)
    if (have := stated(root)) is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileExistsError:  # another claim won
            have = stated(root)
        else:
            try:
                os.write(fd, f"{want.name}\n".encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            return
    refuse_other(Path(root), have, want, str(path))


def refuse_other(root: Path, have: Layout, want: Layout, told: str) -> None:
    """EnvironmentProblem where a dir of layout ``have`` (as ``told`` says) is to be filled with ``want``'s entries."""
    if have is not want:
        raise EnvironmentProblem(f"{root} is a {have.name} cache dir ({told} says so): refusing to put {want.name} "
                                 f"entries into it; give the dir a {want.name} server reads (--cache-dir)")

