"""One :class:`~resilience.checkpoint.storage.object_store.ObjectStore` per URL in a process
(:func:`open_store`): the boto3 client or msc profile is built once, and a pointer's ETag read at a
resume is the one the next conditional write expects."""

from __future__ import annotations

import threading

from resilience.checkpoint.storage.msc_store import MscStore
from resilience.checkpoint.storage.object_store import ObjectStore, split_url
from resilience.checkpoint.storage.s3_store import S3Store

_STORES: dict[str, ObjectStore] = {}
_STORES_LOCK = threading.Lock()


def open_store(url: str) -> ObjectStore:
    """The store for ``url`` (one per bucket/profile and prefix in a process: the pointers' ETags
    are remembered in it).

    Raises:
        ValueError: not an object-store URL.
        StoreUnavailable: the client library is missing, or its configuration names no such profile.
    """
    scheme, bucket, prefix = split_url(url)
    canonical = f"{scheme}://{bucket}/{prefix}"
    with _STORES_LOCK:
        store = _STORES.get(canonical)
        if store is None:
            store = S3Store(canonical) if scheme == "s3" else MscStore(canonical)
            _STORES[canonical] = store
    return store


def forget_stores() -> None:
    """Drop the cached stores (a test that restarts its endpoint, or changes credentials)."""
    with _STORES_LOCK:
        _STORES.clear()
