"""EndpointNodes: the SDK's cache of which endpoints share its node (no service needed)."""

from __future__ import annotations

import threading
import time

from fxstream.sdk.node_tier import EndpointNodes


def test_a_key_is_asked_once_then_served_from_the_cache() -> None:
    asked: list[str] = []

    def fetch(endpoint_id: str) -> str:
        asked.append(endpoint_id)
        return "k" * 32

    nodes = EndpointNodes(fetch, ttl_s=60.0)
    assert nodes.key_of("e1") == "k" * 32  # the first look-up is waited for
    assert nodes.key_of("e1") == "k" * 32
    assert asked == ["e1"]


def test_a_failed_or_slow_look_up_counts_as_remote_and_waits_at_most_first_wait() -> None:
    release = threading.Event()

    def slow(endpoint_id: str) -> str:
        release.wait(10)
        return "k" * 32

    nodes = EndpointNodes(slow, first_wait_s=0.2)
    began = time.monotonic()
    assert nodes.key_of("e1") == ""
    assert time.monotonic() - began < 2.0
    release.set()

    def failing(endpoint_id: str) -> str:
        raise ConnectionError("the service is down")

    assert EndpointNodes(failing).key_of("e2") == ""


def test_a_stale_key_is_refreshed_in_the_background() -> None:
    answers = iter(["a" * 32, "b" * 32])
    nodes = EndpointNodes(lambda endpoint_id: next(answers), ttl_s=0.05)
    assert nodes.key_of("e1") == "a" * 32
    time.sleep(0.1)
    assert nodes.key_of("e1") == "a" * 32  # served while the new answer is asked for
    deadline = time.monotonic() + 5
    while nodes.key_of("e1") != "b" * 32:
        assert time.monotonic() < deadline, "the stale key was never refreshed"
        time.sleep(0.02)
