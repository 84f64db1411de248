"""An endpoint's credential: its API token and Kafka principal, in one 0600 file.

``config.yaml`` holds settings only; it names this file (``credentials_file``), which holds
what the agent authenticates with::

    {"endpoint_id": "...", "token": "<the endpoint's API token>",
     "bootstrap": "host:port", "kafka_username": "ep.<endpoint id>",
     "kafka_password": "...", "kafka_ca_file": "/path/ca.pem"}

(the Kafka fields are :meth:`KafkaConnection.to_json`'s, present when the service issued the
endpoint a Kafka principal; a config's ``kafka_credentials`` file, if set, names the
principal instead). The file is written ``0600`` atomically
(:func:`~fxstream.topics.connection.write_secret_file`) and refused when group or others may
read it. The agent reads it at start; no secret is put on a command line or in the
environment of the agent or its workers (:mod:`fxstream.agent.environment`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fxstream.topics.connection import (
    CredentialFileError,
    KafkaConnection,
    read_secret_json,
    write_secret_file,
)

__all__ = ["EndpointCredentials"]


@dataclass(frozen=True)
class EndpointCredentials:
    """What one endpoint's agent authenticates with (never its owner's user credential)."""

    endpoint_id: str
    token: str = field(repr=False)
    kafka: KafkaConnection | None = None

    def __post_init__(self) -> None:
        if not self.endpoint_id:
            raise ValueError("endpoint credentials need the endpoint's id")
        if not self.token:
            raise ValueError(f"endpoint {self.endpoint_id}: the credential has no API token")

    def to_json(self) -> dict[str, str]:
        """The credentials-file fields (secrets included: write them with :meth:`save`)."""
        fields = {"endpoint_id": self.endpoint_id, "token": self.token}
        if self.kafka is not None and self.kafka.secure:
            fields.update(self.kafka.to_json())
        return fields

    def save(self, path: Path) -> None:
        """Write the file ``0600``, atomically, in a directory only its owner may enter."""
        write_secret_file(path, (json.dumps(self.to_json(), indent=2) + "\n").encode())
        path.parent.chmod(0o700)

    @classmethod
    def from_json(cls, fields: dict[str, Any], *, source: str) -> EndpointCredentials:
        """The credentials in credentials-file ``fields``; a clear error naming ``source``."""
        endpoint_id, token = fields.get("endpoint_id"), fields.get("token")
        if not isinstance(endpoint_id, str) or not endpoint_id:
            raise CredentialFileError(f"{source}: no 'endpoint_id'")
        if not isinstance(token, str) or not token:
            raise CredentialFileError(
                f"{source}: no 'token' (the endpoint's API token, issued when the endpoint "
                "was registered)"
            )
        kafka = None
        if "kafka_username" in fields:
            kafka = KafkaConnection.from_json(fields, source=source)
        return cls(endpoint_id, token, kafka)

    @classmethod
    def load(cls, path: Path) -> EndpointCredentials:
        """Read a credentials file, refusing one that group or others may read."""
        return cls.from_json(read_secret_json(path), source=str(path))
