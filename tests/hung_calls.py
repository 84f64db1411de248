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

from confluent_kafka import KafkaError, KafkaException, Producer

__all__ = ["hanging_producer"]


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
