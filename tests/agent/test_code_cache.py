"""The agent's function-code cache is an LRU of a fixed number of functions.

A real HTTP server stands in for the service's ``GET /v1/functions/{id}`` and
counts the fetches, so a hit (no request) and an eviction (a request again) are
observed, not assumed.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fxstream.agent.function_code import CodeCache
from fxstream.topics import code_sha256


def _functions(fetched: list[str]) -> type[BaseHTTPRequestHandler]:
    """A handler answering ``GET .../functions/<id>`` with code ``<id>``, noting each id."""

    class Functions(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            function_id = self.path.rsplit("/", 1)[-1]
            fetched.append(function_id)
            code = base64.b64encode(function_id.encode()).decode()
            body = json.dumps({"code": code}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return

    return Functions


@pytest.fixture
def service() -> Iterator[tuple[str, list[str]]]:
    """A stand-in service on a free port; yields its URL and the ids fetched from it."""
    fetched: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _functions(fetched))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", fetched
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_the_least_recently_used_function_is_evicted_first(
    service: tuple[str, list[str]],
) -> None:
    url, fetched = service
    cache = CodeCache(url, "token", capacity=2)
    try:
        assert cache.get("a") == (code_sha256(b"a"), b"a")
        cache.get("b")
        cache.get("a")  # a hit: "a" is now the most recent
        cache.get("c")  # evicts "b"
        assert fetched == ["a", "b", "c"]
        cache.get("a")
        assert fetched == ["a", "b", "c"], "a recently used function was evicted"
        cache.get("b")
        assert fetched == ["a", "b", "c", "b"], "the least recently used function was kept"
    finally:
        cache.close()
