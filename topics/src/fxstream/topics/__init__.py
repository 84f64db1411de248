"""fxstream.topics: the one contract every part of fxstream imports.

- :mod:`~fxstream.topics.catalogue`: topic names, keys and Kafka settings.
- :mod:`~fxstream.topics.records`: the typed record schemas and their codec.
- :mod:`~fxstream.topics.provision`: idempotent topic creation with drift reports.
"""

from fxstream.topics.catalogue import Catalogue, CleanupPolicy, InvalidTopicName, TopicSpec
from fxstream.topics.provision import Drift, ProvisionError, ProvisionReport, ensure_topics
from fxstream.topics.records import (
    SCHEMA_VERSIONS,
    Attempt,
    ClientInfo,
    DataLocation,
    DeadLetter,
    EndpointRecord,
    Event,
    FunctionRecord,
    Heartbeat,
    Record,
    RecordDecodeError,
    TaskDispatch,
    TaskError,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskSubmission,
    TaskTimings,
    WarmAdvert,
    WarmWorker,
    decode,
    decode_any,
    encode,
)

__all__ = [
    "SCHEMA_VERSIONS",
    "Attempt",
    "Catalogue",
    "CleanupPolicy",
    "ClientInfo",
    "DataLocation",
    "DeadLetter",
    "Drift",
    "EndpointRecord",
    "Event",
    "FunctionRecord",
    "Heartbeat",
    "InvalidTopicName",
    "ProvisionError",
    "ProvisionReport",
    "Record",
    "RecordDecodeError",
    "TaskDispatch",
    "TaskError",
    "TaskResult",
    "TaskState",
    "TaskStateName",
    "TaskSubmission",
    "TaskTimings",
    "TopicSpec",
    "WarmAdvert",
    "WarmWorker",
    "decode",
    "decode_any",
    "encode",
    "ensure_topics",
]
