"""The dashboard: a page the service serves at ``/dashboard``, updated live (docs/dashboard.md).

Routes (none in the OpenAPI schema; none takes a token in its URL):

- ``GET /dashboard``: without a session, the login page (no data); with one, the page,
  its sections rendered by :func:`fxstream.service.dashboard_view.snapshot`.
- ``POST /dashboard/login``: a form (``application/x-www-form-urlencoded``, at most
  :data:`MAX_LOGIN_BODY` bytes) posting an API token once: a user's or the platform
  admin's (an endpoint's is refused). The answer is a redirect to the page with the
  session cookie (:mod:`fxstream.service.dashboard_sessions`). Logins are rate-limited per
  client address with the API's ``logins`` limit; a cross-site post is refused.
- ``POST /dashboard/logout``: ends the session and clears the cookie.
- ``GET /dashboard/events``: server-sent events (``text/event-stream``): a ``snapshot``
  event (``{"at", "sections": {id: html}}``) at once and every ``period_s`` seconds,
  each built in a worker thread with bounded work; ``logout`` when the session ended (the
  page then reloads to the login form). A stream ends after ``stream_s`` seconds and the
  browser's ``EventSource`` reconnects (``retry``), so an open page never holds the API's
  shutdown for longer than that. At most :data:`MAX_STREAMS` streams in all and
  :data:`MAX_STREAMS_PER_SESSION` per session; a snapshot is shared by a viewer's streams
  for half a period. 401 without a session.
- ``GET /dashboard/static/{name}``: the page's script and style sheet, from this package
  (no build step; nothing is fetched from anywhere else).

Every answer carries a Content-Security-Policy allowing only this origin's script and
style (no inline script), ``frame-ancestors 'none'``, ``same-origin`` referrers and
``Cache-Control: no-store``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator
from importlib import resources
from typing import TYPE_CHECKING, Any, Final

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)

from fxstream.service.auth import check_user_token, digest_matches, token_sha256
from fxstream.service.dashboard_feeds import DashboardFeeds
from fxstream.service.dashboard_sessions import COOKIE_NAME, Session, SessionStore
from fxstream.service.dashboard_view import Viewer, snapshot

if TYPE_CHECKING:
    from fxstream.service.api import Runtime

__all__ = [
    "DEFAULT_PERIOD_S",
    "DEFAULT_STREAM_S",
    "MAX_LOGIN_BODY",
    "MAX_STREAMS",
    "MAX_STREAMS_PER_SESSION",
    "dashboard_router",
]

log = logging.getLogger(__name__)

DEFAULT_PERIOD_S: Final = 3.0
"""Seconds between two live updates."""
DEFAULT_STREAM_S: Final = 15.0
"""A live stream ends after this long and the browser reconnects."""
MAX_LOGIN_BODY: Final = 16 * 1024
MAX_STREAMS: Final = 64
MAX_STREAMS_PER_SESSION: Final = 4
_RECONNECT_MS: Final = 1_000
_FEEDS_RETRY_S: Final = 30.0
_STATIC: Final = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # Not no-referrer: with it a browser sends "Origin: null" on the page's own posts.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
_SECTION_TITLES: Final = {
    "endpoints": "Endpoints",
    "tasks": "Tasks",
    "rates": "Task rates",
    "errors": "Recent errors",
    "triggers": "Triggers",
    "dead-letters": "Dead letters",
}


class _Dashboard:
    """What the routes share: sessions, the feeds (started at first use), live streams."""

    def __init__(self, period_s: float, stream_s: float) -> None:
        self.period_s = period_s
        self.stream_s = stream_s
        self.sessions = SessionStore()
        self._feeds: DashboardFeeds | None = None
        self._feeds_failed_at = 0.0
        self._lock = threading.Lock()
        # Starting the feeds waits for Kafka: never under the lock the event loop takes.
        self._feeds_lock = threading.Lock()
        self._streams: dict[str, int] = {}
        self._cache: dict[str, tuple[float, dict[str, Any]]] = {}

    def feeds(self, runtime: Runtime) -> DashboardFeeds | None:
        """The feeds, started now if they are not (None while they cannot start)."""
        with self._feeds_lock:
            if self._feeds is not None:
                return self._feeds
            if runtime.kafka is None or time.monotonic() - self._feeds_failed_at < _FEEDS_RETRY_S:
                return None
            feeds = DashboardFeeds(runtime.kafka, runtime.catalogue)
            try:
                feeds.start()
            except Exception as exc:  # the page shows the rest without them
                log.warning("dashboard: cannot follow warm and dead-letter: %s", exc)
                feeds.close()
                self._feeds_failed_at = time.monotonic()
                return None
            self._feeds = feeds
            return feeds

    def close(self) -> None:
        """Stop the feeds."""
        with self._feeds_lock:
            feeds, self._feeds = self._feeds, None
        if feeds is not None:
            feeds.close()

    def open_stream(self, key: str) -> bool:
        """Count a new live stream of session ``key``; False past the limits."""
        with self._lock:
            if sum(self._streams.values()) >= MAX_STREAMS:
                return False
            if self._streams.get(key, 0) >= MAX_STREAMS_PER_SESSION:
                return False
            self._streams[key] = self._streams.get(key, 0) + 1
            return True

    def close_stream(self, key: str) -> None:
        """A live stream of session ``key`` ended."""
        with self._lock:
            left = self._streams.get(key, 0) - 1
            if left > 0:
                self._streams[key] = left
            else:
                self._streams.pop(key, None)

    def snapshot(self, runtime: Runtime, viewer: Viewer) -> dict[str, Any]:
        """The viewer's snapshot, shared by its streams for half a period."""
        key = "admin" if viewer.user is None else f"user:{viewer.user.user_id}"
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and now - cached[0] < self.period_s / 2:
                return cached[1]
        built = snapshot(runtime.view, runtime.analytics, self.feeds(runtime), viewer)
        with self._lock:
            self._cache[key] = (now, built)
            if len(self._cache) > 256:
                self._cache = {k: v for k, v in self._cache.items() if now - v[0] < self.period_s}
        return built


def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


def _viewer_of(runtime: Runtime, session: Session) -> Viewer | None:
    """Who the session is now: None once its token no longer authenticates."""
    if session.kind == "admin":
        if digest_matches(session.token_sha256, runtime.accounts.admin_token_sha256):
            return Viewer("admin")
        return None
    user = runtime.view.user_by_token_hash(session.token_sha256)
    if user is None or user.user_id != session.user_id:
        return None
    check = check_user_token(
        session.token_sha256, user, lifetime_s=runtime.accounts.token_lifetime_s
    )
    return Viewer("user", user) if check.accepted else None


def _base(request: Request) -> str:
    return f"{request.scope.get('root_path', '')}/dashboard"


def _same_origin(request: Request) -> bool:
    """False for a post another site's page made, as the browser tells: its
    ``Sec-Fetch-Site``, else its ``Origin`` (an opaque ``null`` origin is refused). A
    client that sends neither is no browser a page could have driven."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("origin")
    return origin is None or origin == f"{request.url.scheme}://{request.url.netloc}"


def _html(body: str, status: int = 200, headers: dict[str, str] | None = None) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers={**_HEADERS, **(headers or {})})


def _document(base: str, title: str, body: str) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{title}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<link rel="stylesheet" href="{base}/static/dashboard.css"></head>'
        f"<body>{body}</body></html>"
    )


def _login_page(base: str, message: str = "") -> str:
    notice = f'<p class="error" id="login-error">{message}</p>' if message else ""
    return _document(
        base,
        "fxstream dashboard: log in",
        '<main class="login"><h1>fxstream dashboard</h1>'
        "<p>Log in with your fxstream API token (the platform admin's token shows every "
        "user's items). It is sent once, in this form's body; the page then keeps a "
        "session cookie, never the token.</p>"
        f'<form method="post" action="{base}/login" id="login">'
        '<label for="token">API token</label> '
        '<input type="password" id="token" name="token" autocomplete="off" required> '
        '<button type="submit">Log in</button></form>'
        f"{notice}</main>",
    )


def _page(base: str, sections: dict[str, str]) -> str:
    parts = [f'<section id="section-summary" class="summary">{sections["summary"]}</section>']
    for name, title in _SECTION_TITLES.items():
        if name in sections:
            parts.append(
                f'<section><h2>{title}</h2><div id="section-{name}">{sections[name]}</div>'
                "</section>"
            )
    return _document(
        base,
        "fxstream dashboard",
        '<header><h1>fxstream dashboard</h1><span id="live" class="live">'
        "connecting</span>"
        f'<form method="post" action="{base}/logout"><button type="submit">Log out</button>'
        "</form></header>"
        f"<main>{''.join(parts)}</main>"
        f'<script src="{base}/static/dashboard.js" defer></script>',
    )


async def _form(request: Request) -> dict[str, list[str]]:
    """The posted form's fields; ValueError if it is not a small urlencoded form."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise ValueError("post the login form (application/x-www-form-urlencoded)")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_LOGIN_BODY:
            raise ValueError(f"the form is larger than {MAX_LOGIN_BODY} bytes")
    return urllib.parse.parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)


def dashboard_router(
    *, period_s: float = DEFAULT_PERIOD_S, stream_s: float = DEFAULT_STREAM_S
) -> APIRouter:
    """The dashboard's routes for one app (its sessions and feeds live with the app)."""
    state = _Dashboard(period_s, stream_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await asyncio.to_thread(state.close)

    router = APIRouter(lifespan=lifespan, include_in_schema=False)

    def current(request: Request) -> tuple[str, Viewer] | None:
        session_id = request.cookies.get(COOKIE_NAME)
        session = state.sessions.get(session_id)
        if session_id is None or session is None:
            return None
        viewer = _viewer_of(_runtime(request), session)
        if viewer is None:
            state.sessions.end(session_id)
            return None
        return session_id, viewer

    @router.get("/dashboard")
    async def page(request: Request) -> Response:
        found = current(request)
        if found is None:
            return _html(_login_page(_base(request)))
        built = await asyncio.to_thread(state.snapshot, _runtime(request), found[1])
        return _html(_page(_base(request), built["sections"]))

    @router.post("/dashboard/login")
    async def login(request: Request) -> Response:
        base, runtime = _base(request), _runtime(request)
        if not _same_origin(request):
            return _html(_login_page(base, "a login from another site is refused"), 403)
        address = request.client.host if request.client else "?"
        wait_s = runtime.limiter.take("logins", f"address:{address}")
        if wait_s is not None:
            message = f"too many logins from this address: retry after {wait_s:.0f} s"
            return _html(_login_page(base, message), 429, {"Retry-After": str(int(wait_s))})
        try:
            fields = await _form(request)
        except ValueError as exc:
            return _html(_login_page(base, str(exc)), 400)
        token = (fields.get("token") or [""])[0].strip()
        digest = token_sha256(token)
        if token and digest_matches(digest, runtime.accounts.admin_token_sha256):
            session_id = state.sessions.open("admin", None, digest)
        else:
            user = runtime.view.user_by_token_hash(digest) if token else None
            check = (
                check_user_token(digest, user, lifetime_s=runtime.accounts.token_lifetime_s)
                if user is not None
                else None
            )
            if user is None or check is None or not check.accepted:
                endpoint = runtime.view.endpoint_by_token_hash(digest) if token else None
                message = (
                    "an endpoint's token cannot open the dashboard: use your own token"
                    if endpoint is not None
                    else "this token is not accepted (unknown, expired, revoked or rotated "
                    "away): ask the platform admin for a new one"
                )
                return _html(_login_page(base, message), 401)
            session_id = state.sessions.open("user", user.user_id, digest)
        response = RedirectResponse(base, status_code=303, headers=_HEADERS)
        response.set_cookie(
            COOKIE_NAME,
            session_id,
            max_age=int(state.sessions.lifetime_s),
            path=base,
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response

    @router.post("/dashboard/logout")
    async def logout(request: Request) -> Response:
        base = _base(request)
        if not _same_origin(request):
            return _html(_login_page(base, "a logout from another site is refused"), 403)
        state.sessions.end(request.cookies.get(COOKIE_NAME))
        response = RedirectResponse(base, status_code=303, headers=_HEADERS)
        response.delete_cookie(
            COOKIE_NAME,
            path=base,
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response

    @router.get("/dashboard/events")
    async def events(request: Request) -> Response:
        found = current(request)
        if found is None:
            return JSONResponse(
                {"error": "unauthorized", "detail": f"log in at {_base(request)} first"},
                status_code=401,
                headers=_HEADERS,
            )
        session_id, _ = found
        if not state.open_stream(session_id):
            return JSONResponse(
                {"error": "too-many-streams", "detail": "close another dashboard page"},
                status_code=429,
                headers={**_HEADERS, "Retry-After": "5"},
            )
        runtime = _runtime(request)

        async def stream() -> AsyncIterator[str]:
            try:
                yield f"retry: {_RECONNECT_MS}\n\n"
                ends = time.monotonic() + state.stream_s
                while True:
                    now_found = current(request)
                    if now_found is None:
                        yield "event: logout\ndata: {}\n\n"
                        return
                    built = await asyncio.to_thread(state.snapshot, runtime, now_found[1])
                    yield f"event: snapshot\ndata: {json.dumps(built)}\n\n"
                    if time.monotonic() + state.period_s > ends:
                        return
                    await asyncio.sleep(state.period_s)
            finally:
                state.close_stream(session_id)

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={**_HEADERS, "X-Accel-Buffering": "no"},
        )

    @router.get("/dashboard/static/{name}")
    async def static(name: str) -> Response:
        kind = _STATIC.get(name)
        if kind is None:
            return JSONResponse(
                {"error": "not-found", "detail": f"no dashboard file {name!r}"},
                status_code=404,
                headers=_HEADERS,
            )
        text = resources.files("fxstream.service").joinpath("dashboard_static", name)
        return Response(
            text.read_text(encoding="utf-8"),
            media_type=kind,
            headers={**_HEADERS, "Cache-Control": "no-cache"},
        )

    return router
