"""What a node's cache dir holds (`prewarm ls`): the bundles installed into it, the entries no bundle installed
(compiled by the runtime on this node, or copied in by hand), and the Ascend toolchain the dir is claimed for. A dir
of any layout (prewarm.shipping.layouts: the one it states), its entries as that layout names them.

A frozen report read from the install receipts and the dir itself; it judges nothing (that is verify's job) and
hashes nothing, so it is instant on any cache size.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from .cachedir import CacheDir
from ..errors import IntegrityError


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
    layout: str = "triton"  # the dir's (prewarm.shipping.layouts)

    def to_json(self) -> dict:
        return asdict(self)


def _other_entry(cache: CacheDir, key: str) -> OtherEntry:
    files = size = 0
    for name in cache.files(key):
        try:
            size += os.lstat(cache.root / key / name).st_size
            files += 1
        except OSError:
            continue
    return OtherEntry(key, files, size)


def scan(cache_dir: str | os.PathLike) -> CacheScan:
    cache = CacheDir(cache_dir)
    if not cache.root.is_dir():
        raise IntegrityError(f"{cache.root}: cache dir does not exist")
    present = set(cache.entries()[0])
    bundles, named = [], set()
    for r in cache.receipts():
        receipt, keys = r.doc, r.entries.keys()
        named |= keys
        manifest = r.manifest or {}
        bundles.append(InstalledBundle(
            manifest.get("name", ""), manifest.get("digest", ""), r.digest, str(receipt.get("installed_at", "")),
            str(receipt.get("source", "")), receipt.get("signed_by"), len(keys), len(keys & present),
            r.size))  # fmt: skip
    others = tuple(_other_entry(cache, key) for key in sorted(present - named))
    return CacheScan(str(cache.root), tuple(bundles), others, cache.read_toolchain(), cache.layout.name)
