"""Pack a Triton cache dir into a bundle dir (the format is bundle.py's): every entry's object written in parallel
and flushed, then the signature, then ``index.json`` last, so a reader never sees an index whose objects or
signature are missing. The cache dir is read through its owner (cachedir.py): its entries, the files of each
without Triton's in-flight ``tmp.pid_*`` dirs, and the fingerprint and manifest its build recorded.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import fingerprint, signing
from .bundle import INDEX, OBJECTS, SIGNATURE, Entry, Index, pack_entry
from .cachedir import CacheDir, write_atomic
from .errors import EnvironmentProblem, IntegrityError


@dataclass
class PackResult:
    bundle_dir: Path
    index: Index
    objects_written: int
    bytes_in: int
    bytes_out: int
    skipped: list[str] = field(default_factory=list)  # top-level paths that are not cache entries


def pack(
    cache_dir: str | os.PathLike,
    bundle_dir: str | os.PathLike,
    *,
    signing_key: str | os.PathLike | None = None,
    workers: int | None = None,
) -> PackResult:
    """Cache dir -> bundle dir. Objects already in ``bundle_dir`` with the same bytes are reused; the index is
    written last. A local write or read failure (full or read-only disk) is an EnvironmentProblem."""
    cache_dir, bundle_dir = Path(cache_dir), Path(bundle_dir)
    if not cache_dir.is_dir():
        raise IntegrityError(f"{cache_dir}: not a directory (expected a Triton cache dir)")
    try:
        return _pack(cache_dir, bundle_dir, signing_key, workers)
    except OSError as e:
        raise EnvironmentProblem(f"{e.filename or bundle_dir}: {e.strerror} (packing {cache_dir} into {bundle_dir})"
                                 ) from None


def _pack(cache_dir: Path, bundle_dir: Path, signing_key: str | os.PathLike | None, workers: int | None) -> PackResult:
    cache = CacheDir(cache_dir)
    record = cache.read_build_info()
    fp = record.get("fingerprint")
    fp = {str(k): str(v) for k, v in fp.items()} if isinstance(fp, dict) else fingerprint.current()
    manifest = record.get("manifest") if isinstance(record.get("manifest"), dict) else None
    if manifest is not None:
        manifest = {"name": str(manifest.get("name", "")), "digest": str(manifest.get("digest", ""))}
    keys, skipped = cache.entries()
    (bundle_dir / OBJECTS).mkdir(parents=True, exist_ok=True)

    def one(key: str) -> tuple[Entry, bool]:
        entry, obj = pack_entry(cache.root / key, cache.files(key, in_flight=False))
        dest = bundle_dir / OBJECTS / entry.object
        if dest.is_file() and dest.stat().st_size == len(obj) and dest.read_bytes() == obj:
            return entry, False  # an existing object is trusted only after comparing its bytes
        write_atomic(dest, obj, durable=False)  # flushed all at once below, before the index
        return entry, True

    with cf.ThreadPoolExecutor(workers or min(8, (os.cpu_count() or 1) + 1)) as pool:
        results = list(pool.map(one, keys))
    os.sync()  # every object on disk before the index that names them: one flush, not an fsync per object
    index = Index(fp, manifest, tuple(e for e, _ in results))
    data = index.to_bytes()
    sig = bundle_dir / SIGNATURE
    if signing_key:
        write_atomic(sig, signing.sign(data, signing_key))
    elif sig.exists():
        sig.unlink()  # a stale signature over another index would only ever fail
    write_atomic(bundle_dir / INDEX, data)
    return PackResult(
        bundle_dir,
        index,
        sum(w for _, w in results),
        index.total_size,
        sum(e.object_size for e in index.entries),
        skipped,
    )
