"""``s3://bucket/prefix`` through boto3 (:class:`S3Store`), for any S3-compatible endpoint.

boto3 rather than fsspec/s3fs: the checkpoint needs exactly the six operations of
:class:`~resilience.checkpoint.storage.object_store.ObjectStore` plus conditional PUTs
(``IfMatch``/``IfNoneMatch``), which are plain ``put_object`` arguments here; s3transfer (boto3's)
uploads large files in parts and aborts the upload when a part fails; botocore's ``standard`` retry
mode backs off on 5xx, throttling and dropped connections, a bounded number of times
(``AWS_MAX_ATTEMPTS``, ``max_attempts`` in ``~/.aws/config``); and the endpoint and credentials are
botocore's own chain, which every AWS tool shares. s3fs adds an async layer (aiobotocore, pinned to
narrow botocore versions) and a file-system emulation this code does not use.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from resilience.checkpoint.storage.object_store import ObjectInfo, ObjectStore, PreconditionFailed, StoreError, StoreUnavailable

T = TypeVar("T")
_DELETE_BATCH = 1000  # DeleteObjects' limit
_CREDENTIAL_SOURCES = (
    "the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), AWS_PROFILE, ~/.aws/credentials, ~/.aws/config, "
    "web identity, container and instance metadata (botocore's chain)"
)


def _session() -> Any:
    try:
        import boto3
    except ImportError as exc:  # pragma: no cover - the storage extra is not installed
        raise StoreUnavailable("s3:// needs boto3: pip install 'resilience[storage]'") from exc
    return boto3.session.Session()


class S3Store(ObjectStore):
    """An S3 bucket and prefix (``s3://bucket/prefix``), through boto3; see the module docstring.

    Raises ``StoreUnavailable`` when boto3 is missing; credentials and the bucket are checked by
    :meth:`problem`, not here (a resume-only run on a public bucket needs no write probe).
    """

    def __init__(self, url: str):
        super().__init__(url)
        from botocore.config import Config

        self._session = _session()
        # standard retries (backoff with jitter on 5xx, throttling, connection errors) unless the user chose a mode
        retries = {} if self._session._session.get_config_variable("retry_mode") not in (None, "legacy") else {"mode": "standard"}
        self._client = self._session.client("s3", config=Config(retries=retries or None, connect_timeout=10, read_timeout=60))
        self.endpoint = self._client.meta.endpoint_url

    def _call(self, op: str, rel: str, fn: Callable[[], T]) -> T:
        """Run one request; botocore's errors become ``FileNotFoundError`` (no such key),
        :class:`PreconditionFailed` (a failed condition) or :class:`StoreError` naming the URL."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("NoSuchKey", "404", "NotFound") or (status == 404 and code != "NoSuchBucket"):
                raise FileNotFoundError(f"{self.url_of(rel)}: no such object") from None
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise PreconditionFailed(f"{self.url_of(rel)}: {op} refused: {code or status}") from exc
            raise StoreError(f"{self.url_of(rel)}: {op} failed at {self.endpoint}: {code or status}: {exc}") from exc
        except BotoCoreError as exc:
            raise StoreError(f"{self.url_of(rel)}: {op} failed at {self.endpoint}: {exc}") from exc

    def put_file(self, rel: str, local: Path) -> None:
        """See :meth:`ObjectStore.put_file`; s3transfer's multipart upload above 8 MiB, aborted on failure."""
        self._call("upload", rel, lambda: self._client.upload_file(str(local), self.bucket, self.key(rel)))

    def put_bytes(self, rel: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str | None:
        """See :meth:`ObjectStore.put_bytes`."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key(rel), "Body": data}
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        elif if_none_match:
            kwargs["IfNoneMatch"] = "*"
        response = self._call("PUT", rel, lambda: self._client.put_object(**kwargs))
        return response.get("ETag")

    def get_bytes(self, rel: str, offset: int = 0, length: int | None = None) -> bytes:
        """See :meth:`ObjectStore.get_bytes`."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key(rel)}
        if length == 0:
            return b""
        if offset or length is not None:
            kwargs["Range"] = f"bytes={offset}-{'' if length is None else offset + length - 1}"
        return self._call("GET", rel, lambda: self._client.get_object(**kwargs)["Body"].read())

    def get_file(self, rel: str, local: Path) -> None:
        """See :meth:`ObjectStore.get_file` (s3transfer: ranged parts in parallel for a large object)."""
        self._call("download", rel, lambda: self._client.download_file(self.bucket, self.key(rel), str(local)))

    def head(self, rel: str) -> ObjectInfo | None:
        """See :meth:`ObjectStore.head`."""
        try:
            response = self._call("HEAD", rel, lambda: self._client.head_object(Bucket=self.bucket, Key=self.key(rel)))
        except FileNotFoundError:
            return None
        return ObjectInfo(rel, int(response["ContentLength"]), response.get("ETag"))

    def list(self, prefix: str, *, recursive: bool = True) -> tuple[list[ObjectInfo], list[str]]:
        """See :meth:`ObjectStore.list`."""
        base = self.key(prefix)
        base = base + "/" if base else ""
        skip = len(self.prefix) + 1 if self.prefix else 0
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base}
        if not recursive:
            kwargs["Delimiter"] = "/"

        def run() -> tuple[list[ObjectInfo], list[str]]:
            objects, prefixes = [], []
            for page in self._client.get_paginator("list_objects_v2").paginate(**kwargs):
                objects += [ObjectInfo(o["Key"][skip:], int(o["Size"]), o.get("ETag")) for o in page.get("Contents", ())]
                prefixes += [p["Prefix"][len(base) :].rstrip("/") for p in page.get("CommonPrefixes", ())]
            return objects, prefixes

        return self._call("LIST", prefix, run)

    def delete(self, rels: Iterable[str]) -> None:
        """See :meth:`ObjectStore.delete` (DeleteObjects, 1,000 keys a request)."""
        rels = list(rels)
        for i in range(0, len(rels), _DELETE_BATCH):
            batch = rels[i : i + _DELETE_BATCH]
            request = {"Objects": [{"Key": self.key(rel)} for rel in batch], "Quiet": True}
            response = self._call("DELETE", batch[0], functools.partial(self._client.delete_objects, Bucket=self.bucket, Delete=request))
            errors = [e for e in response.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
            if errors:
                raise StoreError(
                    f"{self.url}: DELETE failed for {len(errors)} keys, first {errors[0].get('Key')}: {errors[0].get('Code')} {errors[0].get('Message')}"
                )

    def abort_uploads(self, prefix: str) -> int:
        """See :meth:`ObjectStore.abort_uploads` (ListMultipartUploads, then AbortMultipartUpload each)."""
        base = self.key(prefix)
        base = base + "/" if base else ""

        def run() -> int:
            aborted = 0
            for page in self._client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=base):
                for upload in page.get("Uploads", ()):
                    self._client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                    aborted += 1
            return aborted

        return self._call("abort uploads", prefix, run)

    def problem(self, *, saving: bool) -> str | None:
        """See :meth:`ObjectStore.problem`: credentials (botocore's chain), HeadBucket, then a write probe."""
        if self._session.get_credentials() is None:
            return f"no AWS credentials found for {self.url}; tried {_CREDENTIAL_SOURCES}"
        where = f"endpoint {self.endpoint}" + (
            "" if os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3") else " (set AWS_ENDPOINT_URL for another)"
        )
        try:
            self._call("HEAD bucket", "", lambda: self._client.head_bucket(Bucket=self.bucket))
        except FileNotFoundError:
            return f"bucket {self.bucket!r} does not exist at {where}"
        except StoreError as exc:
            text = str(exc)
            if "NoSuchBucket" in text:
                return f"bucket {self.bucket!r} does not exist at {where}"
            return f"cannot use bucket {self.bucket!r} at {where}: {text.split(': ', 1)[-1]}"
        return self.write_problem(f"at {where}") if saving else None
