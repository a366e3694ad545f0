"""Pack a cache dir into a bundle dir (the format is bundle.py's): every entry's object written in parallel
(forked processes for a large cache: tar and zstd work is per entry) and flushed, then the signature, then
``index.json`` last, so a reader never sees an index whose objects or signature are missing. The cache dir is read
through its owner (cachedir.py): its layout (prewarm.shipping.layouts: the bundle's), its entries, the files of each without
Triton's in-flight ``tmp.pid_*`` dirs, and the fingerprint and manifest its build recorded (none recorded: this
machine's factors for the layout). A dir whose name is not a cache key of the Triton the bundle names
(``tritoncompat.key_dir_form``) is left out and reported: no node would accept it, nor would Triton look it up.
The index is assembled from each entry's canonical JSON: memory is O(1) per entry, not per file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..building import workers as workers_
from .bundle import INDEX, OBJECTS, SIGNATURE, Index, index_bytes, pack_entry, parse_index
from .cachedir import CacheDir, syncfs, write_atomic
from ..errors import EnvironmentProblem, IntegrityError
from .nodestamp import node_factors


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
        raise IntegrityError(f"{cache_dir}: not a directory (expected a cache dir)")
    try:
        return _pack(cache_dir, bundle_dir, signing_key, workers)
    except OSError as e:
        raise EnvironmentProblem(f"{e.filename or bundle_dir}: {e.strerror} (packing {cache_dir} into {bundle_dir})"
                                 ) from None


@dataclass
class _Job:
    cache: CacheDir
    keys: list[str]
    objects: Path


def _pack_range(start: int, stop: int) -> list[tuple[bytes, bool, int, int]]:
    job: _Job = workers_.shared()
    return [_pack_one(job, job.keys[i]) for i in range(start, stop)]


def _pack_one(job: _Job, key: str) -> tuple[bytes, bool, int, int]:
    """(the entry's canonical JSON, whether its object was written, its files' bytes, its object's bytes)."""
    entry, obj = pack_entry(job.cache.root / key, job.cache.files(key, in_flight=False), key, job.cache.layout.groups)
    dest = job.objects / entry.object
    written = not (dest.is_file() and dest.stat().st_size == len(obj) and dest.read_bytes() == obj)
    if written:  # an existing object is trusted only after comparing its bytes
        write_atomic(dest, obj, durable=False)  # flushed all at once, before the index
    return entry.to_json(), written, sum(f.size for f in entry.files), len(obj)


def _pack(cache_dir: Path, bundle_dir: Path, signing_key: str | os.PathLike | None, workers: int | None) -> PackResult:
    cache = CacheDir(cache_dir)
    layout = cache.layout
    record = cache.read_build_info()
    fp = record.get("fingerprint")
    fp = {str(k): str(v) for k, v in fp.items()} if isinstance(fp, dict) else node_factors(layout, None)[0]
    manifest = record.get("manifest") if isinstance(record.get("manifest"), dict) else None
    if manifest is not None:
        manifest = {"name": str(manifest.get("name", "")), "digest": str(manifest.get("digest", ""))}
    entries, skipped = cache.entries()
    form, _ = layout.key_check(fp)
    keys = [k for k in entries if form.fullmatch(k)]
    skipped = sorted(skipped + [k for k in entries if not form.fullmatch(k)])
    (bundle_dir / OBJECTS).mkdir(parents=True, exist_ok=True)
    processes = len(keys) >= workers_.PROCESSES_FROM
    n = workers or (workers_.cores() if processes else min(8, workers_.cores() + 1))
    step = max(1, min(64, len(keys) // (n * 16))) if processes else 1
    results = [r for chunk in workers_.run(_pack_range, workers_.ranges(len(keys), step),
                                           _Job(cache, keys, bundle_dir / OBJECTS), processes=processes, workers=n)
               for r in chunk]
    syncfs(bundle_dir)  # every object on disk before the index that names them: one flush, not an fsync per object
    data = index_bytes([r[0] for r in results], fp, manifest, layout=layout.name)
    written, bytes_in, bytes_out = (sum(r[i] for r in results) for i in (1, 2, 3))
    del results  # the entries' JSON now lives in the index bytes only
    sig = bundle_dir / SIGNATURE
    if signing_key:  # cryptography only where a bundle is signed (a node packing its own modules needs none)
        from . import signing

        write_atomic(sig, signing.sign(data, signing_key))
    elif sig.exists():
        sig.unlink()  # a stale signature over another index would only ever fail
    write_atomic(bundle_dir / INDEX, data)
    index = parse_index(data, str(bundle_dir / INDEX), check_files=False)  # what a reader will see
    return PackResult(bundle_dir, index, written, bytes_in, bytes_out, skipped)
