"""An S3 API server for tests (moto's, on loopback, as MinIO or AWS would answer), shared by the modules that
need one: `from tests.s3 import s3  # noqa: F401`.

The module-scoped fixture starts it on a free port with a bucket, points the AWS_* environment at it (fake
keys; put back as it was afterwards) and yields a `Store`: a boto3 client, that environment (for processes
started with an environment of their own: a Slurm job's is its submitter's), and the bytes the server sent
back to GET requests, by key: what readers fetched."""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import urllib.parse
from dataclasses import dataclass, field

import pytest

BUCKET = "launcher-ckpt"
SECRET = "fake-secret-key-0f1e2d"  # must never be written anywhere


@dataclass
class Store:
    client: object
    env: dict
    fetched: collections.Counter = field(default_factory=collections.Counter)  # key -> bytes sent to GETs

    def objects(self, prefix: str) -> list:
        """The keys under `prefix`, relative to it."""
        listed = self.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", [])
        return sorted(o["Key"][len(prefix) + 1:] for o in listed)

    def sizes(self, prefix: str) -> dict:
        listed = self.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", [])
        return {o["Key"]: o["Size"] for o in listed}

    def fetched_under(self, prefix: str) -> dict:
        """Bytes sent to GETs of each key under `prefix` (full keys), since the counter was last cleared."""
        return {k: n for k, n in self.fetched.items() if k.startswith(prefix + "/") and n}


class _Counting:
    """A WSGI app around moto's: the body bytes of each GET of an object, by key."""

    def __init__(self, app, fetched: collections.Counter):
        self.app, self.fetched, self.lock = app, fetched, threading.Lock()

    def __call__(self, environ, start_response):
        body = self.app(environ, start_response)
        path = urllib.parse.unquote(environ.get("PATH_INFO", ""))
        if environ.get("REQUEST_METHOD") != "GET" or not path.startswith(f"/{BUCKET}/"):
            return body
        key = path[len(BUCKET) + 2:]
        chunks = list(body)
        with self.lock:
            self.fetched[key] += sum(len(c) for c in chunks)
        return chunks


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import boto3
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    fetched: collections.Counter = collections.Counter()

    class Server(ThreadedMotoServer):  # moto 5.2's, its app wrapped to count what GETs return
        def _server_entry(self) -> None:
            app = _Counting(DomainDispatcherApplication(create_backend_app), fetched)
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = Server(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    try:
        yield Store(client, env, fetched)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
