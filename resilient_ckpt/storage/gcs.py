"""The GCS backend: a tier's objects under gs://bucket/prefix.

Client: google-cloud-storage (chosen by measurement, docs/gcs.md) for small
uploads, the commit, compose, listing and deleting, with its own retries off
and ours on (storage/retry.py). Ranged reads and part uploads go through the
same authorized HTTP session, streamed straight into or out of our buffers:
reads measured faster than the client's own download path (docs/gcs.md).

- Writes: `put` and `put_stream` are split by a GcsUploads
  (storage/gcs_upload.py) into requests of this class: one request
  (`put_media`) up to `piece_bytes`, larger objects as parts composed
  (`compose`) into the final object.
- `put_if_absent` (the commit) is a multipart upload with
  `if_generation_match=0`. If it is refused (412) the object is read back: a
  retried request whose first try had in fact landed finds its own bytes there
  and counts as committed; anything else means another writer won.
- A read checks that the body has every byte asked for; a short body is
  retried, an object that is really shorter is an error.
- Finding steps never lists every object: `list` lists one level (step
  directories), and with `starts_with` only names with that start (a step's
  manifests), filtered by the server; chunk sizes come from the manifests
  (`sizes_from_manifest`) and are checked on read.

Every failure leaves as StorageError (an OSError) naming the gs:// path.
"""
from __future__ import annotations

import base64
import concurrent.futures as cf
import errno
import io
import os
import time
import urllib.parse
from collections.abc import Callable

import numpy as np

from ..errors import CheckpointError, StorageError
from ..native import crc32c
from .base import Storage, check_size, ours_already, read_in_ranges
from .gcs_upload import GcsUploads, _Status
from .retry import Attempts, RetryPolicy, Transient, http_status


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of gs://bucket/prefix; raises ValueError when malformed."""
    if not url.startswith("gs://"):
        raise ValueError(f"{url!r} is not a gs:// URL (expected gs://bucket/prefix)")
    bucket, _, prefix = url[5:].partition("/")
    if not bucket or "*" in bucket or "?" in bucket:
        raise ValueError(f"{url!r}: no bucket name (expected gs://bucket/prefix)")
    return bucket, prefix.strip("/")


def _endpoint(endpoint: str | None) -> str | None:
    """The API endpoint: the one given, the emulator's (STORAGE_EMULATOR_HOST, the
    client's own standard variable) or None for Google's."""
    ep = endpoint or os.environ.get("STORAGE_EMULATOR_HOST") or None
    if ep and "://" not in ep:
        ep = "http://" + ep
    return ep.rstrip("/") if ep else None


class GcsStorage(Storage):
    """The objects of gs://bucket/prefix (see the module's docstring)."""

    kind = "gcs"
    shared = True
    remote = True
    sizes_from_manifest = True

    def __init__(self, url: str, *, endpoint: str | None = None,
                 retry: RetryPolicy = RetryPolicy(), concurrency: int = 8,
                 piece_bytes: int = 64 * 2**20):
        import requests.adapters
        from google.auth.transport.requests import AuthorizedSession
        from google.cloud import storage as gcs

        self.bucket_name, self.prefix = parse_url(url)
        self.url = f"gs://{self.bucket_name}" + (f"/{self.prefix}" if self.prefix else "")
        self.retry = retry
        self.piece_bytes = max(1 << 16, piece_bytes)
        self.concurrency = concurrency
        ep = _endpoint(endpoint)
        creds, project = _credentials(ep)
        # One session (and connection pool) for the client and our ranged reads,
        # sized for the concurrency we bring; transport-level retries stay off.
        self._session = AuthorizedSession(creds)
        adapter = requests.adapters.HTTPAdapter(pool_connections=4,
                                                pool_maxsize=4 * concurrency + 8, max_retries=0)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        opts = {"api_endpoint": ep} if ep else None
        self._client = gcs.Client(project=project, credentials=creds, client_options=opts,
                                  _http=self._session)
        self._bucket = self._client.bucket(self.bucket_name)
        self._api = self._client.api_endpoint.rstrip("/")
        self._pool = cf.ThreadPoolExecutor(concurrency, thread_name_prefix="rc-gcs")
        self._attempts = Attempts()
        self._uploads = GcsUploads(self)

    # ------------------------------------------------------------ helpers

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def where(self, key: str) -> str:
        """`key`'s gs:// URL, as errors name it."""
        return f"{self.url}/{key}" if key else self.url

    def in_parallel(self, fn: Callable[[str], None], keys: list[str]) -> None:
        """Calls `fn` on each key in the store's thread pool; waits for all
        (the first failure raised)."""
        for f in [self._pool.submit(fn, k) for k in keys]:
            f.result()

    def _timeout(self) -> tuple[float, float]:
        return (min(10.0, self.retry.attempt_timeout_s), self.retry.attempt_timeout_s)

    def _call(self, fn: Callable, what: str, key: str):
        return self._attempts.call(fn, self.retry, f"{what} {self.where(key)}",
                                   lambda e: self._final(e, what, key))

    @property
    def requests(self) -> int:
        """Attempts made so far (for tests and records)."""
        return self._attempts.count

    def _final(self, e: BaseException, what: str, key: str) -> BaseException:
        if isinstance(e, CheckpointError):
            return e  # ours already (a source that failed mid-upload, say)
        status = http_status(e)
        where = self.where(key)
        if status == 404:
            return StorageError(errno.ENOENT, f"{what} {where}: not found (HTTP 404); does "
                                              f"the bucket {self.bucket_name} exist?")
        if status in (401, 403):
            return StorageError(errno.EACCES, f"{what} {where}: permission denied (HTTP "
                                              f"{status}); check the credentials and the "
                                              "bucket's IAM (needs storage.objects.*)")
        return StorageError(errno.EIO, f"{what} {where} failed: {type(e).__name__}: "
                                       f"{str(e)[:300]}")

    # ------------------------------------------------------------ writes

    def put(self, key: str, data) -> None:
        self._uploads.put(key, data)

    def put_stream(self, key: str, opener: Callable[[], io.RawIOBase], size: int | None) -> None:
        """Uploads what `opener()` reads: one request up to `piece_bytes`;
        larger, or of unknown size (compressed on the fly), read once in
        `piece_bytes` parts, each uploaded and retried on its own, then composed
        into `key` and checked against the crc32c of what was read."""
        self._uploads.put_stream(key, opener, size)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        from google.api_core.exceptions import PreconditionFailed

        data = bytes(data)

        def attempt() -> bool:
            blob = self._bucket.blob(self._name(key))
            try:
                # Up to 8 MiB this is one multipart request, the kind the
                # emulator also holds to the precondition (docs/environment.md).
                blob.upload_from_file(io.BytesIO(data), size=len(data), if_generation_match=0,
                                      checksum="crc32c", retry=None, timeout=self._timeout())
                return True
            except PreconditionFailed:
                return False
        return self._call(attempt, "commit of", key) or ours_already(self, key, data)

    def put_media(self, key: str, data) -> None:
        """One upload request (no precondition), checked against the size and
        crc32c the server reports."""
        url = (f"{self._api}/upload/storage/v1/b/{self.bucket_name}/o?uploadType=media&name="
               + urllib.parse.quote(self._name(key), safe=""))
        want = base64.b64encode(crc32c.value(np.frombuffer(data, np.uint8))
                                .to_bytes(4, "big")).decode()

        def attempt():
            resp = self._session.post(url, data=data, timeout=self._timeout(),
                                      headers={"Content-Type": "application/octet-stream"})
            if resp.status_code != 200:
                raise _Status(resp.status_code, resp.text, resp.headers)
            got = resp.json()
            if int(got.get("size", -1)) != len(data) or got.get("crc32c", want) != want:
                raise Transient(f"stored {got.get('size')} bytes with crc32c "
                                f"{got.get('crc32c')}; sent {len(data)} with {want}")
        self._call(attempt, "upload of", key)

    def compose(self, key: str, parts: list[str]):
        """One compose request: `parts` (at most 32) into `key`; its blob."""
        def attempt():
            blob = self._bucket.blob(self._name(key))
            blob.compose([self._bucket.blob(self._name(p)) for p in parts], retry=None,
                         timeout=self._timeout())
            return blob
        return self._call(attempt, "compose of", key)

    # ------------------------------------------------------------ reads

    def _media_url(self, key: str) -> str:
        name = urllib.parse.quote(self._name(key), safe="")
        return f"{self._api}/download/storage/v1/b/{self.bucket_name}/o/{name}?alt=media"

    def _get_into(self, key: str, view: memoryview, offset: int, whole: bool = False) -> None:
        headers = {"Accept-Encoding": "identity"}
        if not whole:
            headers["Range"] = f"bytes={offset}-{offset + len(view) - 1}"
        resp = self._session.get(self._media_url(key), headers=headers, stream=True,
                                 timeout=self._timeout())
        try:
            if resp.status_code == 416:
                raise StorageError(errno.EIO, f"{self.where(key)}: shorter than byte "
                                              f"{offset + len(view)}; the object is truncated")
            if resp.status_code not in (200, 206):
                raise _Status(resp.status_code, resp.text, resp.headers)
            if resp.status_code == 200 and offset and not whole:
                raise _Status(500, "the server ignored the Range header")
            got = 0
            while got < len(view):
                n = resp.raw.readinto(view[got:])
                if not n:
                    break
                got += n
            if got < len(view):
                total = resp.headers.get("Content-Range", "").rpartition("/")[2]
                if total.isdigit() and int(total) < offset + len(view):
                    raise StorageError(errno.EIO, f"{self.where(key)}: {total} bytes, "
                                                  f"fewer than the {offset + len(view)} "
                                                  "expected; the object is truncated")
                raise Transient(f"body cut short at {got} of {len(view)} bytes")
        finally:
            resp.close()

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> None:
        read_in_ranges(self._pool, lambda v, at: self._call(
            lambda: self._get_into(key, v, at), "read of", key), out, offset)

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        def attempt() -> bytes:
            resp = self._session.get(self._media_url(key), headers={"Accept-Encoding": "identity"},
                                     timeout=self._timeout(), stream=True)
            try:
                if resp.status_code != 200:
                    raise _Status(resp.status_code, resp.text, resp.headers)
                n = resp.headers.get("Content-Length")
                if n is not None and n.isdigit():
                    check_size(self.where(key), int(n), max_bytes)
                parts, got = [], 0
                for part in resp.iter_content(1 << 20):  # stops past max_bytes, unsized too
                    got += len(part)
                    check_size(self.where(key), got, max_bytes)
                    parts.append(part)
                if n is not None and n.isdigit() and int(n) != got:
                    raise Transient(f"body cut short at {got} of {n} bytes")
                return b"".join(parts)
            finally:
                resp.close()
        return self._call(attempt, "read of", key)

    def size(self, key: str) -> int | None:
        blob = self._call(lambda: self._bucket.get_blob(self._name(key), retry=None,
                                                        timeout=self._timeout()),
                          "size of", key)
        return None if blob is None else int(blob.size)

    # ------------------------------------------------------------ listing

    def _list(self, prefix: str, delimiter: str | None) -> list:
        """(names relative to `prefix`, blobs) of one listing, all pages, retried
        as a whole (a page can fail halfway)."""
        full = self._name(prefix)

        def attempt():
            it = self._client.list_blobs(self.bucket_name, prefix=full, delimiter=delimiter,
                                         retry=None, timeout=self._timeout())
            blobs = list(it)
            return blobs, sorted(it.prefixes) if delimiter else []
        return self._call(attempt, "listing of", prefix)

    def list(self, prefix: str = "", starts_with: str = "") -> list[str]:
        base = f"{prefix}/" if prefix else ""
        blobs, prefixes = self._list(base + starts_with, "/")
        cut = len(self._name(base))
        return sorted({b.name[cut:] for b in blobs} | {p[cut:].rstrip("/") for p in prefixes})

    def object_ages(self, prefix: str) -> dict[str, float]:
        blobs, _ = self._list(f"{prefix}/", None)
        cut, now = len(self._name(f"{prefix}/")), time.time()
        return {b.name[cut:]: now - (b.updated or b.time_created).timestamp() for b in blobs}

    # ------------------------------------------------------------ deleting

    def delete(self, key: str) -> None:
        from google.api_core.exceptions import NotFound

        def attempt():
            try:
                self._bucket.blob(self._name(key)).delete(retry=None, timeout=self._timeout())
            except NotFound:
                pass  # gone already, maybe by our own earlier attempt
        self._call(attempt, "delete of", key)

    def delete_dir(self, prefix: str) -> None:
        blobs, _ = self._list(f"{prefix}/", None)
        cut = len(self._name(""))
        self.in_parallel(self.delete, [b.name[cut:] for b in blobs])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._session.close()


def _credentials(endpoint: str | None):
    """(credentials, project): anonymous for an emulator (plain http, as
    fake-gcs-server serves, or the STORAGE_EMULATOR_HOST the client itself
    treats as one), else the application default credentials."""
    if endpoint is not None and (urllib.parse.urlparse(endpoint).scheme == "http"
                                 or os.environ.get("STORAGE_EMULATOR_HOST")):
        from google.auth.credentials import AnonymousCredentials
        return AnonymousCredentials(), "emulator"
    import google.auth
    import google.auth.exceptions
    try:
        return google.auth.default(
            scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
    except google.auth.exceptions.DefaultCredentialsError as e:
        raise StorageError(errno.EACCES, f"no Google credentials for GCS: {e}; run "
                                         "`gcloud auth application-default login` or set "
                                         "GOOGLE_APPLICATION_CREDENTIALS") from None
