"""Where bundles live: a small ``Store`` interface over fsspec, and push to many stores at once.

A store URL is the bundle's own location (it holds ``index.json`` and ``objects/``): ``file:///srv/b``,
``s3://bucket/kda``, ``sftp://user@host:2222/srv/kda``, or any other fsspec URL. Credentials and endpoints come
from fsspec's own configuration (``FSSPEC_S3='{"endpoint_url": ...}'``, ``FSSPEC_SFTP='{"client_keys": [...]}'``,
or files in ``FSSPEC_CONFIG_DIR``) or the ``storage_options`` argument, so nothing here is protocol-specific
beyond how a file is made to appear atomically.

Without a URL, bundles go to the default store: ``$PREWARM_STORE`` (a path or URL), else
``~/.cache/prewarm/store``, under the bundle's name (the manifest name from the build record, else the bundle
dir's name).
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import io
import os
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import fsspec

from .bundle import INDEX, MAX_INDEX_BYTES, OBJECTS, SIGNATURE, check_object, open_regular, parse_index, read_bounded
from .cachedir import write_atomic
from .errors import IntegrityError, PrewarmError, StoreError

# Protocols whose PUT is atomic by itself (no partial object is ever visible): written directly.
OBJECT_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"}
NOT_TRANSIENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, PrewarmError)


def default_store_root() -> str:
    return os.environ.get("PREWARM_STORE") or str(Path.home() / ".cache" / "prewarm" / "store")


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def bundle_name(bundle_dir: str | os.PathLike) -> str:
    """The manifest's name from the bundle's index, else the bundle dir's own name."""
    index = parse_index(Path(bundle_dir, INDEX).read_bytes(), str(bundle_dir))
    name = (index.manifest or {}).get("name") or Path(bundle_dir).resolve().name
    return name.replace("/", "_")


def retry(fn: Callable, what: str, *, attempts: int = 4, backoff: float = 0.25, on_retry: Callable | None = None):
    """Run ``fn``; retry transient errors with exponential backoff; StoreError naming ``what`` at the end."""
    for i in range(attempts):
        try:
            return fn()
        except NOT_TRANSIENT:
            raise
        except Exception as e:
            if i == attempts - 1:
                raise StoreError(f"{what}: failed after {attempts} attempts: {type(e).__name__}: {e}") from e
            if on_retry:
                on_retry(e)
            time.sleep(backoff * 2**i)


class Store(ABC):
    """A bundle location: named blobs (``index.json``, ``index.json.sig``, ``objects/<sha>.tar.zst``)."""

    url: str

    @abstractmethod
    def read(self, name: str) -> bytes:
        """The blob's bytes; FileNotFoundError when absent."""

    @abstractmethod
    def write(self, name: str, data: bytes) -> None:
        """Store a blob so that readers see either nothing or all of it."""

    @abstractmethod
    def list_objects(self) -> set[str]:
        """Names of the objects present (an empty set for a new store)."""

    def missing(self, names: set[str]) -> set[str]:
        """Which of these objects the store lacks (an OCI registry cannot list: it asks blob by blob)."""
        return names - self.list_objects()

    def open(self, name: str):
        """A readable binary stream of the blob (read in pieces); FileNotFoundError when absent. Stores that can
        hold things other than plain files refuse them here, before reading (a FIFO would hang the reader)."""
        return io.BytesIO(self.read(name))


class LocalStore(Store):
    """A local directory: each file written whole (``cachedir.write_atomic``)."""

    def __init__(self, path: str | os.PathLike):
        self.root = Path(path)
        self.url = str(self.root)

    def read(self, name: str) -> bytes:
        with self.open(name) as f:
            return f.read()

    def open(self, name: str):
        try:
            return open_regular(self.root / name, join(self.url, name))
        except NotADirectoryError:  # a file where a dir of the path should be: nothing by that name here
            raise FileNotFoundError(errno.ENOENT, "not found", str(self.root / name)) from None

    def write(self, name: str, data: bytes) -> None:
        dest = self.root / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(dest, data)

    def list_objects(self) -> set[str]:
        try:
            return {n for n in os.listdir(self.root / OBJECTS) if not n.startswith(".")}
        except FileNotFoundError:
            return set()


class FsspecStore(Store):
    """Any fsspec filesystem: a write lands under a temp name and is moved into place (sftp, ftp, hdfs...)."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url
        self._options = storage_options or {}
        self.fs, self.path = fsspec.core.url_to_fs(url, **self._options)

    def reconnect(self) -> None:
        """A fresh filesystem instance: after a dropped connection the cached one stays broken (sftp)."""
        self.fs, self.path = fsspec.core.url_to_fs(url=self.url, skip_instance_cache=True, **self._options)

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(join(self.path, name))

    def open(self, name: str):
        path = join(self.path, name)
        info = self.fs.info(path)  # FileNotFoundError when absent
        if info.get("type") != "file":
            raise IntegrityError(f"{join(self.url, name)}: not a regular file ({info.get('type')}): refused")
        return self.fs.open(path, "rb")

    def write(self, name: str, data: bytes) -> None:
        dest = join(self.path, name)
        self.fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{dest}.{uuid.uuid4().hex}.tmp"
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, dest)
        except BaseException:
            try:
                self.fs.rm_file(tmp)
            except Exception:
                pass  # the connection itself failed: nothing more can be removed now
            raise

    def list_objects(self) -> set[str]:
        path = join(self.path, OBJECTS)
        self.fs.invalidate_cache(path)
        try:
            names = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return set()
        return {n.rstrip("/").rsplit("/", 1)[-1] for n in names} - {""}


class ObjectStore(FsspecStore):
    """Object stores (S3, GCS, Azure): a PUT is atomic, so objects are written directly."""

    def open(self, name: str):
        return self.fs.open(join(self.path, name), "rb")  # an object store holds objects only

    def write(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(join(self.path, name), data)


def open_store(url: str, storage_options: dict | None = None) -> Store:
    protocol, _, rest = url.partition("://")
    if not rest:
        return LocalStore(url)
    if protocol == "file":
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

            with cf.ThreadPoolExecutor(workers) as pool:
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

        with cf.ThreadPoolExecutor(workers) as pool:
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
    with cf.ThreadPoolExecutor(len(urls)) as pool:
        futures = [
            pool.submit(_push_one, bundle_dir, u, storage_options, attempts, backoff, progress, workers, verify_remote)
            for u in urls
        ]
        return [f.result() for f in futures]
