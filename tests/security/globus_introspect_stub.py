"""A local stand-in for Globus Auth's token introspection (``POST /v2/oauth2/token/introspect``).

The Globus cloud cannot be reached from the test machines, so the accounts tests
run the real globus-sdk ``ConfidentialAppAuthClient`` against this small HTTP
server on 127.0.0.1: everything up to the HTTP boundary is the real code path.
It answers as Globus Auth does: HTTP Basic authentication with the confidential
client's id and secret (401 ``UNAUTHORIZED`` otherwise), a form body with
``token`` (and optional ``include``), and a JSON answer that is ``{"active":
false}`` for a token it does not know or that was marked inactive.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

__all__ = ["GlobusIntrospectionStub", "Issued"]


@dataclass
class Issued:
    """A Globus access token the stand-in knows, and whose it is."""

    subject: str
    username: str
    name: str
    audience: list[str]
    active: bool = True
    expires_at: float = field(default_factory=lambda: time.time() + 3600)


class GlobusIntrospectionStub:
    """Serves ``/v2/oauth2/token/introspect`` for one confidential client on a free port."""

    def __init__(self, client_id: str, client_secret: str) -> None:
        self.client_id = client_id
        self.client_secret = client_secret
        self.tokens: dict[str, Issued] = {}
        self.requests: list[tuple[str, dict[str, list[str]]]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                form = parse_qs(self.rfile.read(length).decode())
                stub.requests.append((self.path, form))
                if self.path.split("?")[0] != "/v2/oauth2/token/introspect":
                    self._answer(404, {"errors": [{"code": "NOT_FOUND"}]})
                    return
                if not stub._authorized(self.headers.get("Authorization", "")):
                    self._answer(
                        401,
                        {"errors": [{"code": "UNAUTHORIZED", "detail": "bad credentials"}]},
                    )
                    return
                self._answer(200, stub._introspect(form.get("token", [""])[0]))

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """The base URL to give globus-sdk (``base_url``)."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> GlobusIntrospectionStub:
        """Start serving."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def _authorized(self, header: str) -> bool:
        expected = base64.b64encode(f"{self.client_id}:{self.client_secret}".encode()).decode()
        return header == f"Basic {expected}"

    def _introspect(self, token: str) -> dict[str, Any]:
        issued = self.tokens.get(token)
        if issued is None or not issued.active or issued.expires_at <= time.time():
            return {"active": False}
        return {
            "active": True,
            "scope": "openid profile email",
            "client_id": "a-native-app",
            "sub": issued.subject,
            "username": issued.username,
            "name": issued.name,
            "email": None,
            "aud": issued.audience,
            "iss": "https://auth.globus.org",
            "exp": int(issued.expires_at),
            "iat": int(time.time()),
            "nbf": int(time.time()),
        }
