"""An S3 endpoint that fails on purpose: a small HTTP proxy on loopback in front of a real S3 API server
(moto's, tests/test_remote_checkpoints.py), passing every request through but those whose path matches a
rule, which it answers as a failing store would:

    refuse   403 AccessDenied, as a bucket whose policy denies writes (s3fs: PermissionError)
    drop     the connection closed without an answer, as a store that went away mid-upload
    slow     passed through after a delay (seconds in `delay`)
    die      passed through, and then the store is gone: every later request's connection closed, every new
             one refused (the store's process killed)
    lost     passed through (the store holds what it wrote), and then the connection closed without an answer,
             as a store that went away before answering; `lost+die`: and then gone, as `die`

Rules change while a run uses the store (`store.rules = {...}`), so a test chooses which saves fail."""

from __future__ import annotations

import http.client
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List

WRITES = ("PUT", "POST", "DELETE")


class FlakyStore:
    def __init__(self, upstream: str):
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.rules: Dict[str, str] = {}  # regex on the request's path (writes only) -> refuse | drop | slow
        self.delay = 1.0
        self.failed: List[str] = []  # "METHOD path" of each request failed on purpose
        self.dead = False  # after a `die` rule's request: nothing answered any more
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def rule_for(self, method: str, path: str) -> str:
        if method not in WRITES:
            return ""
        for pattern, rule in list(self.rules.items()):
            if re.search(pattern, path):
                return rule
        return ""

    def die(self) -> None:
        """Gone: the listening socket closed (new connections refused), open ones closed at their next request."""
        if not self.dead:
            self.dead = True
            threading.Thread(target=self.close, daemon=True).start()  # shutdown() waits for serve_forever's loop

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(store: FlakyStore):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _any(self) -> None:
            body = self._body()
            rule = "drop" if store.dead else store.rule_for(self.command, self.path)
            if rule and rule != "die":
                store.failed.append(f"{self.command} {self.path}")
            if rule == "drop":
                self.close_connection = True
                self.connection.close()
                return
            if rule == "refuse":
                answer = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                          b"<Message>Access Denied</Message></Error>")
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                return
            if rule == "slow":
                time.sleep(store.delay)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "content-length")}
            headers["Content-Length"] = str(len(body))
            upstream = http.client.HTTPConnection(*store.upstream, timeout=60)
            try:
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                if rule.startswith("lost"):
                    self.close_connection = True
                    self.connection.close()
                    if rule == "lost+die":
                        store.die()
                    return
                self.send_response(answer.status, answer.reason)
                for k, v in answer.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection", "server", "date"):
                        self.send_header(k, v)
                size = answer.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", size)  # a HEAD's: the object's, with no body
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
            finally:
                upstream.close()
            if rule == "die":
                store.die()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    return Handler
