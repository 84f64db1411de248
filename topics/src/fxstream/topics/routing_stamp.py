"""Routing stamps: the router's authenticated word that it routed a task to an endpoint.

A task is routed once, to one endpoint: the router writes one
:class:`~fxstream.topics.TaskDispatch` per task, always attempt 1 (a retry is a
redelivery within that endpoint's queue). So the routing fact (task ``T`` went to
endpoint ``E``, for user ``U``, to run function ``F``) can travel with the task's own
records instead of being looked up: the router puts a *routing stamp*, an HMAC-SHA256
under a service secret over ``(T, E, U, F)``, in the dispatch; the agent copies it
unchanged into every :class:`~fxstream.topics.TaskResult` and
:class:`~fxstream.topics.TaskEvent` of the task; the ingress recomputes it for the
endpoint of the ``from.ep.<E>`` topic the record arrived on (which only ``E``'s
principal may write) and the record's own task, user and function, and forwards the
record only when the two agree (:meth:`RoutingKeys.verify`, a constant-time compare).

What a valid stamp proves: the router authorised and routed task ``T`` to endpoint
``E`` for user ``U`` and function ``F``. It is not a secret (the user reads it on
``results.<U>``) and grants nothing by itself: only ``E`` can write ``E``'s topic, and a
stamp for any other endpoint, user, function or task does not verify there. It does not
say which attempt a result is, nor that the task is still unanswered (an endpoint may
answer its own task twice, as before: the task-state processor and the SDK keep the
first result).

The stamp is ``v1.<key id>.<mac>``: the format's version, the id of the key it was made
with (so keys can rotate: a verifier accepts any key it holds, by id) and the
unpadded base64url of ``HMAC-SHA256(key, message)``. The message is a domain label and
the version, key id, task id, endpoint id, user id and function id, each as a 4-byte
big-endian length and its UTF-8 bytes: no two different tuples give the same message.
At most :data:`ROUTING_STAMP_MAX_CHARS` characters (the records' schema bound).

Keys (:class:`RoutingKeys`) live in one 0600 JSON file, never in a record, a log line or
a command line: ``{"signing": "<key id>", "keys": {"<key id>": "<base64url of 32 random
bytes>", ...}}``. The router stamps with the ``signing`` key; the ingress accepts every
key of the file. The platform writes it (:func:`ensure_routing_keys`) in its credentials
directory; the processors read it (:func:`read_routing_keys`) from the file named by
:data:`ROUTING_KEYS_ENV` or ``--routing-keys``, and again whenever it changes
(``fxstream.service.routing_keys.RoutingKeyFile``), so a rotation needs no restart.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import re
import secrets
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from fxstream.topics.connection import CredentialFileError, read_secret_json, write_secret_file

__all__ = [
    "KEY_ID_PATTERN",
    "MAX_KEY_ID_CHARS",
    "ROUTING_KEYS_ENV",
    "ROUTING_KEYS_FILE_NAME",
    "ROUTING_KEY_BYTES",
    "ROUTING_STAMP_MAX_CHARS",
    "ROUTING_STAMP_VERSION",
    "RoutingKey",
    "RoutingKeys",
    "RoutingStampError",
    "UnknownRoutingKeyError",
    "ensure_routing_keys",
    "read_routing_keys",
    "routing_stamp",
    "write_routing_keys",
]

ROUTING_STAMP_VERSION: Final = "v1"
"""The stamp format's version, its first dot-separated part."""
ROUTING_KEY_BYTES: Final = 32
"""The size of a generated key, and the least a key file's key may have: 256 random bits."""
MAX_KEY_ID_CHARS: Final = 16
"""The longest key id: 1-16 letters, digits, '_' or '-' (never '.', the stamp's separator)."""
KEY_ID_PATTERN: Final = rf"^[A-Za-z0-9_-]{{1,{MAX_KEY_ID_CHARS}}}\Z"
_MAC_CHARS: Final = 43  # unpadded base64 of SHA-256's 32 bytes
ROUTING_STAMP_MAX_CHARS: Final = len(ROUTING_STAMP_VERSION) + 1 + MAX_KEY_ID_CHARS + 1 + _MAC_CHARS
"""The longest stamp (63 characters, all ASCII): the bound of the records' field."""
ROUTING_KEYS_ENV: Final = "FXSTREAM_ROUTING_KEYS"
"""Names the routing keys file the router and the ingress read (or ``--routing-keys``)."""
ROUTING_KEYS_FILE_NAME: Final = "routing-keys.json"
"""The file's name in the platform's credentials directory."""

_KEY_ID = re.compile(KEY_ID_PATTERN)
_DOMAIN: Final = b"fxstream routing stamp"


class RoutingStampError(ValueError):
    """A record's routing stamp does not show that the router routed its task here.

    The message says what is wrong (missing, malformed, an unknown key, or a stamp for
    another task, endpoint, user or function), in words fit for a dead letter.
    """


class UnknownRoutingKeyError(RoutingStampError):
    """A well-formed stamp made with a key id the verifier does not hold (``key_id``).

    A key retired too early, another platform's key, a forgery, or a key added to the
    key file since the verifier last read it: a verifier that re-reads its file
    (:class:`fxstream.service.routing_keys.RoutingKeyFile`) checks the file again before
    refusing.
    """

    def __init__(self, message: str, key_id: str) -> None:
        super().__init__(message)
        self.key_id = key_id
        """The stamp's key id (at most :data:`MAX_KEY_ID_CHARS` characters shown in the
        message; this is the whole of it)."""


@dataclass(frozen=True)
class RoutingKey:
    """One HMAC key: its id (in every stamp made with it) and its secret bytes."""

    key_id: str
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.key_id, str) or not _KEY_ID.match(self.key_id):
            raise ValueError(
                f"routing key id {self.key_id!r} is not valid: use 1-{MAX_KEY_ID_CHARS} "
                "letters, digits, '_' or '-'"
            )
        if len(self.secret) < ROUTING_KEY_BYTES:
            raise ValueError(
                f"routing key {self.key_id!r} has {len(self.secret)} bytes; a routing key "
                f"needs at least {ROUTING_KEY_BYTES} random bytes"
            )

    @classmethod
    def generate(cls, key_id: str | None = None) -> RoutingKey:
        """A new key of :data:`ROUTING_KEY_BYTES` random bytes (a random id unless given)."""
        return cls(key_id or secrets.token_hex(4), secrets.token_bytes(ROUTING_KEY_BYTES))


def _message(key_id: str, task_id: str, endpoint_id: str, user_id: str, function_id: str) -> bytes:
    """The canonical bytes a stamp authenticates: each part length-prefixed."""
    out = bytearray()
    for part in (ROUTING_STAMP_VERSION, key_id, task_id, endpoint_id, user_id, function_id):
        data = part.encode("utf-8", "surrogatepass")
        out += struct.pack(">I", len(data))
        out += data
    return _DOMAIN + b"\x00" + bytes(out)


def _encoded_mac(
    key: RoutingKey, task_id: str, endpoint_id: str, user_id: str, function_id: str
) -> bytes:
    """The MAC as it is written in a stamp: unpadded base64url."""
    message = _message(key.key_id, task_id, endpoint_id, user_id, function_id)
    return base64.urlsafe_b64encode(hmac.digest(key.secret, message, "sha256")).rstrip(b"=")


def routing_stamp(
    key: RoutingKey, *, task_id: str, endpoint_id: str, user_id: str, function_id: str
) -> str:
    """The stamp saying that task ``task_id`` was routed to ``endpoint_id`` for ``user_id``
    to run ``function_id``, made with ``key``: ``v1.<key id>.<base64url mac>``."""
    encoded = _encoded_mac(key, task_id, endpoint_id, user_id, function_id).decode("ascii")
    return f"{ROUTING_STAMP_VERSION}.{key.key_id}.{encoded}"


@dataclass(frozen=True)
class RoutingKeys:
    """The keys a router stamps with (``signing``) and an ingress verifies with (all).

    ``retired`` are keys still accepted but no longer used to stamp: during a rotation,
    the stamps of tasks routed before it (still queued or running) keep verifying until
    the old key is removed from the file.
    """

    signing: RoutingKey
    retired: tuple[RoutingKey, ...] = ()
    _by_id: dict[str, RoutingKey] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_id: dict[str, RoutingKey] = {}
        for key in (self.signing, *self.retired):
            if key.key_id in by_id:
                raise ValueError(f"routing key id {key.key_id!r} appears twice")
            by_id[key.key_id] = key
        object.__setattr__(self, "_by_id", by_id)

    @classmethod
    def generate(cls) -> RoutingKeys:
        """A key ring of one new random key."""
        return cls(RoutingKey.generate())

    @property
    def key_ids(self) -> tuple[str, ...]:
        """Every key's id, the signing key's first (ids are not secret)."""
        return (self.signing.key_id, *(k.key_id for k in self.retired))

    def rotated(self) -> RoutingKeys:
        """A new signing key; the current one and the retired ones are still accepted."""
        return RoutingKeys(RoutingKey.generate(), (self.signing, *self.retired))

    def stamp(self, *, task_id: str, endpoint_id: str, user_id: str, function_id: str) -> str:
        """The stamp of a routed task, made with the signing key (:func:`routing_stamp`)."""
        return routing_stamp(
            self.signing,
            task_id=task_id,
            endpoint_id=endpoint_id,
            user_id=user_id,
            function_id=function_id,
        )

    def verify(
        self, stamp: str, *, task_id: str, endpoint_id: str, user_id: str, function_id: str
    ) -> None:
        """Return if ``stamp`` is a stamp of this ``(task, endpoint, user, function)`` under
        any of these keys; raise :class:`RoutingStampError` saying what is wrong otherwise
        (:class:`UnknownRoutingKeyError` when its key id is none of these keys').

        The MACs are compared in constant time (:func:`hmac.compare_digest`).
        """
        if not stamp:
            raise RoutingStampError(
                "it carries no routing stamp: the agent that wrote it is older than routing "
                "stamps (upgrade fxstream on the endpoint), or the task was routed by a "
                "router older than them"
            )
        parts = stamp.split(".")
        if len(parts) != 3 or parts[0] != ROUTING_STAMP_VERSION:
            raise RoutingStampError(
                f"its routing stamp is not a {ROUTING_STAMP_VERSION} stamp "
                f"('{ROUTING_STAMP_VERSION}.<key id>.<mac>'): malformed, or made by a newer "
                "router than this ingress (upgrade the service)"
            )
        _, key_id, encoded = parts
        key = self._by_id.get(key_id)
        if key is None:
            raise UnknownRoutingKeyError(
                f"its routing stamp was made with key {key_id[:MAX_KEY_ID_CHARS]!r}, which this "
                f"ingress does not hold (it holds {', '.join(self.key_ids)}): a key retired "
                "too early, another platform's key, or a forgery",
                key_id,
            )
        expected = _encoded_mac(key, task_id, endpoint_id, user_id, function_id)
        given = encoded.encode("utf-8", "surrogatepass")
        if not hmac.compare_digest(given, expected):
            raise RoutingStampError(
                f"its routing stamp does not match: the router did not route task {task_id} "
                f"to endpoint {endpoint_id!r} for user {user_id!r} to run function "
                f"{function_id!r} (the stamp is another task's, endpoint's, user's or "
                "function's, or forged)"
            )

    def to_json(self) -> str:
        """The key file's text (it holds the secrets: write it with :func:`write_routing_keys`)."""
        keys = {
            key.key_id: base64.urlsafe_b64encode(key.secret).decode("ascii")
            for key in (self.signing, *self.retired)
        }
        return json.dumps({"signing": self.signing.key_id, "keys": keys}, indent=2) + "\n"


def read_routing_keys(path: Path) -> RoutingKeys:
    """The routing keys in ``path`` (0600 JSON, :meth:`RoutingKeys.to_json`'s layout).

    Raises :class:`~fxstream.topics.CredentialFileError` naming the file and what is wrong
    (missing, readable by others, malformed); the caller adds how to make one.
    """
    fields = read_secret_json(path)
    signing, keys = fields.get("signing"), fields.get("keys")
    if not isinstance(keys, dict) or not keys or not isinstance(signing, str):
        raise CredentialFileError(
            f"{path} is not a routing keys file: it needs 'signing' (a key id) and 'keys' "
            "(key id -> base64url secret)"
        )
    parsed: dict[str, RoutingKey] = {}
    for key_id, encoded in keys.items():
        try:
            if not isinstance(encoded, str):
                raise ValueError("its secret is not a base64url string")
            secret = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            parsed[key_id] = RoutingKey(key_id, secret)
        except (binascii.Error, ValueError) as exc:
            raise CredentialFileError(f"{path}: routing key {key_id!r}: {exc}") from None
    if signing not in parsed:
        raise CredentialFileError(f"{path}: the signing key {signing!r} is not among its keys")
    retired = tuple(key for key_id, key in parsed.items() if key_id != signing)
    return RoutingKeys(parsed[signing], retired)


def write_routing_keys(path: Path, keys: RoutingKeys) -> None:
    """Write ``keys`` to ``path``, created 0600 and renamed into place."""
    write_secret_file(path, keys.to_json().encode())


def ensure_routing_keys(path: Path) -> RoutingKeys:
    """The routing keys in ``path``, creating the file with one new random key if there is
    none (an existing file is kept: its keys sign and verify the tasks in flight)."""
    if not path.exists():
        write_routing_keys(path, RoutingKeys.generate())
    return read_routing_keys(path)
