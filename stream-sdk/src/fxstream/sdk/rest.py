"""The REST side of the SDK: calls to the service's registry and status API (docs/api.md).

The service is never on a task's hot path; this module only registers users,
functions and endpoints and answers status questions. Every error answer
becomes a typed :mod:`~fxstream.sdk.errors` exception carrying the service's
``detail``.
"""

from __future__ import annotations

from typing import Any, Final

import httpx

from fxstream.sdk.errors import (
    AuthenticationError,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    RateLimited,
    ServiceError,
    ServiceUnavailable,
)

__all__ = ["DEFAULT_TIMEOUT_S", "RestClient", "raise_for_error"]

DEFAULT_TIMEOUT_S: Final = 30.0

_BY_STATUS: Final[dict[int, type[ServiceError]]] = {
    400: InvalidRequest,
    401: AuthenticationError,
    403: PermissionDenied,
    404: NotFound,
    409: InvalidRequest,
    413: InvalidRequest,
    422: InvalidRequest,
}


def raise_for_error(response: httpx.Response) -> None:
    """Raise the typed exception for an error answer; return for a 2xx or 3xx.

    The body is expected as ``{"error": code, "detail": text}``; FastAPI's
    validation lists are flattened into one ``detail`` naming each field.
    """
    if response.status_code < 400:
        return
    request = response.request
    method, url = request.method, str(request.url)
    error, detail = _error_body(response)
    if response.status_code == 429:
        retry_after = response.headers.get("Retry-After")
        raise RateLimited(
            429,
            error,
            detail,
            method=method,
            url=url,
            retry_after=float(retry_after) if retry_after and retry_after.isdigit() else None,
        )
    cls = _BY_STATUS.get(response.status_code)
    if cls is None:
        if response.status_code >= 500:
            raise ServiceUnavailable(
                f"{method} {url} -> {response.status_code} {error}: {detail} "
                "(a service-side failure: see the service's log)"
            )
        cls = ServiceError
    raise cls(response.status_code, error, detail, method=method, url=url)


def _error_body(response: httpx.Response) -> tuple[str, str]:
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()[:500]
        return response.reason_phrase or "error", text or "(empty body)"
    if not isinstance(body, dict):
        return response.reason_phrase or "error", str(body)[:500]
    error = str(body.get("error") or response.reason_phrase or "error")
    detail = body.get("detail", "")
    if isinstance(detail, list):  # FastAPI's default validation answer
        parts = []
        for item in detail:
            if isinstance(item, dict):
                where = ".".join(str(p) for p in item.get("loc", ()))
                parts.append(f"{where}: {item.get('msg', item)}")
            else:
                parts.append(str(item))
        detail = "; ".join(parts)
    return error, str(detail)


class RestClient:
    """A thin, thread-safe JSON client for the service under ``<service_url>/v1``.

    ``token`` goes in ``Authorization: Bearer`` (a user's, or the platform
    admin's for user registration); without it only health and logins succeed.
    """

    def __init__(
        self, service_url: str, *, token: str | None = None, timeout: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.service_url = service_url.rstrip("/")
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(base_url=self.service_url, headers=headers, timeout=timeout)

    def request(self, method: str, path: str, *, json: Any = None) -> Any:
        """Send a request to ``/v1{path}``; the decoded JSON answer, or None for 204.

        Raises a :class:`~fxstream.sdk.errors.ServiceError` subclass for an
        error answer and :class:`ServiceUnavailable` when the service cannot be
        reached.
        """
        url = f"/v1{path}"
        try:
            response = self._http.request(method, url, json=json)
        except httpx.TransportError as exc:
            raise ServiceUnavailable(
                f"cannot reach the fxstream service at {self.service_url} ({exc}); is it "
                "running, and is FXSTREAM_SERVICE_URL (service_url) right?"
            ) from exc
        raise_for_error(response)
        if response.status_code == 204 or not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise ServiceUnavailable(
                f"{method} {response.request.url} answered {response.status_code} with a body "
                f"that is not JSON: {response.text[:200]!r}"
            ) from exc

    def set_token(self, token: str | None) -> None:
        """Send ``token`` from now on (after a rotation); ``None``: no token (a logout)."""
        if token:
            self._http.headers["Authorization"] = f"Bearer {token}"
        else:
            self._http.headers.pop("Authorization", None)

    def get(self, path: str) -> Any:
        """``GET /v1{path}``."""
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> Any:
        """``POST /v1{path}`` with a JSON body."""
        return self.request("POST", path, json=body)

    def delete(self, path: str) -> None:
        """``DELETE /v1{path}``."""
        self.request("DELETE", path)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()
