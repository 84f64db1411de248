"""Redis for the proxy store: one ``redis-server`` with AOF persistence in the platform home.

Secure by default (docs/security.md, "Redis"):

* ACL users only: the ``default`` user is off, so an unauthenticated client can run
  nothing. ``fxstream`` (every connector: SDK, agent, workers) may run only the commands
  :class:`~fxstream.connectors.RedisConnector` uses, on ``fxobj:*`` keys;
  ``fxstream-admin`` is the operator's. Their passwords are generated once per platform
  home into ``<home>/credentials/redis.json`` (0600); the ACL file (0600) holds only
  their SHA-256 hashes. No password is on any command line: ``redis-server`` reads both
  files itself.
* ``CONFIG``, ``MODULE``, ``DEBUG``, ``FLUSHALL`` and ``FLUSHDB`` are renamed away.
* The directory and the data directory are 0700; the server runs with umask 077, so
  the AOF and RDB files it writes are 0600.
* TLS when the operator asks (``FXSTREAM_REDIS_TLS=1``): the server listens with TLS
  only, with a certificate and key the platform CA issues (``<home>/pki/redis.crt``,
  ``redis.key``, 0600; :meth:`fxstream.ops.pki.LocalCA.ensure_server`); clients verify
  it against the CA certificate every Kafka client trusts (``pki/ca.pem``).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import string
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import redis

from fxstream.ops.config import PlatformConfig
from fxstream.ops.pki import LocalCA
from fxstream.ops.process import ManagedProcess, ensure_port_free
from fxstream.topics import read_secret_json, write_secret_file

__all__ = [
    "ADMIN_USER",
    "REDIS_TLS_ENV",
    "STORE_COMMANDS",
    "STORE_KEY_PATTERN",
    "STORE_USER",
    "RedisServer",
]

STORE_USER: Final = "fxstream"
"""The Redis user of every proxy-store connector."""

ADMIN_USER: Final = "fxstream-admin"
"""The operator's Redis user (every command that is not renamed away, every key)."""

STORE_KEY_PATTERN: Final = "fxobj:*"
"""The keys :data:`STORE_USER` may touch (``fxstream.connectors.redis.DEFAULT_KEY_PREFIX``)."""

STORE_COMMANDS: Final = (
    # what fxstream.connectors.redis.RedisConnector sends
    "get",
    "mget",
    "set",
    "del",
    "exists",
    "expire",
    "ttl",
    "scan",
    # connection setup: authentication, health checks, database choice (redis-py's
    # CLIENT SETINFO is Redis 7.2's; refused here, and redis-py ignores the refusal)
    "auth",
    "hello",
    "ping",
    "select",
)
"""The commands :data:`STORE_USER` may run; nothing of ``@admin`` or ``@dangerous``."""

REDIS_TLS_ENV: Final = "FXSTREAM_REDIS_TLS"
"""Set to ``1`` to serve Redis over TLS only (certificates from ``<home>/pki``)."""


def _tls_requested() -> bool:
    return os.environ.get(REDIS_TLS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class RedisServer:
    """The platform's Redis server."""

    config: PlatformConfig
    binary: str
    tls: bool = field(default_factory=_tls_requested)

    @property
    def directory(self) -> Path:
        """Config, ACL file, data (AOF) and PID file live here (0700)."""
        return self.config.home / "redis"

    @property
    def conf_file(self) -> Path:
        """The rendered redis.conf (0600)."""
        return self.directory / "redis.conf"

    @property
    def acl_file(self) -> Path:
        """The ACL users and their password hashes (0600)."""
        return self.directory / "users.acl"

    @property
    def data_dir(self) -> Path:
        """The AOF and RDB files (0700; the files 0600)."""
        return self.directory / "data"

    @property
    def passwords_file(self) -> Path:
        """The users' passwords, generated once per platform home (0600)."""
        return self.config.home / "credentials" / "redis.json"

    @property
    def pki_dir(self) -> Path:
        """The platform CA's directory: ``ca.pem``, and ``redis.crt``/``redis.key`` (TLS)."""
        return self.config.home / "pki"

    @property
    def ca_file(self) -> Path:
        """The platform CA clients verify the server against (TLS only)."""
        return LocalCA(self.pki_dir).cert_file

    @property
    def url(self) -> str:
        """Where the server is, without credentials (for status output and logs)."""
        return f"{self._scheme()}://127.0.0.1:{self.config.redis_port}/0"

    @property
    def client_url(self) -> str:
        """The store URL clients use: the ``fxstream`` user and its password. A secret."""
        return self._url_for(STORE_USER)

    @property
    def admin_url(self) -> str:
        """The operator's URL (``fxstream-admin``). A secret."""
        return self._url_for(ADMIN_USER)

    def _scheme(self) -> str:
        return "rediss" if self.tls else "redis"

    def _url_for(self, user: str) -> str:
        password = urllib.parse.quote(self.passwords()[user], safe="")
        url = f"{self._scheme()}://{user}:{password}@127.0.0.1:{self.config.redis_port}/0"
        if self.tls:
            url += "?" + urllib.parse.urlencode({"ca_file": str(self.ca_file)})
        return url

    def passwords(self) -> dict[str, str]:
        """Each user's password, generated (0600) the first time."""
        if not self.passwords_file.exists():
            generated = {user: secrets.token_urlsafe(32) for user in (STORE_USER, ADMIN_USER)}
            write_secret_file(self.passwords_file, json.dumps(generated).encode())
        stored = read_secret_json(self.passwords_file)
        missing = {STORE_USER, ADMIN_USER} - set(stored)
        if missing:
            raise RuntimeError(
                f"{self.passwords_file} lacks the Redis password of {sorted(missing)}: remove "
                "the file and run `./fx up` again to generate new ones"
            )
        return {str(user): str(password) for user, password in stored.items()}

    @property
    def process(self) -> ManagedProcess:
        """The server as a managed process (umask 077: what it writes is 0600)."""
        return ManagedProcess(
            name="redis",
            argv=[self.binary, str(self.conf_file)],
            pid_file=self.directory / "redis.pid",
            log_file=self.config.home / "logs" / "redis.log",
            die_with_parent=self.config.tie_to_caller,
            umask=0o077,
        )

    def start(self) -> int:
        """Render the config and ACL file and start the server (no-op when running).

        Returns its PID.
        """
        if self.process.is_running():
            pid = self.process.pid()
            assert pid is not None
            return pid
        ensure_port_free(self.config.redis_port, "FXSTREAM_REDIS_PORT")
        self._secure_directories()
        passwords = self.passwords()
        write_secret_file(self.acl_file, self._acl(passwords).encode())
        template = self.config.broker_config_dir / "redis.conf"
        rendered = string.Template(template.read_text()).substitute(
            listen=self._listen(), data_dir=str(self.data_dir), acl_file=str(self.acl_file)
        )
        write_secret_file(self.conf_file, rendered.encode())
        return self.process.start()

    def _secure_directories(self) -> None:
        for directory in (self.directory, self.data_dir):
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            directory.chmod(0o700)
        # Files an earlier, looser version left behind (AOF, RDB, manifest).
        for path in self.data_dir.rglob("*"):
            path.chmod(0o700 if path.is_dir() else 0o600)

    def _acl(self, passwords: dict[str, str]) -> str:
        def hashed(user: str) -> str:
            return "#" + hashlib.sha256(passwords[user].encode()).hexdigest()

        commands = " ".join(f"+{command}" for command in STORE_COMMANDS)
        return (
            "user default off resetpass resetkeys resetchannels -@all\n"
            f"user {STORE_USER} on {hashed(STORE_USER)} resetkeys ~{STORE_KEY_PATTERN} "
            f"resetchannels -@all {commands}\n"
            f"user {ADMIN_USER} on {hashed(ADMIN_USER)} ~* &* +@all\n"
        )

    def _listen(self) -> str:
        port = str(self.config.redis_port)
        if not self.tls:
            return f"port {port}"
        cert_file, key_file = LocalCA(self.pki_dir).ensure_server("redis")
        files = {
            "tls-cert-file": cert_file,
            "tls-key-file": key_file,
            "tls-ca-cert-file": self.ca_file,
        }
        lines = ["port 0", f"tls-port {port}", "tls-auth-clients no"]
        lines += [f"{name} {path}" for name, path in files.items()]
        return "\n".join(lines)

    def _client(self, user: str = STORE_USER) -> redis.Redis:
        options: dict[str, Any] = {}
        if self.tls:
            options = {"ssl": True, "ssl_cert_reqs": "required", "ssl_ca_certs": str(self.ca_file)}
        return redis.Redis(
            host="127.0.0.1",  # the name the TLS certificate is for
            port=self.config.redis_port,
            username=user,
            password=self.passwords()[user],
            socket_timeout=1,
            socket_connect_timeout=1,
            **options,
        )

    def ping(self) -> bool:
        """True when the server answers PING to the ``fxstream`` user."""
        client = self._client()
        try:
            return bool(client.ping())
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until PING answers; raise if the server died or never answered."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.process.check_alive()
            if self.ping():
                return
            time.sleep(0.1)
        raise TimeoutError(f"redis on port {self.config.redis_port} not ready after {timeout_s}s")
