"""A fault-injecting HTTP proxy for testing GCS clients against a real server
(and S3 clients: any plain-HTTP API, moto's server included).

`FaultProxy(upstream)` listens on 127.0.0.1 and forwards every request to
`upstream` (fake-gcs-server, say). For a chosen fraction of requests it
instead injects one of these faults, drawn at random (seeded):

- "429", "503": answers with that status and a GCS-style JSON error, without
  forwarding (with a `Retry-After: <retry_after>` header when one is set:
  seconds or an HTTP date, as servers send it);
- "reset": resets the connection (TCP RST) before forwarding anything;
- "reset_after": forwards the request, so it takes effect upstream, then
  resets the connection instead of answering: the client cannot tell whether
  its write landed, which is what a create-only commit must survive;
- "truncate": forwards, then sends the full headers and only half the body
  before closing;
- "stall": forwards after sleeping `stall_s` (for testing timeouts; not in the
  default mix).

`queue(*faults)` injects the given faults, in order, into the next matching
requests, whatever the fraction: deterministic tests of one fault each.
`pause()` holds every request as it arrives (an outage that answers
nothing) until `resume()`, when each goes on as it would have.
Upstream URLs in `Location` headers and JSON bodies are rewritten to the
proxy's, so resumable upload sessions come back through it too. `faulted`
counts the faults injected, `log` keeps (method, path, fault) per request and
`times` the wall-clock time (time.time()) each arrived, in the same order.
`match(method, path)` chooses the requests faults may hit (DELETEs only,
uploads only, ...).

    with FakeGcs() as gcs, FaultProxy(gcs.endpoint, fraction=0.2) as proxy:
        tier = GcsTier("gs://bkt/run", endpoint=proxy.endpoint)
"""
from __future__ import annotations

import collections
import http.client
import http.server
import json
import random
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable

FAULTS = ("429", "503", "reset", "reset_after", "truncate")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


class FaultProxy:
    def __init__(self, upstream: str, fraction: float = 0.0, faults=FAULTS, seed: int = 0,
                 stall_s: float = 5.0,
                 match: Callable[[str, str], bool] | None = None,
                 retry_after: str | None = None):
        self.upstream = upstream.rstrip("/")
        self.retry_after = retry_after
        self.fraction, self.faults = fraction, tuple(faults)
        self.stall_s, self.match = stall_s, match
        for f in self.faults:
            if f not in FAULTS + ("stall",):
                raise ValueError(f"unknown fault {f!r}; choose from {FAULTS + ('stall',)}")
        self._rng = random.Random(seed)
        self._queued: collections.deque = collections.deque()
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self.faulted: collections.Counter = collections.Counter()
        self.log: list[tuple[str, str, str | None]] = []
        self.times: list[float] = []
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "start() the proxy first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def set(self, fraction: float | None = None, faults=None, match=...,
            retry_after=...) -> None:
        """Changes what is injected from the next request on."""
        with self._lock:
            if retry_after is not ...:
                self.retry_after = retry_after
            if fraction is not None:
                self.fraction = fraction
            if faults is not None:
                self.faults = tuple(faults)
            if match is not ...:
                self.match = match

    def pause(self) -> None:
        """Holds every request from now on until `resume()`."""
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def queue(self, *faults: str) -> None:
        """Injects these faults into the next matching requests, in order."""
        with self._lock:
            self._queued.extend(faults)

    def _draw(self, method: str, path: str) -> str | None:
        with self._lock:
            fault = None
            if self.match is None or self.match(method, path):
                if self._queued:
                    fault = self._queued.popleft()
                elif self.fraction > 0 and self._rng.random() < self.fraction:
                    fault = self._rng.choice(self.faults)
            if fault is not None:
                self.faulted[fault] += 1
            self.log.append((method, path, fault))
            self.times.append(time.time())
            return fault

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                # Headers and body leave in separate writes; without this, Nagle's
                # algorithm and delayed ACKs add tens of ms to every request.
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, *args) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _any

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:
                import sys
                if not isinstance(sys.exc_info()[1], OSError):  # a client that went away is normal
                    super().handle_error(request, client_address)

        self._server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="rc-fault-proxy")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._open.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ one request

    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        body = _read_body(h)
        self._open.wait()
        fault = self._draw(h.command, h.path)
        if fault in ("429", "503"):
            msg = json.dumps({"error": {"code": int(fault), "message": f"injected {fault}"}})
            answer = {"Content-Type": "application/json"}
            if self.retry_after is not None:
                answer["Retry-After"] = self.retry_after
            return _answer(h, int(fault), answer, msg.encode())
        if fault == "reset":
            return _reset(h)
        if fault == "stall":
            time.sleep(self.stall_s)
        try:
            status, headers, payload = self._forward(h, body)
        except OSError as e:  # upstream gone (stopped at the end of a test, say)
            msg = json.dumps({"error": {"code": 502, "message": f"upstream: {e}"}})
            return _answer(h, 502, {"Content-Type": "application/json"}, msg.encode())
        if fault == "reset_after" or (fault == "truncate" and not payload):
            return _reset(h)
        if fault == "truncate":
            h.send_response(status)
            for k, v in headers:
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload[:len(payload) // 2])
            h.wfile.flush()
            h.close_connection = True
            return _reset(h)
        _answer(h, status, headers, payload)

    def _forward(self, h, body: bytes) -> tuple[int, list, bytes]:
        up = urllib.parse.urlparse(self.upstream)
        assert up.hostname is not None, self.upstream  # an http://host:port URL
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=120)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
            headers["Host"] = up.netloc
            conn.request(h.command, h.path, body=body if body or h.command in (
                "POST", "PUT", "PATCH") else None, headers=headers)
            r = conn.getresponse()
            payload = r.read()
            out = []
            for k, v in r.getheaders():
                # a HEAD's Content-Length is the object's size (S3 clients read it)
                if k.lower() in _HOP and (h.command, k.lower()) != ("HEAD", "content-length"):
                    continue
                if k.lower() == "location":
                    v = v.replace(self.upstream, self.endpoint)
                out.append((k, v))
            if "json" in (r.getheader("Content-Type") or ""):
                payload = payload.replace(self.upstream.encode(), self.endpoint.encode())
            return r.status, out, payload
        finally:
            conn.close()


def _read_body(h) -> bytes:
    if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
        parts: list[bytes] = []
        while True:
            size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(parts)
            parts.append(h.rfile.read(size))
            h.rfile.readline()
    n = int(h.headers.get("Content-Length") or 0)
    return h.rfile.read(n) if n else b""


def _answer(h, status: int, headers, payload: bytes) -> None:
    h.send_response(status)
    items = list(headers.items() if isinstance(headers, dict) else headers)
    for k, v in items:
        h.send_header(k, v)
    if not any(k.lower() == "content-length" for k, _ in items):
        h.send_header("Content-Length", str(len(payload)))
    h.end_headers()
    if h.command != "HEAD" and payload:
        h.wfile.write(payload)


def _reset(h) -> None:
    """Closes with RST (SO_LINGER 0): the client sees a connection reset."""
    h.close_connection = True
    try:
        h.wfile.flush()
    except OSError:
        pass
    sock = h.connection
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass
