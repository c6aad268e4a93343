"""A test's own HTTP server over a shared engine, and one JSON POST against it."""

from __future__ import annotations

import http.client
import json
from contextlib import contextmanager


@contextmanager
def http_server(llm, **config):
    """A ServerThread (gRPC on a free port, HTTP on another) over `llm`, stopped on exit."""
    from jaxinfer.serve.grpc_server import ServerConfig, ServerThread

    s = ServerThread(llm, ServerConfig(port=0, http_port=0, **config))
    try:
        yield s
    finally:
        s.stop()


def post_json(server, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    """(status, parsed JSON body) of POST `path` with `body`."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    return r.status, out
