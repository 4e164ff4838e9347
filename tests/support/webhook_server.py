"""A real local HTTP server that receives notifications, checks their signature, and fails on demand."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    """What the server got: each request's headers and body, whether its signature was valid, and what it answered."""

    secret: str
    #: Answer these statuses first, in order, then 200.
    failures: list[int] = field(default_factory=list)
    #: Wait this many seconds before answering the first requests, in order, then answer at once.
    delays: list[float] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def valid(self, headers: dict[str, str], body: bytes) -> bool:
        timestamp = headers.get("X-Scheduler-Timestamp", "")
        expected = hmac.new(self.secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
        return hmac.compare_digest(headers.get("X-Scheduler-Signature", ""), f"sha256={expected}")

    def answered_ok(self) -> list[dict[str, Any]]:
        with self.lock:
            return [request for request in self.requests if request["status"] == 200]


@contextmanager
def webhook_server(
    secret: str = "s3cret", *, failures: list[int] | None = None, delays: list[float] | None = None
) -> Iterator[tuple[str, Received]]:
    """Serve on a free loopback port; yield its URL and what it receives."""
    received = Received(secret, list(failures or []), list(delays or []))

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            headers = dict(self.headers.items())
            with received.lock:
                delay = received.delays.pop(0) if received.delays else 0.0
            time.sleep(delay)  # a slow receiver: the sender may have given up meanwhile
            with received.lock:
                status = received.failures.pop(0) if received.failures else 200
                received.requests.append(
                    {
                        "headers": headers,
                        "path": self.path,
                        "body": json.loads(body)
                        if headers.get("Content-Type") == "application/json"
                        else body.decode(),
                        "signed": received.valid(headers, body),
                        "status": status,
                    }
                )
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", received
    finally:
        server.shutdown()
        server.server_close()
