"""``fxstream user add``: the platform admin creates a user and hands over its credentials file.

The admin (the platform's super user, from ``<home>/credentials``) makes everything at once:
the user's Kafka principal ``u.<id>`` with its ACLs and topics (through
:class:`~fxstream.service.accounts.AccountManager`, as registration through the API does), a
fresh API token, and the user's record in the ``users`` registry (holding only the token's
SHA-256). The user's credentials file is written 0600 (``write_secret_file``): the Kafka
connection fields (``KafkaConnection.to_json``), the token, the service URL and the topic
prefix, which is what ``FXSTREAM_CREDENTIALS`` points the SDK at. Nothing secret is printed.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import KafkaException, Producer

from fxstream.ops.platform import Platform, PlatformError
from fxstream.service.accounts import AccountError, AccountManager
from fxstream.service.auth import DEFAULT_TOKEN_LIFETIME_S, new_token, token_sha256
from fxstream.topics import UserRecord, encode, write_secret_file

__all__ = ["AddedUser", "UserAddError", "add_user"]


class UserAddError(RuntimeError):
    """The user could not be created; the message says what to do."""


@dataclass(frozen=True)
class AddedUser:
    """What ``fxstream user add`` made: the user's id, principal and credentials file."""

    user_id: str
    name: str
    kafka_username: str | None
    credentials_file: Path


def add_user(
    platform: Platform, name: str, out: Path | None = None, *, timeout_s: float = 30.0
) -> AddedUser:
    """Create user ``name`` on the running ``platform`` and write its credentials file.

    ``out`` defaults to ``<home>/credentials/user-<user id>.json``.
    """
    mode = platform.running_mode()
    if mode is None:
        raise UserAddError("the platform is not running: start it with ./fx up")
    try:
        info = platform.read_connection(platform.config.home)
    except (PlatformError, TypeError, ValueError) as exc:
        raise UserAddError(f"cannot read the platform's connection: {exc}; run ./fx up") from exc
    catalogue = info.catalogue()
    admin = platform.kafka(cluster=mode == "cluster")
    user_id = str(uuid.uuid4())
    try:
        principal = AccountManager.connect(
            admin, catalogue, timeout_s=timeout_s
        ).create_user_principal(user_id)
    except AccountError as exc:
        raise UserAddError(str(exc)) from exc
    token, now = new_token(), time.time()
    record = UserRecord(
        user_id=user_id,
        name=name,
        token_sha256=token_sha256(token),
        created_at=now,
        token_expires_at=now + DEFAULT_TOKEN_LIFETIME_S,
    )
    _write_record(admin.confluent_producer(), catalogue.users, user_id, encode(record), timeout_s)
    fields: dict[str, object] = {
        **principal.connection(admin).to_json(),
        "bootstrap_servers": admin.bootstrap,
        "topic_prefix": catalogue.prefix,
        "service_url": f"http://127.0.0.1:{platform.config.service_port}",
        "user_id": user_id,
        "name": name,
        "token": token,
        "store_url": info.redis_url or None,
    }
    target = out or platform.credentials_file(f"user-{user_id}")
    write_secret_file(target, (json.dumps(fields, indent=2) + "\n").encode())
    return AddedUser(user_id, name, principal.username if principal.password else None, target)


def _write_record(
    settings: dict[str, str | int], topic: str, key: str, value: bytes, timeout_s: float
) -> None:
    producer = Producer({**settings, "acks": "all", "enable.idempotence": True, "log_level": 2})
    errors: list[str] = []
    producer.produce(
        topic,
        key=key.encode(),
        value=value,
        on_delivery=lambda error, _: errors.append(str(error)) if error is not None else None,
    )
    try:
        left = producer.flush(timeout_s)
    except KafkaException as exc:
        raise UserAddError(f"cannot write the user's record to {topic}: {exc}") from exc
    if left or errors:
        raise UserAddError(
            f"the user's record was not saved to {topic} ({'; '.join(errors) or 'no answer'}); "
            "its Kafka principal exists: run the command again once Kafka answers"
        )
