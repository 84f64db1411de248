"""Where a keyed record goes: Kafka's murmur2 partitioner, computed in C when it can be.

Every fxstream writer places a keyed record on partition
``(murmur2(key) & 0x7fffffff) % partitions``, as Kafka's Java client does (see
:mod:`fxstream.topics.connection`): the confluent-kafka producers through librdkafka's
``murmur2_random`` partitioner, the aiokafka producers (router, ingress, task-state and
the other processors) through :class:`Murmur2Partitioner`.

aiokafka's own partitioner computes murmur2 in Python, about 20 µs per record on these
machines (13-23 % of the router's CPU in ``./fx bench profile``). :class:`Murmur2Partitioner`
calls librdkafka's public ``rd_kafka_msg_partitioner_murmur2`` instead (the same function
confluent-kafka's producers use, from the librdkafka confluent-kafka has loaded), about 1 µs,
and falls back to :func:`murmur2` in Python (half aiokafka's cost), with the same results,
where that library cannot be found. ``tests/topics/test_partitioner.py`` checks both
against aiokafka's on random keys and partition counts, and on the broker.
"""

from __future__ import annotations

import ctypes
import logging
import random
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["Murmur2Partitioner", "murmur2", "murmur2_partition", "partition_function"]

log = logging.getLogger(__name__)

PartitionFunction = Callable[[bytes, int], int]


_M = 0x5BD1E995
_MASK = 0xFFFFFFFF
_SEED = 0x9747B28C
_WORDS: dict[int, struct.Struct] = {}


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 of ``data`` (``org.apache.kafka.common.utils.Utils.murmur2``:
    MurmurHash2, 32 bits, seed 0x9747b28c), in Python."""
    length = len(data)
    h = _SEED ^ length
    words = length >> 2
    if words:
        layout = _WORDS.get(words)
        if layout is None:
            layout = _WORDS[words] = struct.Struct(f"<{words}I")
        for k in layout.unpack_from(data):
            k = (k * _M) & _MASK
            k ^= k >> 24
            h = ((h * _M) & _MASK) ^ ((k * _M) & _MASK)
    tail = length & 3
    if tail:
        base = length & ~3
        if tail >= 3:
            h ^= data[base + 2] << 16
        if tail >= 2:
            h ^= data[base + 1] << 8
        h ^= data[base]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


def _python_partition(key: bytes, partitions: int) -> int:
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def _librdkafka_path() -> Path | None:
    """The librdkafka this process has loaded for confluent-kafka (None: not found)."""
    import confluent_kafka.cimpl  # noqa: F401  (loads librdkafka)

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and "librdkafka" in Path(fields[-1]).name:
                    return Path(fields[-1])
    except OSError:
        return None
    return None


def _librdkafka_partition() -> PartitionFunction | None:
    path = _librdkafka_path()
    if path is None:
        return None
    try:
        function = ctypes.CDLL(str(path)).rd_kafka_msg_partitioner_murmur2
    except (OSError, AttributeError) as exc:
        log.info("librdkafka's murmur2 partitioner not usable (%s): murmur2 in Python", exc)
        return None
    function.restype = ctypes.c_int32
    # (topic, key, key length, partition count, topic opaque, message opaque): the topic
    # and the opaques are not read by this partitioner.
    function.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]

    def partition(key: bytes, partitions: int) -> int:
        return int(function(None, key, len(key), partitions, None, None))

    # Refuse it unless it agrees with Kafka's definition (a build without it, or another
    # function of that name, falls back rather than misplacing records).
    for probe in (b"", b"a", b"ab", b"abc", b"task-0001", bytes(range(256))):
        for count in (1, 3, 4, 7, 100):
            if partition(probe, count) != _python_partition(probe, count):
                log.warning("librdkafka's murmur2 disagrees with Kafka's: murmur2 in Python")
                return None
    return partition


def partition_function() -> PartitionFunction:
    """The fastest correct ``(key, partition count) -> partition`` here (cached)."""
    global _chosen
    if _chosen is None:
        _chosen = _librdkafka_partition() or _python_partition
    return _chosen


_chosen: PartitionFunction | None = None


def murmur2_partition(key: bytes, partitions: int) -> int:
    """The partition of ``partitions`` Kafka's Java client gives ``key``."""
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, not {partitions}")
    return partition_function()(bytes(key), partitions)


class Murmur2Partitioner:
    """An aiokafka partitioner (``AIOKafkaProducer(partitioner=...)``, faust's
    ``producer_partitioner``) that places keys as Kafka's Java client does, in C.

    A record without a key goes to a random available partition, as aiokafka's own.
    """

    def __init__(self) -> None:
        self._partition = partition_function()

    def __call__(
        self, key: bytes | None, all_partitions: Sequence[int], available: Sequence[int]
    ) -> int:
        if key is None:
            return random.choice(available or all_partitions)
        if type(key) is not bytes:
            key = bytes(key)
        return all_partitions[self._partition(key, len(all_partitions))]
