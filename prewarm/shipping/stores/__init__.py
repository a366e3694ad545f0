"""Where bundles live: ``open_store`` opens the store a URL names (fs.py: a local dir or any fsspec filesystem;
oci.py: an OCI registry; both implement base.py's ``Store``), and ``push`` sends one bundle to many stores at once.

Without a URL, bundles go to the default store: ``$PREWARM_STORE`` (a path or URL), else
``~/.cache/prewarm/store``, under the bundle's name (the manifest name from the build record, else the bundle
dir's name).
"""
from __future__ import annotations

import io
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..bundle import INDEX, MAX_INDEX_BYTES, OBJECTS, SIGNATURE, check_object, open_regular, parse_index, read_bounded
from ...errors import IntegrityError, PrewarmError, StoreError
from .base import Store, join, retry
from .fs import OBJECT_PROTOCOLS, FsspecStore, LocalStore, ObjectStore


def _threads(n: int):
    import concurrent.futures  # here, not at import: a local install never pays for it

    return concurrent.futures.ThreadPoolExecutor(n)


def default_store_root() -> str:
    return os.environ.get("PREWARM_STORE") or str(Path.home() / ".cache" / "prewarm" / "store")


def bundle_name(bundle_dir: str | os.PathLike) -> str:
    """The manifest's name from the bundle's index, else the bundle dir's own name."""
    index = parse_index(Path(bundle_dir, INDEX).read_bytes(), str(bundle_dir))
    name = (index.manifest or {}).get("name") or Path(bundle_dir).resolve().name
    return name.replace("/", "_")


def open_store(url: str, storage_options: dict | None = None) -> Store:
    protocol, _, rest = url.partition("://")
    if not rest:
        return LocalStore(url)
    if protocol == "file":
        import fsspec  # here, not at import: a local install never pays for it

        return LocalStore(fsspec.core.strip_protocol(url))
    if protocol == "oci":
        from .oci import open_oci  # oras is imported only where a registry is used

        return open_oci(url, storage_options)
    cls = ObjectStore if protocol in OBJECT_PROTOCOLS else FsspecStore
    return retry(lambda: cls(url, storage_options), f"{url}: connect")


# --- push ----------------------------------------------------------------------------------------------------


@dataclass
class PushResult:
    url: str
    ok: bool = False
    sent: int = 0
    present: int = 0  # objects the target already had (intact, where checked)
    repaired: int = 0  # objects the target had that did not match their name or size: sent again
    bytes_sent: int = 0
    retries: int = 0
    seconds: float = 0.0
    error: str = ""
    errors: list[str] = field(default_factory=list)  # each transient error that was retried


def _push_one(bundle_dir: Path, url: str, storage_options: dict | None, attempts: int, backoff: float, progress,
              workers: int, verify_remote: bool | None) -> PushResult:
    res = PushResult(url)
    t0 = time.monotonic()
    lock = threading.Lock()  # the counters are updated from the object-sending threads

    def note(e: Exception) -> None:
        res.retries += 1
        res.errors.append(f"{type(e).__name__}: {e}")
        if isinstance(store, FsspecStore):
            try:
                store.reconnect()
            except Exception:
                pass  # the next attempt reports it

    def attempt(fn, what):
        return retry(fn, f"{url}: {what}", attempts=attempts, backoff=backoff, on_retry=note)

    store = None
    try:
        store = open_store(url, storage_options)
        where = str(bundle_dir / INDEX)
        index_bytes = read_bounded(open_regular(bundle_dir / INDEX, where), MAX_INDEX_BYTES, where)
        index = parse_index(index_bytes, where)
        entries = {e.object: e for e in index.entries}
        have = set(entries) - attempt(lambda: store.missing(set(entries)), "look up objects")
        if verify_remote if verify_remote is not None else isinstance(store, LocalStore):

            def intact(name: str) -> bool:
                try:
                    attempt(lambda: check_object(store.open(f"{OBJECTS}/{name}"), entries[name], url),
                            f"check {OBJECTS}/{name}")
                    return True
                except (IntegrityError, FileNotFoundError):
                    return False

            with _threads(workers) as pool:
                bad = {n for n, ok in zip(sorted(have), pool.map(intact, sorted(have))) if not ok}
            res.repaired = len(bad)
            have -= bad
        todo = sorted(set(entries) - have)
        res.present = len(have)
        if progress:
            progress(url, 0, len(todo))

        def send(name: str) -> None:
            local = str(bundle_dir / OBJECTS / name)
            data = read_bounded(open_regular(local), entries[name].object_size, local)
            check_object(io.BytesIO(data), entries[name], f"{bundle_dir} (local bundle; re-pack it)")
            attempt(lambda: store.write(f"{OBJECTS}/{name}", data), f"write {OBJECTS}/{name}")
            with lock:
                res.sent += 1
                res.bytes_sent += len(data)
                done = res.sent
            if progress:
                progress(url, done, len(todo))

        with _threads(workers) as pool:
            for f in [pool.submit(send, n) for n in todo]:
                f.result()
        sig = bundle_dir / SIGNATURE
        if sig.exists():
            attempt(lambda: store.write(SIGNATURE, sig.read_bytes()), f"write {SIGNATURE}")
        attempt(lambda: store.write(INDEX, index_bytes), f"write {INDEX}")
        res.ok = True
    except Exception as e:  # one target's failure never stops the others: it is reported in its row
        res.error = str(e) if isinstance(e, PrewarmError) else f"{type(e).__name__}: {e}"
    res.seconds = time.monotonic() - t0
    return res


def push(
    bundle_dir: str | os.PathLike,
    urls: list[str],
    *,
    storage_options: dict | None = None,
    attempts: int = 4,
    backoff: float = 0.25,
    workers: int = 4,
    progress: Callable[[str, int, int], None] | None = None,
    verify_remote: bool | None = None,
) -> list[PushResult]:
    """Push one bundle to every URL concurrently; a result per URL, in the order given.

    Every local object is checked against the index before it is sent. ``verify_remote`` (default: for local and
    ``file://`` stores, where it costs a local read) also checks the objects a store already has, by size and
    sha256, and sends bad ones again; otherwise an object present by name is trusted.

    ``progress(url, objects sent, objects to send)`` once the target's listing is known, then after each object
    (from worker threads)."""
    bundle_dir = Path(bundle_dir)
    if not (bundle_dir / INDEX).is_file():
        raise StoreError(f"{bundle_dir}: not a bundle dir (no {INDEX}; make one with `prewarm pack`)")
    if not urls:
        urls = [join(default_store_root(), bundle_name(bundle_dir))]
    with _threads(len(urls)) as pool:
        futures = [
            pool.submit(_push_one, bundle_dir, u, storage_options, attempts, backoff, progress, workers, verify_remote)
            for u in urls
        ]
        return [f.result() for f in futures]
