"""A real confluent-kafka producer whose chosen call hangs once, for the tests of what
follows a transactional call librdkafka never returns from.

librdkafka's own hang (``send_offsets_to_transaction`` waiting for good after the consumer
group's coordinator broker died mid-transaction: confluentinc/librdkafka#5456, #5511) needs
that broker killed at that moment on a multi-broker cluster; the 3-broker fault test
(tests/faults/test_cluster_faults.py) meets the real one, but not on every run. These tests
make the first producer's first such call block until released instead, everything else
real (the broker, the transactions, the fencing).
"""

from __future__ import annotations

import threading
from types import ModuleType

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

__all__ = ["hang_first_call", "hanging_producer"]


def hanging_producer(method: str, release: threading.Event, *, after_real: bool) -> type:
    """A ``Producer`` subclass whose first instance blocks in its first ``method`` call
    until ``release`` is set (after making the real call first, if ``after_real``)."""
    made: list[Producer] = []
    hung: list[bool] = []
    real = getattr(Producer, method)

    class Hanging(Producer):  # type: ignore[misc]
        def __init__(self, config: dict[str, object]) -> None:
            super().__init__(config)
            made.append(self)

    def call(self: Producer, *args: object) -> object:
        if self is not made[0] or hung:
            return real(self, *args)
        hung.append(True)
        if after_real:
            real(self, *args)
        release.wait(120)
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "released at teardown"))

    setattr(Hanging, method, call)
    return Hanging


def hang_first_call(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, method: str, *, after_real: bool = False
) -> threading.Event:
    """Make ``module`` build its producers from :func:`hanging_producer`; returns the event
    that releases the hung call (set it at the end of the test)."""
    release = threading.Event()
    monkeypatch.setattr(
        module, "Producer", hanging_producer(method, release, after_real=after_real)
    )
    return release
