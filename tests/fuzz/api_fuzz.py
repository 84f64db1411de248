"""Hypothesis-made HTTP requests to every route of the REST API, and what any answer must be.

Shared by the in-process fuzz (TestClient on the real Kafka runtime) and the
end-to-end one (the real ``fxstream-service`` process over HTTP).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import httpx
from hypothesis import strategies as st

__all__ = ["ApiRequest", "KnownIds", "assert_answer_is_sane", "requests", "send"]

# Every route of docs/api.md, with {id} where an id goes.
ROUTES: tuple[tuple[str, str], ...] = (
    ("POST", "/v1/users"),
    ("GET", "/v1/users/me"),
    ("POST", "/v1/functions"),
    ("GET", "/v1/functions"),
    ("GET", "/v1/functions/{id}"),
    ("DELETE", "/v1/functions/{id}"),
    ("POST", "/v1/endpoints"),
    ("GET", "/v1/endpoints"),
    ("GET", "/v1/endpoints/{id}"),
    ("DELETE", "/v1/endpoints/{id}"),
    ("GET", "/v1/tasks/{id}"),
    ("GET", "/v1/tasks"),
    ("POST", "/v1/tasks/status"),
    ("GET", "/v1/task-groups/{id}/tasks"),
    ("POST", "/v1/triggers"),
    ("GET", "/v1/triggers"),
    ("GET", "/v1/triggers/{id}"),
    ("POST", "/v1/triggers/{id}/pause"),
    ("POST", "/v1/triggers/{id}/resume"),
    ("DELETE", "/v1/triggers/{id}"),
    ("GET", "/v1/analytics"),
    ("GET", "/v1/health"),
)

# The fields each body has, so shaped bodies reach the field validators.
BODY_FIELDS: dict[str, tuple[str, ...]] = {
    "/v1/users": ("name",),
    "/v1/functions": ("name", "code", "container", "public", "allowed_users", "description"),
    "/v1/endpoints": ("name", "public", "allowed_users", "description", "metadata"),
    "/v1/tasks/status": ("task_ids",),
    "/v1/triggers": (
        "name",
        "source",
        "function_id",
        "endpoint_id",
        "endpoint_group",
        "key_pattern",
        "predicates",
        "arguments",
        "template",
        "constants",
        "max_in_flight",
        "max_per_second",
    ),
}


@dataclass(frozen=True)
class KnownIds:
    """Ids that exist, so some requests reach past the 404s."""

    token: str
    user_id: str
    function_id: str
    endpoint_id: str


@dataclass(frozen=True)
class ApiRequest:
    """One request: method, path (already quoted), headers and raw body."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes | None

    def __repr__(self) -> str:
        body = self.body if self.body is None or len(self.body) < 300 else self.body[:300]
        return f"ApiRequest({self.method} {self.path[:300]!r}, {self.headers!r}, {body!r})"


_ascii = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=80)

json_values: st.SearchStrategy[Any] = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=40),
        st.just("a" * 70_000),
        st.just("QUJD"),  # valid base64, but not an fxstream payload
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


def _ids(known: KnownIds) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from([known.user_id, known.function_id, known.endpoint_id]),
        st.uuids().map(str),
        st.text(max_size=60),
        st.just("a" * 5_000),
        st.sampled_from(["..", "%2e%2e", "-", "_", "x y", "%00", "null", "0"]),
    )


def _auth(known: KnownIds) -> st.SearchStrategy[dict[str, str]]:
    bad = st.one_of(
        st.just({}),
        st.just({"Authorization": f"Bearer {known.token}x"}),
        # An HTTP client sends no header value with whitespace at either end (h11 refuses).
        _ascii.map(lambda t: {"Authorization": f"Bearer {t}".strip()}),
        _ascii.map(lambda t: {"Authorization": t.strip()}),
        st.just({"Authorization": "Basic dXNlcjpwYXNz"}),
        st.just({"Authorization": "Bearer " + "t" * 20_000}),
    )
    valid = {"Authorization": f"Bearer {known.token}"}
    # Mostly the valid token, so most requests get past authentication.
    return st.integers(0, 9).flatmap(lambda n: st.just(valid) if n < 7 else bad)


def _body(path: str) -> st.SearchStrategy[tuple[bytes | None, str | None]]:
    fields = BODY_FIELDS.get(path, ("name",))
    shaped = st.dictionaries(st.sampled_from([*fields, "unknown_field"]), json_values, max_size=4)
    as_json = st.one_of(shaped, json_values).map(lambda v: json.dumps(v).encode())
    content_type = st.sampled_from(
        [None, "application/json", "text/plain", "application/x-www-form-urlencoded", "a/b"]
    )
    return st.one_of(
        st.tuples(st.none(), st.none()),
        st.tuples(as_json, st.just("application/json")),
        st.tuples(as_json, content_type),
        st.tuples(st.binary(max_size=300), content_type),
        st.tuples(as_json.map(lambda b: b[: len(b) // 2]), st.just("application/json")),
    )


# The query parameters of GET /v1/tasks, with values near and far from valid ones.
_TASK_QUERY_NAMES = (
    "tag",
    "state",
    "function_id",
    "endpoint_id",
    "group",
    "since",
    "until",
    "order",
    "limit",
    "cursor",
    "x",
)
_task_query_values = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["run:42", "a:b:c", ":", "succeeded", "desc", "0", "-1", "1e400", "nan"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(2**70), 2**70).map(str),
    st.binary(max_size=40).map(lambda b: b.hex()),
)


def _task_query(draw: st.DrawFn) -> str:
    pairs = draw(
        st.lists(st.tuples(st.sampled_from(_TASK_QUERY_NAMES), _task_query_values), max_size=6)
    )
    return "?" + urlencode(pairs) if pairs else ""


@st.composite
def requests(draw: st.DrawFn, known: KnownIds) -> ApiRequest:
    """A request to one of the routes (or a path near them) with fuzzed parts."""
    method, template = draw(st.sampled_from(ROUTES))
    if draw(st.integers(0, 9)) == 0:
        method = draw(st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]))
    path = template.replace("{id}", quote(draw(_ids(known)), safe=""))
    if template == "/v1/tasks":
        path += _task_query(draw)
    if draw(st.integers(0, 9)) == 0:
        path += draw(st.sampled_from(["/", "/extra", "?x=1", "//", "/%ff"]))
    headers = dict(draw(_auth(known)))
    body, content_type = (
        draw(_body(template)) if method in ("POST", "PUT", "PATCH") else (None, None)
    )
    if content_type is not None:
        headers["Content-Type"] = content_type
    return ApiRequest(method, path, headers, body)


def send(client: httpx.Client, request: ApiRequest) -> httpx.Response:
    """Send ``request`` as given (no JSON re-encoding by the client)."""
    return client.request(
        request.method, request.path, headers=request.headers, content=request.body
    )


def assert_answer_is_sane(request: ApiRequest, answer: httpx.Response) -> None:
    """Never a 5xx; every error is JSON ``{"error", "detail"}`` with a detail to act on."""
    assert answer.status_code < 500, f"{request!r} -> {answer.status_code} {answer.text[:2000]}"
    if answer.status_code >= 400:
        try:
            body = answer.json()
        except ValueError as exc:
            raise AssertionError(f"{request!r}: error body is not JSON: {answer.text!r}") from exc
        assert isinstance(body, dict) and set(body) == {"error", "detail"}, (request, body)
        assert isinstance(body["error"], str) and body["error"], (request, body)
        assert isinstance(body["detail"], str) and len(body["detail"]) > 10, (request, body)
