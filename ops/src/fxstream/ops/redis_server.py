"""Redis for the proxy store: one ``redis-server`` with AOF persistence in the platform home."""

from __future__ import annotations

import string
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from fxstream.ops.config import PlatformConfig
from fxstream.ops.process import ManagedProcess, ensure_port_free

__all__ = ["RedisServer"]


@dataclass
class RedisServer:
    """The platform's Redis server."""

    config: PlatformConfig
    binary: str

    @property
    def directory(self) -> Path:
        """Config, data (AOF) and PID file live here."""
        return self.config.home / "redis"

    @property
    def conf_file(self) -> Path:
        """The rendered redis.conf."""
        return self.directory / "redis.conf"

    @property
    def url(self) -> str:
        """redis:// URL clients use."""
        return f"redis://127.0.0.1:{self.config.redis_port}/0"

    @property
    def process(self) -> ManagedProcess:
        """The server as a managed process."""
        return ManagedProcess(
            name="redis",
            argv=[self.binary, str(self.conf_file)],
            pid_file=self.directory / "redis.pid",
            log_file=self.config.home / "logs" / "redis.log",
            die_with_parent=self.config.tie_to_caller,
        )

    def start(self) -> int:
        """Render the config and start the server (no-op when running); returns its PID."""
        if self.process.is_running():
            pid = self.process.pid()
            assert pid is not None
            return pid
        ensure_port_free(self.config.redis_port, "FXSTREAM_REDIS_PORT")
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        template = self.config.broker_config_dir / "redis.conf"
        self.conf_file.write_text(
            string.Template(template.read_text()).substitute(
                port=str(self.config.redis_port), data_dir=str(data)
            )
        )
        return self.process.start()

    def ping(self) -> bool:
        """True when the server answers PING."""
        client = redis.Redis(
            port=self.config.redis_port, socket_timeout=1, socket_connect_timeout=1
        )
        try:
            return bool(client.ping())
        except redis.RedisError:
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
