"""How every fxstream Kafka client connects: SASL/SCRAM-SHA-512 over TLS, written once.

A :class:`KafkaConnection` names the brokers and the principal a client acts as. Every client
in the service, the agent, the SDK, ops and the benches builds its configuration from one
(``{**connection.confluent(), ...its own settings}`` for a confluent-kafka consumer or admin
client, ``{**connection.confluent_producer(), ...}`` for a confluent-kafka producer,
``**connection.aiokafka()`` for aiokafka), never from a bare bootstrap string, so no client can
forget to authenticate.

Every producer puts a keyed record on the partition Kafka's Java client and aiokafka choose
(murmur2 of the key): several writers of different clients write the same keys to one topic
(``task-state`` from the processors with aiokafka and the task expiry with confluent-kafka;
``results.<user>`` from the agent and the processors), and a compacted topic keeps a key's
latest record, and its tombstone deletes the key, only within one partition. librdkafka's
own default (``consistent_random``, CRC32 of the key) would put three keys in four elsewhere.

A connection without a username is the insecure development platform
(``./fx up --insecure``): PLAINTEXT, and said loudly by whoever starts it.

Credentials live in JSON files created ``0600`` (see :func:`write_secret_file`); the password
is never part of a repr, a log line or a command line.
"""

from __future__ import annotations

import json
import os
import ssl
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "PRODUCER_PARTITIONER",
    "SCRAM_MECHANISM",
    "CredentialFileError",
    "KafkaConnection",
    "read_secret_json",
    "write_secret_file",
]

SCRAM_MECHANISM = "SCRAM-SHA-512"
PRODUCER_PARTITIONER = "murmur2_random"
"""librdkafka's partitioner for every fxstream producer: murmur2 of the key, as the Java
client and aiokafka (random for a record without a key)."""


class CredentialFileError(ValueError):
    """A credential file is missing, malformed, or readable by others."""


@dataclass(frozen=True)
class KafkaConnection:
    """The brokers and the principal a Kafka client connects as."""

    bootstrap: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: Path | None = None

    @property
    def secure(self) -> bool:
        """True when the client authenticates (SASL/SCRAM) over TLS."""
        return self.username is not None

    def __post_init__(self) -> None:
        if not self.bootstrap:
            raise ValueError("a Kafka connection needs bootstrap servers (host:port)")
        if self.username is not None and (not self.password or self.ca_file is None):
            raise ValueError(
                f"the Kafka principal {self.username!r} needs a password and the platform's CA "
                "certificate (ca_file); both are in the credentials file `fxstream` wrote"
            )

    def as_user(self, username: str, password: str) -> KafkaConnection:
        """The same brokers and CA, as another principal."""
        return KafkaConnection(self.bootstrap, username, password, self.ca_file)

    def confluent(self) -> dict[str, str | int]:
        """confluent-kafka (librdkafka) settings: merge the client's own settings after these."""
        config: dict[str, str | int] = {"bootstrap.servers": self.bootstrap}
        if self.username is None:
            return config
        assert self.password is not None and self.ca_file is not None
        config.update(
            {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": SCRAM_MECHANISM,
                "sasl.username": self.username,
                "sasl.password": self.password,
                "ssl.ca.location": str(self.ca_file),
                "ssl.endpoint.identification.algorithm": "https",
            }
        )
        return config

    def confluent_producer(self) -> dict[str, str | int]:
        """confluent-kafka settings for a producer: :meth:`confluent` and the partitioner every
        fxstream writer shares (:data:`PRODUCER_PARTITIONER`)."""
        return {**self.confluent(), "partitioner": PRODUCER_PARTITIONER}

    def aiokafka(self) -> dict[str, Any]:
        """aiokafka keyword arguments (producer, consumer and admin client alike)."""
        kwargs: dict[str, Any] = {"bootstrap_servers": self.bootstrap}
        if self.username is None:
            return kwargs
        assert self.password is not None and self.ca_file is not None
        context = ssl.create_default_context(cafile=str(self.ca_file))
        kwargs.update(
            {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": SCRAM_MECHANISM,
                "sasl_plain_username": self.username,
                "sasl_plain_password": self.password,
                "ssl_context": context,
            }
        )
        return kwargs

    def to_json(self) -> dict[str, str]:
        """The connection as credentials-file fields (includes the password: write it 0600)."""
        fields = {"bootstrap": self.bootstrap}
        if self.username is not None:
            assert self.password is not None and self.ca_file is not None
            fields.update(
                {
                    "kafka_username": self.username,
                    "kafka_password": self.password,
                    "kafka_ca_file": str(self.ca_file),
                }
            )
        return fields

    @classmethod
    def from_json(cls, fields: dict[str, Any], *, source: str = "credentials") -> KafkaConnection:
        """The connection named by credentials-file fields (the inverse of :meth:`to_json`)."""
        bootstrap = fields.get("bootstrap")
        if not isinstance(bootstrap, str) or not bootstrap:
            raise CredentialFileError(f"{source}: no 'bootstrap' (host:port of the brokers)")
        username = fields.get("kafka_username")
        if username is None:
            return cls(bootstrap)
        password, ca_file = fields.get("kafka_password"), fields.get("kafka_ca_file")
        if not isinstance(username, str) or not isinstance(password, str) or not password:
            raise CredentialFileError(f"{source}: 'kafka_username' needs a 'kafka_password'")
        if not isinstance(ca_file, str) or not Path(ca_file).is_file():
            raise CredentialFileError(
                f"{source}: 'kafka_ca_file' must name the platform's CA certificate "
                f"(got {ca_file!r}); copy it from the platform home's pki/ca.pem"
            )
        return cls(bootstrap, username, password, Path(ca_file))

    @classmethod
    def from_file(cls, path: Path) -> KafkaConnection:
        """The connection in a 0600 credentials file."""
        return cls.from_json(read_secret_json(path), source=str(path))


def write_secret_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner only, atomically.

    The bytes go to a temporary file created ``0600`` in the same directory, then replace
    ``path`` by rename, so no reader ever sees a partial file or a looser mode.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # created 0600
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def read_secret_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file only its owner may read or write.

    Refuses a file whose mode lets group or others read or write it, saying how to fix it.
    """
    try:
        mode = path.stat().st_mode
    except FileNotFoundError as exc:
        raise CredentialFileError(f"no credentials file at {path}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialFileError(
            f"{path} holds secrets but is readable or writable by others "
            f"(mode {stat.S_IMODE(mode):o}); run `chmod 600 {path}`"
        )
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise CredentialFileError(f"{path} is not a JSON credentials file: {exc}") from exc
    if not isinstance(value, dict):
        raise CredentialFileError(f"{path} must hold a JSON object")
    return value
