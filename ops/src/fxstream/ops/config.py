"""Where the local platform lives and listens: one config from defaults, a TOML file and env vars.

Precedence, lowest first: built-in defaults, the TOML file
(``$FXSTREAM_CONFIG``, else ``<home>/fxstream.toml``), then ``FXSTREAM_*``
environment variables. The default home is a per-user state dir, so a test run
(which points ``home`` at a temp dir and picks free ports) never touches the
platform a user started.
"""

from __future__ import annotations

import os
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from fxstream.sdk.settings import platform_home

__all__ = [
    "INSTANCE_SETTINGS",
    "MAX_INSTANCES",
    "ConfigError",
    "PlatformConfig",
    "kafka_version",
    "repo_root",
]

_POM_NS = "{http://maven.apache.org/POM/4.0.0}"
# Each stream processor's setting for how many processes of it run (its consumer group's
# members), by role.
INSTANCE_SETTINGS = {
    "router": "router_instances",
    "ingress": "ingress_instances",
    "task-state": "task_state_instances",
    "liveness": "liveness_instances",
    "trigger": "trigger_instances",
    "dependencies": "dependencies_instances",
    "analytics": "analytics_instances",
}
# More processes than a role's input partitions (4 per topic) would only stand by.
MAX_INSTANCES = 8


class ConfigError(ValueError):
    """The platform configuration is invalid; the message names the setting to fix."""


def repo_root() -> Path:
    """The checkout this package runs from (it is installed editable by the uv workspace)."""
    return Path(__file__).resolve().parents[4]


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _flag(raw: Any, source: str) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise ConfigError(f"{source} must be 1 or 0 (true or false), got {raw!r}")


def _default_cache(env: Mapping[str, str]) -> Path:
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "fxstream"


def kafka_version(broker_config_dir: Path) -> str:
    """The Apache Kafka version pinned in ``broker-config/pom.xml`` (the one place it is set)."""
    pom = broker_config_dir / "pom.xml"
    root = ET.parse(pom).getroot()
    node = root.find(f"{_POM_NS}properties/{_POM_NS}kafka.version")
    if node is None or not (node.text or "").strip():
        raise ConfigError(f"{pom} does not set <kafka.version>")
    return (node.text or "").strip()


@dataclass(frozen=True)
class PlatformConfig:
    """Ports, directories and names of one local platform."""

    home: Path
    cache_dir: Path
    broker_config_dir: Path
    kafka_port: int = 19092
    controller_port: int = 19093
    cluster_base_port: int = 19110
    redis_port: int = 16379
    service_port: int = 19180
    kafka_heap_mb: int = 1024
    topic_prefix: str = "fx."
    # The supervisor's restart backoff (1 s, doubling, at most this) and the run time
    # after which a restarted service process counts as stable again (backoff reset).
    restart_backoff_max_s: int = 60
    restart_stable_s: int = 60
    # Processes per stream processor (a consumer group each; 1 = no scale-out).
    router_instances: int = 1
    ingress_instances: int = 1
    task_state_instances: int = 1
    liveness_instances: int = 1
    # The trigger processor counts a rule's tasks in flight and its rate per process: run
    # one (docs/triggers.md).
    trigger_instances: int = 1
    # The dependencies processor holds tasks until their parents succeed; two would decide
    # the same tasks twice: run one (docs/triggers.md, "Task DAGs").
    dependencies_instances: int = 1
    # The analytics processor reads every partition of task-state itself: exactly one
    # (docs/triggers.md, "Windowed analytics").
    analytics_instances: int = 1
    # How long a finished task stays in task-state, in seconds (docs/lifecycle.md,
    # "Retention"): the processors and the API are started with it.
    task_retention_s: int = 7 * 24 * 3600
    # The insecure development platform: PLAINTEXT Kafka, no authentication (./fx up
    # --insecure). Secure is the default everywhere.
    insecure: bool = False
    # Not a file or environment setting: tests set it so every process they start is
    # stopped by the kernel if the test run itself dies before its teardown.
    tie_to_caller: bool = False

    # setting name -> environment variable; the TOML file uses the setting names.
    ENV_VARS: ClassVar[dict[str, str]] = {
        "home": "FXSTREAM_HOME",
        "cache_dir": "FXSTREAM_CACHE_DIR",
        "broker_config_dir": "FXSTREAM_BROKER_CONFIG_DIR",
        "kafka_port": "FXSTREAM_KAFKA_PORT",
        "controller_port": "FXSTREAM_CONTROLLER_PORT",
        "cluster_base_port": "FXSTREAM_CLUSTER_BASE_PORT",
        "redis_port": "FXSTREAM_REDIS_PORT",
        "service_port": "FXSTREAM_SERVICE_PORT",
        "kafka_heap_mb": "FXSTREAM_KAFKA_HEAP_MB",
        "topic_prefix": "FXSTREAM_TOPIC_PREFIX",
        "restart_backoff_max_s": "FXSTREAM_RESTART_BACKOFF_MAX_S",
        "restart_stable_s": "FXSTREAM_RESTART_STABLE_S",
        "router_instances": "FXSTREAM_ROUTER_INSTANCES",
        "ingress_instances": "FXSTREAM_INGRESS_INSTANCES",
        "task_state_instances": "FXSTREAM_TASK_STATE_INSTANCES",
        "liveness_instances": "FXSTREAM_LIVENESS_INSTANCES",
        "trigger_instances": "FXSTREAM_TRIGGER_INSTANCES",
        "dependencies_instances": "FXSTREAM_DEPENDENCIES_INSTANCES",
        "analytics_instances": "FXSTREAM_ANALYTICS_INSTANCES",
        "task_retention_s": "FXSTREAM_TASK_RETENTION_S",
        "insecure": "FXSTREAM_INSECURE",
    }

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> PlatformConfig:
        """Build the config from defaults, the TOML file, the environment and ``overrides``."""
        env = os.environ if env is None else env
        # The SDK finds the local user's credentials in the same home (platform_home).
        home = Path(overrides.get("home") or platform_home(env))
        values: dict[str, Any] = {
            "home": home,
            "cache_dir": _default_cache(env),
            "broker_config_dir": repo_root() / "broker-config",
        }
        config_file = Path(env.get("FXSTREAM_CONFIG") or home / "fxstream.toml")
        if config_file.is_file():
            try:
                file_values = tomllib.loads(config_file.read_text())
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{config_file} is not valid TOML: {exc}") from exc
            unknown = set(file_values) - {f.name for f in fields(cls)}
            if unknown:
                raise ConfigError(
                    f"{config_file}: unknown setting(s) {sorted(unknown)}; "
                    f"known: {sorted(cls.ENV_VARS)}"
                )
            values.update(file_values)
        for name, var in cls.ENV_VARS.items():
            if var in env and name != "home":
                values[name] = env[var]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls._coerce(values)

    @classmethod
    def _coerce(cls, values: dict[str, Any]) -> PlatformConfig:
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in values:
                continue
            raw = values[f.name]
            source = f"{f.name} ({cls.ENV_VARS.get(f.name, 'not an environment setting')})"
            if f.name in {"home", "cache_dir", "broker_config_dir"}:
                kwargs[f.name] = Path(raw).expanduser()
            elif f.name == "topic_prefix":
                kwargs[f.name] = str(raw)
            elif f.name == "tie_to_caller":
                kwargs[f.name] = bool(raw)
            elif f.name == "insecure":
                kwargs[f.name] = _flag(raw, source)
            else:
                try:
                    kwargs[f.name] = int(raw)
                except (TypeError, ValueError) as exc:
                    raise ConfigError(f"{source} must be an integer, got {raw!r}") from exc
        config = cls(**kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the setting when a value cannot work."""
        ports = {
            "kafka_port": self.kafka_port,
            "controller_port": self.controller_port,
            "redis_port": self.redis_port,
            "service_port": self.service_port,
        }
        for name, port in ports.items():
            if not 1024 <= port <= 65535:
                raise ConfigError(
                    f"{name} ({self.ENV_VARS[name]}) must be a port in 1024-65535: {port}"
                )
        if len(set(ports.values())) != len(ports):
            raise ConfigError(f"ports must differ: {ports}")
        for name in ("restart_backoff_max_s", "restart_stable_s"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} ({self.ENV_VARS[name]}) must be at least 1 second")
        for name in INSTANCE_SETTINGS.values():
            if not 1 <= getattr(self, name) <= MAX_INSTANCES:
                raise ConfigError(
                    f"{name} ({self.ENV_VARS[name]}) must be 1 to {MAX_INSTANCES} "
                    f"(processes of that stream processor): {getattr(self, name)}"
                )
        if self.dependencies_instances != 1:
            raise ConfigError(
                "dependencies_instances (FXSTREAM_DEPENDENCIES_INSTANCES) must be 1: the "
                "dependencies processor decides every held task, and two would decide them "
                f"twice: {self.dependencies_instances}"
            )
        if self.analytics_instances != 1:
            raise ConfigError(
                "analytics_instances (FXSTREAM_ANALYTICS_INSTANCES) must be 1: the analytics "
                f"processor reads every partition of task-state itself: {self.analytics_instances}"
            )
        if self.task_retention_s < 1:
            raise ConfigError(
                "task_retention_s (FXSTREAM_TASK_RETENTION_S) must be at least 1 second "
                f"(how long a finished task stays in task-state; 604800 is 7 days): "
                f"{self.task_retention_s}"
            )
        if self.kafka_heap_mb < 256:
            raise ConfigError("kafka_heap_mb (FXSTREAM_KAFKA_HEAP_MB) must be at least 256")

    def with_overrides(self, **changes: Any) -> PlatformConfig:
        """A copy with some settings changed (validated)."""
        config = replace(self, **changes)
        config.validate()
        return config

    def instances(self, role: str) -> int:
        """How many processes of stream processor ``role`` run (see ``INSTANCE_SETTINGS``)."""
        return int(getattr(self, INSTANCE_SETTINGS[role]))

    @property
    def kafka_version(self) -> str:
        """The pinned Apache Kafka version."""
        return kafka_version(self.broker_config_dir)

    @property
    def kafka_libs(self) -> Path:
        """Where the broker's jars are cached (outside the repo, shared by checkouts)."""
        return self.cache_dir / f"kafka-{self.kafka_version}" / "libs"

    def cluster_ports(self, node_id: int) -> tuple[int, int]:
        """(broker port, controller port) of node ``node_id`` (1-based) of the 3-node cluster."""
        base = self.cluster_base_port + 2 * (node_id - 1)
        return base, base + 1
