"""Pack a cache dir into a bundle dir (the format is bundle.py's): every entry's object written in parallel
(forked processes for a large cache: tar and zstd work is per entry) and flushed, then the signature, then
``index.json`` last, so a reader never sees an index whose objects or signature are missing. The cache dir is read
through its owner (cachedir.py): its layout (prewarm.shipping.layouts: the bundle's), its entries, the files of each without
Triton's in-flight ``tmp.pid_*`` dirs, and the fingerprint and manifest its build recorded (none recorded: this
machine's factors for the layout). A dir whose name is not a cache key of the Triton the bundle names
(``tritoncompat.key_dir_form``) is left out and reported: no node would accept it, nor would Triton look it up.
An entry of a JIT layout ships only what its library's loader reads (prewarm.shipping.payload: its module, native
code, and JSON metadata); its build's leftovers are left out and reported, anything else refused by name. The index
carries the build's sequence (``sequence``: given, else the build's time, the newest mtime of the build record and
the files packed, in whole seconds: the same dir packs to the same bytes). The index is assembled from each entry's
canonical JSON: memory is O(1) per entry, not per file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..building import workers as workers_
from . import payload
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
    left_out: list[str] = field(default_factory=list)  # JIT entries' build leftovers no loader reads ("key/name")


def pack(
    cache_dir: str | os.PathLike,
    bundle_dir: str | os.PathLike,
    *,
    signing_key: str | os.PathLike | None = None,
    workers: int | None = None,
    sequence: int | None = None,
) -> PackResult:
    """Cache dir -> bundle dir. Objects already in ``bundle_dir`` with the same bytes are reused; the index is
    written last. ``sequence``: the build's (an integer >= 0; default: the build's time). A local write or read
    failure (full or read-only disk) is an EnvironmentProblem."""
    cache_dir, bundle_dir = Path(cache_dir), Path(bundle_dir)
    if not cache_dir.is_dir():
        raise IntegrityError(f"{cache_dir}: not a directory (expected a cache dir)")
    try:
        return _pack(cache_dir, bundle_dir, signing_key, workers, sequence)
    except OSError as e:
        raise EnvironmentProblem(f"{e.filename or bundle_dir}: {e.strerror} (packing {cache_dir} into {bundle_dir})"
                                 ) from None


@dataclass
class _Job:
    cache: CacheDir
    keys: list[str]
    objects: Path


def _pack_range(start: int, stop: int) -> list[tuple[bytes, bool, int, int, list[str], int]]:
    job: _Job = workers_.shared()
    return [_pack_one(job, job.keys[i]) for i in range(start, stop)]


def _pack_one(job: _Job, key: str) -> tuple[bytes, bool, int, int, list[str], int]:
    """(the entry's canonical JSON, whether its object was written, its files' bytes, its object's bytes, the
    build leftovers left out, its files' newest mtime in seconds)."""
    layout, entry_dir = job.cache.layout, job.cache.root / key
    names, left = payload.sort(layout, key, job.cache.files(key, in_flight=False), str(job.cache.root))
    if (module := payload.module(layout, key)) in names:
        payload.check_native(layout, key, payload.read_head(str(entry_dir / module)), str(job.cache.root))
    newest = max((int(os.lstat(entry_dir / name).st_mtime) for name in names), default=0)
    entry, obj = pack_entry(entry_dir, names, key, layout.groups)
    dest = job.objects / entry.object
    written = not (dest.is_file() and dest.stat().st_size == len(obj) and dest.read_bytes() == obj)
    if written:  # an existing object is trusted only after comparing its bytes
        write_atomic(dest, obj, durable=False)  # flushed all at once, before the index
    return entry.to_json(), written, sum(f.size for f in entry.files), len(obj), [f"{key}/{n}" for n in left], newest


def _pack(cache_dir: Path, bundle_dir: Path, signing_key: str | os.PathLike | None, workers: int | None,
          sequence: int | None) -> PackResult:
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
    if sequence is None:  # the build's time: its record's (rewritten by every build) or its newest file's
        recorded = int(os.stat(cache.build_info).st_mtime) if cache.build_info.is_file() else 0
        sequence = max([recorded] + [r[5] for r in results])
    data = index_bytes([r[0] for r in results], fp, manifest, layout=layout.name, sequence=sequence)
    written, bytes_in, bytes_out = (sum(r[i] for r in results) for i in (1, 2, 3))
    left_out = sorted(name for r in results for name in r[4])
    del results  # the entries' JSON now lives in the index bytes only
    sig = bundle_dir / SIGNATURE
    if signing_key:  # cryptography only where a bundle is signed (a node packing its own modules needs none)
        from . import signing

        write_atomic(sig, signing.sign(data, signing_key))
    elif sig.exists():
        sig.unlink()  # a stale signature over another index would only ever fail
    write_atomic(bundle_dir / INDEX, data)
    index = parse_index(data, str(bundle_dir / INDEX), check_files=False)  # what a reader will see
    return PackResult(bundle_dir, index, written, bytes_in, bytes_out, skipped, left_out)
