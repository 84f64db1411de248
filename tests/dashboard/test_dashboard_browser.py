"""The dashboard end to end: Debian's chromium (headless, driven by Playwright) on the
session's shared platform.

A fresh user logs in through the page's form, sees an endpoint of this module online and
its task count move live (server-sent events, no reload) while tasks run, and the page is
screenshot; without a session nothing but the login page (or 401) comes back; another
user's session shows none of the first user's items; the platform admin sees everyone's,
the shared platform's own endpoint, and a dead letter's description without its bytes.
"""

from __future__ import annotations

import json
import re
import struct
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from confluent_kafka import Producer

from fxstream.ops.install import ensure_browser
from fxstream.ops.private import ExtraEndpoint, PrivatePlatform
from fxstream.sdk import Client, Executor
from fxstream.service.dashboard_sessions import COOKIE_NAME
from tests.e2e.stack import added_endpoint, new_user

pytestmark = pytest.mark.platform

WAIT_S = 60.0
VIEWPORT = {"width": 1280, "height": 1000}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Markup in a function's name: the page must show it as text, never as an element.
HOSTILE_NAME = '<img src="x" id="injected">boom'


def double(x: int) -> int:
    return 2 * x


def explode(x: int) -> int:
    raise ValueError(f"dashboard-boom-{x}")


@dataclass(frozen=True)
class User:
    """A user of this module: its client, API token and name."""

    client: Client
    token: str
    name: str


def _new_user(stack: PrivatePlatform, name: str) -> User:
    """A new user (made by the admin) as its own Kafka principal, and its API token."""
    client, token = new_user(stack, name)
    return User(client, token, name)


@pytest.fixture(scope="module")
def url(shared_platform: PrivatePlatform) -> str:
    """The dashboard's address."""
    return f"{shared_platform.settings.service_url}/dashboard"


@pytest.fixture(scope="module")
def endpoint(shared_platform: PrivatePlatform) -> Iterator[ExtraEndpoint]:
    """A public endpoint of this module (any user may run on it), stopped after."""
    with added_endpoint(shared_platform, "dash", public=True) as extra:
        yield extra


@pytest.fixture(scope="module")
def alice(shared_platform: PrivatePlatform) -> Iterator[User]:
    user = _new_user(shared_platform, f"dash-alice-{uuid.uuid4().hex[:6]}")
    try:
        yield user
    finally:
        user.client.close()


@pytest.fixture(scope="module")
def bob(shared_platform: PrivatePlatform) -> Iterator[User]:
    user = _new_user(shared_platform, f"dash-bob-{uuid.uuid4().hex[:6]}")
    try:
        yield user
    finally:
        user.client.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's chromium, headless, through Playwright (installed by ./fx test if missing);
    closed, and Playwright's driver stopped, after the module."""
    from playwright.sync_api import sync_playwright

    chromium = ensure_browser()["chromium"]
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, headless=True)
        try:
            yield launched
        finally:
            launched.close()


def _wait(what: str, probe: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    """``probe()`` once it is truthy; fails naming ``what`` and its last value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {timeout_s:g} s (last seen: {last!r})")


@contextmanager
def _login(url: str, token: str) -> Iterator[tuple[httpx.Client, str]]:
    """An HTTP client holding a dashboard session opened with ``token`` (the form's post),
    and the answer's Set-Cookie header; closed after the block."""
    with httpx.Client(timeout=30) as http:
        answer = http.post(f"{url}/login", data={"token": token})
        assert answer.status_code == 303, answer.text
        assert COOKIE_NAME in http.cookies
        yield http, answer.headers["set-cookie"]


def _first_snapshot(http: httpx.Client, url: str) -> dict[str, Any]:
    """The first ``snapshot`` event of the live stream."""
    with http.stream("GET", f"{url}/events") as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in stream.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "snapshot":
                snapshot: dict[str, Any] = json.loads(line.removeprefix("data: "))
                return snapshot
    raise AssertionError("the stream ended without a snapshot")


def _png_size(data: bytes) -> tuple[int, int]:
    """A PNG's width and height, after checking its chunks and that its pixels vary."""
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    position, idat, size = 8, b"", (0, 0)
    chunks: list[bytes] = []
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind = data[position + 4 : position + 8]
        body = data[position + 8 : position + 8 + length]
        (crc,) = struct.unpack(">I", data[position + 8 + length : position + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind!r}"
        chunks.append(kind)
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        position += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND", chunks
    pixels = zlib.decompress(idat)
    assert len(set(pixels)) > 16, "the screenshot is blank"
    return size


def test_a_user_logs_in_and_sees_the_endpoint_online_and_task_counts_move_live(
    browser: Any,
    url: str,
    endpoint: ExtraEndpoint,
    alice: User,
    shared_platform: PrivatePlatform,
    tmp_path: Path,
) -> None:
    client, token = alice.client, alice.token
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(url)
        assert page.locator("form#login").count() == 1
        assert endpoint.endpoint_id not in page.content()

        page.fill("#token", token)
        page.click("form#login button[type=submit]")
        page.wait_for_selector("#task-total")
        assert token not in page.url and page.url.rstrip("/") == url
        row = page.locator("#section-endpoints tr", has_text=endpoint.endpoint_id)
        _wait(
            "the endpoint online on the page",
            lambda: row.count() == 1 and "online" in row.inner_text(),
        )
        # A user sees the endpoints it may use: this public one, not the local user's own.
        assert shared_platform.endpoint_id not in page.inner_text("main")
        before = int(page.inner_text("#task-total"))
        assert before == 0, "a new user has no task"
        _wait("live updates", lambda: page.inner_text("#live").startswith("live · updated"))

        with Executor(endpoint_id=endpoint.endpoint_id, client=client) as executor:
            futures = [executor.submit(double, n) for n in range(3)]
            assert [f.result(timeout=WAIT_S) for f in futures] == [0, 2, 4]
            hostile = client.register_function(explode, name=HOSTILE_NAME)
            failing = executor.submit_to_registered_function(hostile, (7,))
            with pytest.raises(ValueError, match="dashboard-boom-7"):
                failing.result(timeout=WAIT_S)

        # The page was not reloaded: the figures come by server-sent events.
        _wait("the task count to move", lambda: page.inner_text("#task-total") == "4")
        _wait(
            "the states to settle",
            lambda: (
                page.locator("#task-state-succeeded").count() == 1
                and page.inner_text("#task-state-succeeded") == "3"
                and page.locator("#task-state-failed").count() == 1
                and page.inner_text("#task-state-failed") == "1"
            ),
        )
        _wait(
            "the error among the recent errors",
            lambda: "dashboard-boom-7" in page.inner_text("#section-errors"),
        )
        # The analytics processor's windows: the four finished, one of them an error.
        _wait(
            "the task rates to count the tasks",
            lambda: (
                page.inner_text("#rate-finished") == "4" and page.inner_text("#rate-errors") == "1"
            ),
        )
        errors = page.inner_text("#section-errors")
        assert failing.task_id in errors and "ValueError" in errors
        # The hostile name is text, not markup.
        assert HOSTILE_NAME in errors and page.locator("#injected").count() == 0
        text = page.inner_text("main")
        assert all(f.task_id in text for f in futures)

        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot))
        assert _png_size(shot.read_bytes()) == (VIEWPORT["width"], VIEWPORT["height"])
        assert endpoint.endpoint_id in text and "Tasks: 4" in text
    finally:
        page.close()


def test_without_a_session_only_the_login_page_or_401(
    url: str, endpoint: ExtraEndpoint, alice: User
) -> None:
    token = alice.token
    with httpx.Client(timeout=30) as http:
        page = http.get(url)
        assert page.status_code == 200 and 'id="login"' in page.text
        assert endpoint.endpoint_id not in page.text and "task-total" not in page.text
        assert http.get(f"{url}/events").status_code == 401
    with httpx.Client(timeout=30, cookies={COOKIE_NAME: "x" * 43}) as forged:
        assert forged.get(f"{url}/events").status_code == 401
        assert 'id="login"' in forged.get(url).text
    with httpx.Client(timeout=30) as http:
        # A wrong token, and a post from another site's page, open nothing.
        wrong = http.post(f"{url}/login", data={"token": "not-a-token"})
        assert wrong.status_code == 401 and COOKIE_NAME not in http.cookies
        cross = http.post(
            f"{url}/login", data={"token": token}, headers={"Origin": "http://elsewhere.example"}
        )
        assert cross.status_code == 403 and COOKIE_NAME not in http.cookies
        assert page.headers["content-security-policy"].startswith("default-src 'none'")


def test_another_users_session_sees_none_of_this_users_items(
    url: str,
    endpoint: ExtraEndpoint,
    alice: User,
    bob: User,
    shared_platform: PrivatePlatform,
) -> None:
    alice_client, bob_client = alice.client, bob.client
    with Executor(endpoint_id=endpoint.endpoint_id, client=alice_client) as executor:
        future = executor.submit(double, 21)
        assert future.result(timeout=WAIT_S) == 42

    with _login(url, alice.token) as (as_alice, _):
        # The control: alice's own session shows her task.
        _wait("alice's task on her page", lambda: future.task_id in as_alice.get(url).text)

    with _login(url, bob.token) as (as_bob, cookie):
        assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower()
        assert "Path=/dashboard" in cookie and "Secure" not in cookie  # plain HTTP here
        assert bob.token not in cookie
        page = as_bob.get(url).text
        snapshot = _first_snapshot(as_bob, url)
        for seen in (page, json.dumps(snapshot)):
            assert bob_client.user_id in seen
            assert alice_client.user_id not in seen
            assert future.task_id not in seen and "dashboard-boom" not in seen
            assert shared_platform.endpoint_id not in seen  # the local user's, private
        assert re.search(r'id="task-total">0<', snapshot["sections"]["tasks"])
        assert "dead-letters" not in snapshot["sections"]

        # Revoking the token ends its dashboard sessions at once.
        revoked = httpx.delete(
            f"{shared_platform.settings.service_url}/v1/users/me/token",
            headers={"Authorization": f"Bearer {bob.token}"},
            timeout=30,
        )
        assert revoked.status_code == 204
        assert as_bob.get(f"{url}/events").status_code == 401
        assert 'id="login"' in as_bob.get(url).text


def test_the_admin_sees_everyones_items_and_dead_letters_without_their_bytes(
    url: str, alice: User, shared_platform: PrivatePlatform
) -> None:
    alice_client = alice.client
    marker = f"SECRET-BYTES-{uuid.uuid4().hex}"
    topic = shared_platform.catalogue.from_user(alice_client.user_id)
    delivered: list[tuple[int | None, int | None]] = []
    producer = Producer({**shared_platform.kafka.confluent(), "log_level": 2})
    producer.produce(
        topic,
        key=f"dash-{uuid.uuid4().hex}".encode(),
        value=b"\x00\xffnot a record " + marker.encode(),
        on_delivery=lambda err, msg: delivered.append((msg.partition(), msg.offset())),
    )
    assert producer.flush(30) == 0 and delivered
    partition, offset = delivered[0]
    where = f"{topic} [{partition}] @ {offset}"

    with _login(url, shared_platform.admin_token) as (as_admin, _):
        page = _wait("the dead letter on the admin's page", lambda: _has(as_admin, url, where))
        assert marker not in page
        assert "the platform admin" in page
        # Everyone's: the shared platform's own endpoint, online, and alice's tasks.
        assert shared_platform.endpoint_id in page
        assert alice.name in page
        snapshot = _first_snapshot(as_admin, url)
        local = _row(snapshot["sections"]["endpoints"], shared_platform.endpoint_id)
        assert 'class="state state-online"' in local, local
        assert where in snapshot["sections"]["dead-letters"]
        assert marker not in json.dumps(snapshot)
        assert as_admin.post(f"{url}/logout").status_code == 303
        assert as_admin.get(f"{url}/events").status_code == 401

    # No token was written to the API's log.
    log = (shared_platform.home / "logs" / "service-api.log").read_text(errors="replace")
    assert shared_platform.admin_token not in log
    assert alice.token not in log


def _has(http: httpx.Client, url: str, text: str) -> str | None:
    page = http.get(url).text
    return page if text in page else None


def _row(html: str, text: str) -> str:
    """The table row of ``html`` that holds ``text`` (empty if none)."""
    for row in html.split("<tr>"):
        if text in row:
            return row.split("</tr>")[0]
    return ""
