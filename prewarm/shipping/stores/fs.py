"""Bundle stores on fsspec filesystems: a local directory, object stores (S3, GCS, Azure) and any other fsspec URL.

A store URL is the bundle's own location (it holds ``index.json`` and ``objects/``): ``file:///srv/b``,
``s3://bucket/kda``, ``sftp://user@host:2222/srv/kda``, or any other fsspec URL. Credentials and endpoints come
from fsspec's own configuration (``FSSPEC_S3='{"endpoint_url": ...}'``, ``FSSPEC_SFTP='{"client_keys": [...]}'``,
or files in ``FSSPEC_CONFIG_DIR``) or the ``storage_options`` argument, so nothing here is protocol-specific
beyond how a file is made to appear atomically.
"""
from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from ..bundle import OBJECTS, open_regular
from ..cachedir import write_atomic
from ...errors import IntegrityError, StoreError
from .base import Store, join

# Protocols whose PUT is atomic by itself (no partial object is ever visible): written directly.
OBJECT_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"}


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
        except IntegrityError as e:  # a dir, FIFO or device where a blob should be: the store's fault, not the bundle's
            raise StoreError(str(e)) from None

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
        import fsspec  # here, not at import: a local install never pays for it

        self.fs, self.path = fsspec.core.url_to_fs(url, **self._options)

    def reconnect(self) -> None:
        """A fresh filesystem instance: after a dropped connection the cached one stays broken (sftp)."""
        import fsspec

        self.fs, self.path = fsspec.core.url_to_fs(url=self.url, skip_instance_cache=True, **self._options)

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(join(self.path, name))

    def open(self, name: str):
        path = join(self.path, name)
        info = self.fs.info(path)  # FileNotFoundError when absent
        if info.get("type") != "file":  # as LocalStore: the store's fault
            raise StoreError(f"{join(self.url, name)}: not a regular file ({info.get('type')}): refused")
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
