"""``fxstream-endpoint diagnose``: is this endpoint host able to serve, and if not, why.

Each :class:`Check` says ``ok``, ``warn`` or ``fail`` with a line of detail and, when it
is not ``ok``, what to do. :func:`diagnose` runs them for one configured endpoint:

- **config**: the endpoint's YAML loads and validates;
- **credential**: its credentials file is there, readable by its owner only (0600), and
  names this endpoint;
- **service**: the REST service answers ``/v1/health`` and ``/v1/version``, and this
  agent is not older than the service accepts;
- **kafka**: the broker answers, as the endpoint's own principal, and shows its queue
  topic (authentication and the endpoint's ACLs at once);
- **runtime**: the container runtime of its workers (``bwrap``, ``podman``, ...) is here
  and every image it allows is (a rootfs directory, a SIF file);
- **scheduler**: a batch engine's scheduler commands (``sbatch``, ``qsub``, ...) are on
  ``PATH``;
- **disk**: free space where the endpoint writes (its directory, the staging work
  directory, the system's temporary directory).

:func:`bundle` writes a ``tar.gz`` an operator can send: the report as JSON, the
endpoint's ``config.yaml`` and its log files (``*.log``, each its last 5 MiB); never the
credentials file or anything else of the directory.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final, Literal

import httpx
from confluent_kafka.admin import AdminClient

from fxstream.agent.config import ConfigError, EndpointConfig
from fxstream.agent.containers import ContainerError, runtime_for
from fxstream.agent.heartbeat import AGENT_VERSION

__all__ = ["Check", "bundle", "diagnose"]

Status = Literal["ok", "warn", "fail"]

_LOW_DISK_BYTES: Final = 1_000_000_000
_LOG_TAIL_BYTES: Final = 5 * 1024 * 1024
_SCHEDULER_COMMANDS: Final = {
    "slurm": ("sbatch", "squeue", "scancel"),
    "pbspro": ("qsub", "qstat", "qdel"),
    "torque": ("qsub", "qstat", "qdel"),
    "lsf": ("bsub", "bjobs", "bkill"),
    "condor": ("condor_submit", "condor_q", "condor_rm"),
    "gridengine": ("qsub", "qstat", "qdel"),
}


@dataclass(frozen=True, slots=True)
class Check:
    """One check's outcome: ``status``, what was found and, unless ok, what to do."""

    name: str
    status: Status
    detail: str
    remedy: str = ""


def diagnose(config: EndpointConfig, *, timeout_s: float = 10.0) -> list[Check]:
    """Every check for ``config``'s endpoint (see the module notes), in order."""
    return list(_checks(config, timeout_s))


def _checks(config: EndpointConfig, timeout_s: float) -> Iterator[Check]:
    try:
        config.validate()
        yield Check("config", "ok", f"{config.path} loads ({config.engine} engine)")
    except ConfigError as exc:
        yield Check("config", "fail", str(exc), f"edit {config.path}")
    yield _credential(config)
    yield from _service(config, timeout_s)
    yield _kafka(config, timeout_s)
    yield from _runtime(config)
    yield from _scheduler(config)
    yield from _disk(config)


def _credential(config: EndpointConfig) -> Check:
    path = config.credentials_path
    remedy = f"run `fxstream-endpoint configure {config.name}` to write it"
    if not path.is_file():
        return Check("credential", "fail", f"{path} is missing", remedy)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        return Check(
            "credential",
            "fail",
            f"{path} is readable by others (mode {mode:o})",
            f"chmod 600 {path}",
        )
    try:
        config.credentials()
    except ConfigError as exc:
        return Check("credential", "fail", str(exc), remedy)
    return Check("credential", "ok", f"{path} (0600) names endpoint {config.endpoint_id}")


def _service(config: EndpointConfig, timeout_s: float) -> Iterator[Check]:
    url = config.service_url.rstrip("/")
    try:
        health = httpx.get(f"{url}/v1/health", timeout=timeout_s)
        version = httpx.get(f"{url}/v1/version", timeout=timeout_s)
    except httpx.HTTPError as exc:
        yield Check(
            "service",
            "fail",
            f"{url} does not answer: {exc}",
            "check service_url in the endpoint's config.yaml and this host's network",
        )
        return
    if health.status_code != 200:
        yield Check("service", "fail", f"{url}/v1/health answered {health.status_code}", "")
        return
    kafka_ok = bool(health.json().get("kafka"))
    yield Check(
        "service",
        "ok" if kafka_ok else "warn",
        f"{url} answers; its Kafka {'answers' if kafka_ok else 'does not answer it'}",
        "" if kafka_ok else "the platform's broker is down: ask its operator",
    )
    if version.status_code != 200:
        yield Check("version", "warn", f"{url}/v1/version answered {version.status_code}", "")
        return
    body = version.json()
    need = str(body.get("min_ep_version", ""))
    if _older(AGENT_VERSION, need):
        yield Check(
            "version",
            "fail",
            f"this agent is {AGENT_VERSION}, older than the service's min_ep_version {need}",
            "update fxstream on this host",
        )
    else:
        yield Check("version", "ok", f"agent {AGENT_VERSION}, service {body.get('version')}")


def _older(have: str, need: str) -> bool:
    def numbers(version: str) -> tuple[int, ...]:
        parts = []
        for part in version.split("."):
            digits = "".join(c for c in part if c.isdigit())
            if not digits:
                break
            parts.append(int(digits))
        return tuple(parts)

    return bool(numbers(need)) and numbers(have) < numbers(need)


def _kafka(config: EndpointConfig, timeout_s: float) -> Check:
    try:
        kafka = config.kafka()
    except ConfigError as exc:
        return Check("kafka", "fail", str(exc), f"edit {config.path}")
    admin = AdminClient({**kafka.confluent(), "log_level": 0})
    queue = f"{config.topic_prefix}tasks.ep.{config.endpoint_id}"
    try:
        topics = admin.list_topics(queue, timeout=timeout_s).topics
    except Exception as exc:  # KafkaException: unreachable, or authentication refused
        return Check(
            "kafka",
            "fail",
            f"{config.bootstrap_servers} refused or did not answer: {exc}",
            "check bootstrap_servers and the endpoint's Kafka credential (configure again)",
        )
    found = topics.get(queue)
    if found is None or found.error is not None:
        why = "it does not exist" if found is None else str(found.error)
        return Check(
            "kafka",
            "fail",
            f"the broker answers but not for the queue {queue}: {why}",
            "the endpoint may have been deleted, or its principal lost its ACLs: register it "
            "again (fxstream-endpoint configure)",
        )
    who = kafka.username or "unauthenticated"
    return Check("kafka", "ok", f"{config.bootstrap_servers} as {who}: queue {queue} readable")


def _runtime(config: EndpointConfig) -> Iterator[Check]:
    try:
        images = config.allowed_images()
        runtimes = {config.runtime, *(image.runtime for image in images.values())}
    except ConfigError as exc:
        yield Check("runtime", "fail", str(exc), f"edit {config.path}")
        return
    for name in sorted(runtimes - {"process"}):
        why = runtime_for(name).unavailable()
        if why is None:
            yield Check("runtime", "ok", f"{name} is installed")
        else:
            yield Check("runtime", "fail", why, f"install {name} or drop its images")
    for image in images.values():
        if image.runtime in ("bubblewrap", "apptainer") and not os.path.exists(image.reference):
            yield Check(
                "image",
                "fail",
                f"image {image.name!r}: {image.reference} is missing",
                f"build it (fxstream-endpoint image) or remove it from {config.path}",
            )


def _scheduler(config: EndpointConfig) -> Iterator[Check]:
    if config.engine != "htex":
        return
    try:
        provider = config.batch_settings().provider
    except (ConfigError, ContainerError) as exc:
        yield Check("scheduler", "fail", str(exc), f"edit {config.path}")
        return
    missing = [c for c in _SCHEDULER_COMMANDS.get(provider, ()) if shutil.which(c) is None]
    if missing:
        yield Check(
            "scheduler",
            "fail",
            f"the {provider} provider needs {', '.join(missing)} on PATH",
            "run the endpoint on a login node of the cluster, or load its scheduler's module",
        )
    else:
        yield Check("scheduler", "ok", f"{provider} provider")


def _disk(config: EndpointConfig) -> Iterator[Check]:
    places = {
        "endpoint directory": config.directory,
        "temporary files": Path(tempfile.gettempdir()),
    }
    staging = config.staging_root()
    if staging is not None:
        places["staging work_dir"] = staging
    for what, path in places.items():
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        free = shutil.disk_usage(existing).free
        status: Status = "ok" if free >= _LOW_DISK_BYTES else "warn"
        yield Check(
            "disk",
            status,
            f"{what} {path}: {free / 1e9:.1f} GB free",
            "" if status == "ok" else f"free space on the file system of {existing}",
        )


def bundle(config: EndpointConfig, checks: list[Check], into: Path) -> Path:
    """Write ``fxstream-diagnose-<name>-<time>.tar.gz`` in ``into`` (see the module notes)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = into / f"fxstream-diagnose-{config.name}-{stamp}.tar.gz"
    report = json.dumps([asdict(c) for c in checks], indent=2).encode()
    secret = config.credentials_path.resolve()
    with tarfile.open(path, "w:gz") as archive:
        _add_bytes(archive, "report.json", report)
        if config.path.is_file():
            archive.add(config.path, arcname="config.yaml")
        for log in sorted(config.directory.glob("*.log")):
            if log.resolve() != secret:
                _add_bytes(archive, f"logs/{log.name}", _tail(log, _LOG_TAIL_BYTES))
    os.chmod(path, 0o600)
    return path


def _add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    info.mode = 0o600
    archive.addfile(info, io.BytesIO(data))


def _tail(path: Path, limit: int) -> bytes:
    with path.open("rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - limit))
        return handle.read()
