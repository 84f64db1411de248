"""The dashboard's sessions: a login exchanges an API token for a session cookie.

A user (or the platform admin) posts their API token once to ``POST /dashboard/login``;
the answer sets a cookie holding a random session id (256 bits), ``HttpOnly``,
``SameSite=Strict``, ``Path=/dashboard`` and ``Secure`` when the page came over TLS. The
token never goes into a URL, a cookie, a log line or a record.

The service keeps, per session, only the SHA-256 of its id (a copy of this process's
memory holds no usable cookie) and the SHA-256 of the token it was opened with (which the
registry already holds). Every request re-checks that token as the API would
(:func:`fxstream.service.auth.check_user_token`): a token that expired, was revoked or
was rotated away ends its sessions at once. A session also ends after
:data:`SESSION_LIFETIME_S` (absolute), after :data:`SESSION_IDLE_S` without a request,
and at logout. Sessions live in the API process's memory: a restart logs everyone out.
At most ``max_sessions`` are held; a new one past that ends the oldest.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "COOKIE_NAME",
    "MAX_SESSIONS",
    "SESSION_IDLE_S",
    "SESSION_LIFETIME_S",
    "Session",
    "SessionStore",
]

COOKIE_NAME: Final = "fxstream_dashboard"
"""The session cookie's name."""
SESSION_LIFETIME_S: Final = 8 * 3600.0
"""A session ends this long after its login, however busy."""
SESSION_IDLE_S: Final = 30 * 60.0
"""A session ends after this long without a request (an open live stream keeps it used)."""
MAX_SESSIONS: Final = 10_000
"""Sessions held at once; a login past that ends the oldest session."""


@dataclass
class Session:
    """Who logged in, with which token (its digest), and when."""

    kind: Literal["user", "admin"]
    user_id: str | None
    token_sha256: str
    created_at: float
    expires_at: float
    last_used: float


def _digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class SessionStore:
    """Open, look up and end sessions; thread-safe, bounded, in memory."""

    def __init__(
        self,
        *,
        lifetime_s: float = SESSION_LIFETIME_S,
        idle_s: float = SESSION_IDLE_S,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.lifetime_s = lifetime_s
        self.idle_s = idle_s
        self._max = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def open(
        self,
        kind: Literal["user", "admin"],
        user_id: str | None,
        token_sha256: str,
        now: float | None = None,
    ) -> str:
        """A new session's id (the cookie's value, known only to the caller from now)."""
        now = time.time() if now is None else now
        session_id = secrets.token_urlsafe(32)
        session = Session(kind, user_id, token_sha256, now, now + self.lifetime_s, now)
        with self._lock:
            self._sessions[_digest(session_id)] = session
            while len(self._sessions) > self._max:
                self._sessions.popitem(last=False)
        return session_id

    def get(self, session_id: str | None, now: float | None = None) -> Session | None:
        """The live session ``session_id`` names (and mark it used), or None: unknown,
        expired, idle too long, or ended."""
        if not session_id or len(session_id) > 256:
            return None
        now = time.time() if now is None else now
        key = _digest(session_id)
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                return None
            if now >= session.expires_at or now - session.last_used >= self.idle_s:
                del self._sessions[key]
                return None
            session.last_used = now
            return session

    def end(self, session_id: str | None) -> None:
        """End the session (logout); an unknown id is ignored."""
        if not session_id:
            return
        with self._lock:
            self._sessions.pop(_digest(session_id), None)

    def sweep(self, now: float | None = None) -> int:
        """Drop every expired or idle session; returns how many."""
        now = time.time() if now is None else now
        with self._lock:
            stale = [
                key
                for key, s in self._sessions.items()
                if now >= s.expires_at or now - s.last_used >= self.idle_s
            ]
            for key in stale:
                del self._sessions[key]
        return len(stale)
