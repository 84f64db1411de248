"""The agent's log queue (:mod:`fxstream.agent.log_shipper`): bounded, batched, and never
fed by its own shipping. Shipping itself runs against a real broker in
``tests/e2e/test_globus_compute_parity.py``."""

from __future__ import annotations

import logging

from fxstream.agent.log_shipper import LogShipper
from fxstream.topics import utf8_len


def _shipper(max_queued: int) -> LogShipper:
    return LogShipper(
        endpoint_id="ep-1", agent_id="a-1", hostname="h", topic="t", max_queued=max_queued
    )


def test_the_queue_keeps_the_newest_lines_and_counts_the_rest() -> None:
    shipper = _shipper(max_queued=10)
    logger = logging.getLogger("fxstream.test.log_shipper")
    logger.addHandler(shipper)
    logger.setLevel(logging.DEBUG)
    try:
        logger.debug("below the shipper's level")
        for n in range(25):
            logger.info("line %d", n)
        logger.warning("%s", "\U0001f600" * 10_000)  # 40 kB: cut to the line limit
    finally:
        logger.removeHandler(shipper)
    batch, dropped = shipper._take()
    assert dropped == 16 and shipper.dropped == 0
    assert [line.message for line in batch[:-1]] == [f"line {n}" for n in range(16, 25)]
    assert batch[-1].level == "WARNING" and utf8_len(batch[-1].message) <= 8_000
    assert shipper._take() == ([], 0)


def test_lines_logged_while_shipping_are_not_queued() -> None:
    shipper = _shipper(max_queued=10)
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "during a shipment", None, None)
    shipper._guard.busy = True
    shipper.emit(record)
    shipper._guard.busy = False
    assert shipper._take() == ([], 0)
    shipper.emit(record)
    assert [line.message for line in shipper._take()[0]] == ["during a shipment"]
