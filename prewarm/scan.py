"""What a node's cache dir holds (`prewarm ls`): the bundles installed into it, the entries no bundle installed
(compiled by the runtime on this node, or copied in by hand), and the Ascend toolchain the dir is claimed for.

A frozen report read from the install receipts and the dir itself; it judges nothing (that is verify's job) and
hashes nothing, so it is instant on any cache size.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .bundle import list_entries
from .errors import IntegrityError
from .fingerprint import TOOLCHAIN_RECORD
from .install import read_receipts


@dataclass(frozen=True)
class InstalledBundle:
    manifest: str  # the manifest's name ("" for a bundle packed from a cache no build wrote)
    manifest_digest: str
    index_digest: str
    installed_at: str
    source: str
    signed_by: str | None
    entries: int  # entries the bundle lists
    entries_present: int  # of those, key dirs present in the cache dir now
    bytes: int  # the listed files' size


@dataclass(frozen=True)
class OtherEntry:
    key: str
    files: int
    bytes: int


@dataclass(frozen=True)
class CacheScan:
    cache_dir: str
    bundles: tuple[InstalledBundle, ...]
    other_entries: tuple[OtherEntry, ...]  # key dirs no receipt names
    toolchain: dict | None  # the Ascend toolchain claim, if any

    def to_json(self) -> dict:
        return asdict(self)


def _dir_size(path: Path) -> tuple[int, int]:
    files = size = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                size += os.lstat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                continue
    return files, size


def scan(cache_dir: str | os.PathLike) -> CacheScan:
    cache = Path(cache_dir)
    if not cache.is_dir():
        raise IntegrityError(f"{cache}: cache dir does not exist")
    present = {p.name for p in list_entries(cache)[0]}
    bundles, named = [], set()
    for r in read_receipts(cache):
        index, receipt = r.index, r.doc
        keys = {e.key for e in index.entries}
        named |= keys
        manifest = index.manifest or {}
        bundles.append(InstalledBundle(
            manifest.get("name", ""), manifest.get("digest", ""), index.digest, str(receipt.get("installed_at", "")),
            str(receipt.get("source", "")), receipt.get("signed_by"), len(keys), len(keys & present),
            index.total_size))  # fmt: skip
    others = tuple(OtherEntry(key, *_dir_size(cache / key)) for key in sorted(present - named))
    claim = cache / TOOLCHAIN_RECORD
    try:
        toolchain = json.loads(claim.read_text())["factors"] if claim.is_file() else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise IntegrityError(f"{claim}: not a toolchain record ({e})") from e
    return CacheScan(str(cache), tuple(bundles), others, toolchain)
