"""A Storage that forwards every member of the interface to another one.

`StorageWrapper(inner)` is the base for layers over a backend (counting,
tracing, fault injection): a subclass overrides what it changes and inherits
an explicit forward of everything else, the hooks with defaults (`flush`,
`begin_write`, `object_ages`, `map`, ...) and the capability flags included.
A `__getattr__` would not do: it never fires for members `Storage` itself
defines, so those would silently be the base's defaults, not the backend's.
Every member is listed here by name, and a test checks none is missed.
"""
from __future__ import annotations

import numpy as np

from .base import Storage


class StorageWrapper(Storage):
    """Forwards to `inner`; subclasses override the members they change."""

    def __init__(self, inner: Storage):
        self.inner = inner

    # ------------------------------------------------ names and capabilities
    # Read from, and (as Storage's attributes are writable) set on, `inner`.

    @property
    def kind(self) -> str:
        return self.inner.kind

    @kind.setter
    def kind(self, value: str) -> None:
        self.inner.kind = value

    @property
    def url(self) -> str:
        return self.inner.url

    @url.setter
    def url(self, value: str) -> None:
        self.inner.url = value

    @property
    def shared(self) -> bool:
        return self.inner.shared

    @shared.setter
    def shared(self, value: bool) -> None:
        self.inner.shared = value

    @property
    def sizes_from_manifest(self) -> bool:
        return self.inner.sizes_from_manifest

    @sizes_from_manifest.setter
    def sizes_from_manifest(self, value: bool) -> None:
        self.inner.sizes_from_manifest = value

    @property
    def zero_copy(self) -> bool:
        return self.inner.zero_copy

    @zero_copy.setter
    def zero_copy(self, value: bool) -> None:
        self.inner.zero_copy = value

    @property
    def maps_cached(self) -> bool:
        return self.inner.maps_cached

    @maps_cached.setter
    def maps_cached(self, value: bool) -> None:
        self.inner.maps_cached = value

    @property
    def remote(self) -> bool:
        return self.inner.remote

    @remote.setter
    def remote(self, value: bool) -> None:
        self.inner.remote = value

    @property
    def create_only_commit(self) -> bool:
        return self.inner.create_only_commit

    @create_only_commit.setter
    def create_only_commit(self, value: bool) -> None:
        self.inner.create_only_commit = value

    @property
    def piece_bytes(self) -> int:
        return self.inner.piece_bytes

    @piece_bytes.setter
    def piece_bytes(self, value: int) -> None:
        self.inner.piece_bytes = value

    # ------------------------------------------------ writes

    def put(self, key: str, data: memoryview) -> None:
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.inner.put_if_absent(key, data)

    def put_parts(self, key: str, parts, size: int) -> None:
        self.inner.put_parts(key, parts, size)

    def put_stream(self, key: str, opener, size: int | None) -> None:
        self.inner.put_stream(key, opener, size)

    # ------------------------------------------------ reads

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> None:
        self.inner.read_into(key, out, offset)

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        return self.inner.read(key, max_bytes)

    def map(self, key: str, nbytes: int, offset: int = 0) -> np.ndarray | None:
        return self.inner.map(key, nbytes, offset)

    def place(self, key: str, region, file_offset: int, dest_offset: int,
              length: int) -> bool:
        return self.inner.place(key, region, file_offset, dest_offset, length)

    def resident(self, key: str, nbytes: int, offset: int = 0) -> bool:
        return self.inner.resident(key, nbytes, offset)

    def holding(self, prefix: str):
        return self.inner.holding(prefix)

    def size(self, key: str) -> int | None:
        return self.inner.size(key)

    def list(self, prefix: str = "", starts_with: str = "") -> list[str]:
        return self.inner.list(prefix, starts_with)

    def object_ages(self, prefix: str) -> dict[str, float] | None:
        return self.inner.object_ages(prefix)

    # ------------------------------------------------ deletes and hooks

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_dir(self, prefix: str) -> None:
        self.inner.delete_dir(prefix)

    def remove_empty_dir(self, prefix: str) -> bool:
        return self.inner.remove_empty_dir(prefix)

    def begin_write(self, prefix: str) -> None:
        self.inner.begin_write(prefix)

    def flush(self, prefix: str) -> None:
        self.inner.flush(prefix)

    def end_write(self, prefix: str) -> None:
        self.inner.end_write(prefix)

    def close(self) -> None:
        self.inner.close()
