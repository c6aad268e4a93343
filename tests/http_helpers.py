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


def call(server, method: str, path: str, body=None, token: str | None = None,
         timeout: float = 120) -> tuple[int, dict | None]:
    """(status, parsed JSON body or None) of `method path` with a JSON `body`, as `token`'s
    bearer (None: no Authorization header)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                 headers=headers)
    r = conn.getresponse()
    out = r.read()
    conn.close()
    return r.status, json.loads(out) if out else None


def post_json(server, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    """(status, parsed JSON body) of POST `path` with `body`."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    return r.status, out
