"""What every bundle store is: the ``Store`` interface (named blobs), the URL of a blob in it, and the one bounded
retry of transient errors that every store's caller (push, install) goes through."""
from __future__ import annotations

import io
import time
from abc import ABC, abstractmethod
from typing import Callable

from ...errors import PrewarmError, StoreError

NOT_TRANSIENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, PrewarmError)


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


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
