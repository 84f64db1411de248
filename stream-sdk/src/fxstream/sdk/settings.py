"""Where a Client finds its service, broker and credentials.

:meth:`ClientSettings.from_environment` reads a credentials JSON file (named
by ``FXSTREAM_CREDENTIALS``; readable by its owner only, mode 600, since it holds
secrets) first, then the ``FXSTREAM_*`` variables, which override the file key by key.
Without ``FXSTREAM_CREDENTIALS``, the file ``./fx up`` wrote is read when it exists:
``credentials.json`` in the platform's home (``FXSTREAM_HOME``, else
``$XDG_STATE_HOME/fxstream``, else ``~/.local/state/fxstream``), so ``Client()`` and
``Executor()`` with no arguments find the platform ``./fx up`` left, as Globus Compute's
do after a login:

=============================  ======================  ============================
variable                       credentials file key    meaning
=============================  ======================  ============================
``FXSTREAM_SERVICE_URL``       ``service_url``         the REST service's base URL
``FXSTREAM_BOOTSTRAP``         ``bootstrap``           Kafka bootstrap servers
``FXSTREAM_TOPIC_PREFIX``      ``topic_prefix``        topic name prefix (``fx.``)
``FXSTREAM_USER_ID``           ``user_id``             your user id
``FXSTREAM_TOKEN``             ``token``               your API token
``FXSTREAM_MAX_INLINE_BYTES``  ``max_inline_bytes``    largest argument payload sent inline
``FXSTREAM_STORE_URL``         ``store_url``           proxy store for large arguments
``FXSTREAM_PROXY_THRESHOLD``   ``proxy_threshold``     bytes above which a value goes
                                                       by reference (default 64 KiB)
=============================  ======================  ============================

``store_url`` is a store URL (``redis://HOST:PORT``, ``file:///DIR``; see
:mod:`fxstream.connectors.stores`); ``./fx up`` writes the platform's Redis.
Without one, every argument must fit inline.

Your Kafka principal comes from the file only (no variable, so the password is
never in the environment): ``kafka_username``, ``kafka_password`` and
``kafka_ca_file`` (the platform's CA certificate), read by
:meth:`fxstream.topics.KafkaConnection.from_json`. Without ``kafka_username`` the
client connects unauthenticated, which only the insecure development platform
accepts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from fxstream.connectors import DEFAULT_PROXY_THRESHOLD_BYTES
from fxstream.sdk.errors import ConfigurationError
from fxstream.topics import CredentialFileError, KafkaConnection, read_secret_json

__all__ = [
    "CREDENTIALS_VARIABLE",
    "DEFAULT_MAX_INLINE_BYTES",
    "DEFAULT_PROXY_THRESHOLD",
    "DEFAULT_TOPIC_PREFIX",
    "ENV_VARIABLES",
    "HOME_VARIABLE",
    "KAFKA_KEYS",
    "ClientSettings",
    "default_credentials_file",
    "platform_home",
]

DEFAULT_TOPIC_PREFIX: Final = "fx."

DEFAULT_MAX_INLINE_BYTES: Final = 512 * 1024
"""Largest argument payload sent inside the task record (after large values went by reference)."""

DEFAULT_PROXY_THRESHOLD: Final = DEFAULT_PROXY_THRESHOLD_BYTES
"""Arguments that serialize above this many bytes go to the proxy store (when one is set)."""

CREDENTIALS_VARIABLE: Final = "FXSTREAM_CREDENTIALS"
HOME_VARIABLE: Final = "FXSTREAM_HOME"
"""The platform's home directory (``./fx up`` keeps its state and your credentials there)."""
_CREDENTIALS_NAME: Final = "credentials.json"


def platform_home(env: Mapping[str, str] | None = None) -> Path:
    """The home of a platform started by ``./fx up``: ``FXSTREAM_HOME``, else
    ``$XDG_STATE_HOME/fxstream``, else ``~/.local/state/fxstream``."""
    env = os.environ if env is None else env
    explicit = env.get(HOME_VARIABLE)
    if explicit:
        return Path(explicit)
    state = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "fxstream"


def default_credentials_file(env: Mapping[str, str] | None = None) -> Path:
    """The credentials file ``./fx up`` writes for its local user (it may not exist)."""
    return platform_home(env) / _CREDENTIALS_NAME


ENV_VARIABLES: Final[dict[str, str]] = {
    "service_url": "FXSTREAM_SERVICE_URL",
    "bootstrap": "FXSTREAM_BOOTSTRAP",
    "topic_prefix": "FXSTREAM_TOPIC_PREFIX",
    "user_id": "FXSTREAM_USER_ID",
    "token": "FXSTREAM_TOKEN",
    "max_inline_bytes": "FXSTREAM_MAX_INLINE_BYTES",
    "store_url": "FXSTREAM_STORE_URL",
    "proxy_threshold": "FXSTREAM_PROXY_THRESHOLD",
}
"""Setting name -> environment variable (the setting name is also the credentials file key)."""

KAFKA_KEYS: Final = ("kafka_username", "kafka_password", "kafka_ca_file")
"""The credentials file keys of your Kafka principal (file only: no variables)."""


@dataclass(frozen=True)
class ClientSettings:
    """Everything a :class:`~fxstream.sdk.Client` needs to connect."""

    service_url: str
    kafka: KafkaConnection
    topic_prefix: str = DEFAULT_TOPIC_PREFIX
    user_id: str | None = None
    token: str | None = None
    max_inline_bytes: int = DEFAULT_MAX_INLINE_BYTES
    store_url: str | None = field(default=None, repr=False)  # a Redis URL holds a password
    proxy_threshold: int = DEFAULT_PROXY_THRESHOLD

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> ClientSettings:
        """Settings from the credentials file named by ``FXSTREAM_CREDENTIALS`` and ``FXSTREAM_*``.

        ``env`` defaults to ``os.environ``. Variables override file keys.
        Raises :class:`ConfigurationError` naming what is missing or malformed.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        path = env.get(CREDENTIALS_VARIABLE)
        if not path and not env.get(ENV_VARIABLES["service_url"]):
            fallback = default_credentials_file(env)
            path = str(fallback) if fallback.is_file() else None
        if path:
            values.update(_read_credentials(Path(path)))
        for setting, variable in ENV_VARIABLES.items():
            value = env.get(variable)
            if value:
                values[setting] = value
        missing = [s for s in ("service_url", "bootstrap") if not values.get(s)]
        if missing:
            names = " and ".join(f"{ENV_VARIABLES[s]} (key {s!r})" for s in missing)
            raise ConfigurationError(
                f"no {' or '.join(missing)} configured: set {names}, or point "
                f"{CREDENTIALS_VARIABLE} at a credentials JSON file holding them "
                f"(`./fx up` writes one to {default_credentials_file(env)}, read "
                "without any setting)"
            )
        try:
            kafka = KafkaConnection.from_json(
                values, source=str(path) if path else "the FXSTREAM_* variables"
            )
        except CredentialFileError as exc:
            raise ConfigurationError(str(exc)) from None
        return cls(
            service_url=str(values["service_url"]),
            kafka=kafka,
            topic_prefix=str(values.get("topic_prefix") or DEFAULT_TOPIC_PREFIX),
            user_id=_optional_str(values.get("user_id")),
            token=_optional_str(values.get("token")),
            max_inline_bytes=_size(values.get("max_inline_bytes"), "max_inline_bytes"),
            store_url=_optional_str(values.get("store_url")),
            proxy_threshold=_size(values.get("proxy_threshold"), "proxy_threshold"),
        )


def _optional_str(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)


_SIZE_DEFAULTS: Final = {
    "max_inline_bytes": DEFAULT_MAX_INLINE_BYTES,
    "proxy_threshold": DEFAULT_PROXY_THRESHOLD,
}


def _size(value: Any, setting: str) -> int:
    if value is None or value == "":
        return _SIZE_DEFAULTS[setting]
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = -1
    if size <= 0:
        raise ConfigurationError(
            f"{setting} ({ENV_VARIABLES[setting]}) must be a positive number "
            f"of bytes, not {value!r}"
        )
    return size


def _read_credentials(path: Path) -> dict[str, Any]:
    try:
        data = read_secret_json(path)
    except CredentialFileError as exc:
        raise ConfigurationError(
            f"cannot use the credentials file named by {CREDENTIALS_VARIABLE}: {exc}"
        ) from exc
    known = (*ENV_VARIABLES, *KAFKA_KEYS)
    unknown = sorted(set(data) - set(known))
    if unknown:
        renamed = (
            "; 'bootstrap_servers' is now 'bootstrap' (./fx up rewrites the file)"
            if "bootstrap_servers" in unknown
            else ""
        )
        raise ConfigurationError(
            f"the credentials file {str(path)!r} has unknown keys {unknown}; "
            f"known keys: {', '.join(known)}{renamed}"
        )
    return data
