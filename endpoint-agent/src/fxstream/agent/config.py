"""An endpoint's configuration: one YAML file per named endpoint.

Files live in ``$FXSTREAM_ENDPOINTS_DIR/<name>/config.yaml`` (default
``~/.fxstream/endpoints``), beside the endpoint's log and PID file, in a directory only
its owner may enter (0700). ``config.yaml`` holds settings, never a secret: the endpoint's
credential (its Kafka principal and API token, never its owner's) is in the 0600 file
``credentials_file`` names (:mod:`fxstream.agent.credentials`).

A shared endpoint narrows what it runs: ``allowed_functions`` (function ids) and
``allowed_serializers`` (data strategies of the arguments, e.g. ``[json]``); a task outside
them is refused before anything of it is deserialized (:mod:`fxstream.agent.policy`).

Containers: ``runtime`` names what every worker runs in (``process``: no container;
``bubblewrap``, ``podman``, ``docker``, ``apptainer``: :mod:`fxstream.agent.containers`),
``images`` the images the endpoint allows by name (``"runtime:reference"``: a rootfs
directory for bubblewrap, ``/`` for the host's own; a local image name for podman or
docker; a SIF file or directory for apptainer; never pulled) and ``image`` the one its
workers run by default. A function registered with a container runs only in that
container: in its image's own pool of workers where ``images`` allows it; elsewhere it is
refused before it runs, saying what to add here.
``writable_dirs`` are host directories the workers may write besides their own sandbox.

Engines: ``engine: process`` (the default) runs warm worker processes beside the agent;
``engine: htex`` runs tasks through Parsl's HighThroughputExecutor on blocks a batch
scheduler (or the local machine) provides, set in the ``batch:`` section
(:mod:`fxstream.agent.batch_settings`, :mod:`fxstream.agent.batch_engine`). With it,
``workers`` is how many tasks the agent hands the engine at once besides ``prefetch``:
set it to the most workers the blocks run (``max_blocks`` x ``nodes_per_block`` x
workers per node), or fewer tasks wait in the engine than it could run and it does not
scale out that far.

Python versions (:mod:`fxstream.agent.python_envs`): a task runs only in a worker of the
Python major.minor its client serialized the function with. The workers of ``image`` and
``images`` run the agent's own interpreter; ``interpreters`` lists other Python
interpreters (absolute paths, e.g. ``[/opt/py312/bin/python]``: each a virtualenv's
``python`` with fxstream-agent installed), each with a pool of its own (in ``image``'s
container when there is one) for the tasks of its version. Their versions are found when
the agent starts; one that cannot run workers stops it there, saying why.

Image pools (:mod:`fxstream.agent.image_pools`): without ``max_workers`` each image in
use has ``workers`` workers (every image's pool fits); a pool other than ``image``'s that
sits idle ``pool_idle_s`` seconds is released (started again, cold, at its image's next
task). With ``max_workers`` at most that many workers run across the pools, each pool
sized to the task mix (its image's share of the latest tasks, capped by its tasks queued
and running; at least one worker; ``image``'s pool starts with ``workers``): pools are
grown and shrunk as the mix shifts, and a task for an image without a pool releases the
least recently used idle pool when every worker is a pool's last, or waits until one
goes idle. With fewer possible pools than images the agent hands its engine tasks of
images whose pools run first (:mod:`fxstream.agent.pick`); an image passed over
``max_image_wait_s`` seconds gets its turn (a pool released for it).

Staging (:mod:`fxstream.agent.staging`): with a ``staging:`` section the endpoint stages
the files tasks declare (``stage_in``, ``stage_out``) into and out of a working directory
per task under ``staging.work_dir``: ``file://`` URLs inside ``staging.roots`` only,
``store://`` objects through ``store_url``, ``globus://`` files through the collection
``staging.globus`` names. Without it, a task that declares files fails ``StagingFailed``.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import msgspec
import yaml

from fxstream.agent.batch_settings import BatchSettings, BatchSettingsError, MpiSettings
from fxstream.agent.containers import RUNTIMES, ContainerError, Image, runtime_for
from fxstream.agent.credentials import EndpointCredentials
from fxstream.agent.image_pools import DEFAULT_POOL_IDLE_S
from fxstream.agent.pick import DEFAULT_MAX_IMAGE_WAIT_S
from fxstream.agent.staging import GlobusStaging, StagingSettings
from fxstream.connectors import DEFAULT_PROXY_THRESHOLD_BYTES, StoreSpec, StoreURLError
from fxstream.topics import (
    CredentialFileError,
    KafkaConnection,
    ResourceSpecification,
    registered_strategies,
)
from fxstream.topics.connection import write_secret_file

__all__ = [
    "ENGINES",
    "KAFKA_DEBUG_CONTEXTS",
    "ConfigError",
    "EndpointConfig",
    "endpoint_dir",
    "endpoints_root",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")

ENGINES = ("process", "htex")
"""The engines an endpoint may name."""


class ConfigError(ValueError):
    """An endpoint config is missing or invalid; the message names the field and the fix."""


def endpoints_root() -> Path:
    """Where endpoint directories live."""
    return Path(os.environ.get("FXSTREAM_ENDPOINTS_DIR", Path.home() / ".fxstream" / "endpoints"))


def endpoint_dir(name: str) -> Path:
    """The directory of the endpoint called ``name`` (config, log, PID file)."""
    if not _NAME.match(name):
        raise ConfigError(
            f"endpoint name {name!r} is not usable: 1-64 letters, digits, '-' or '_', "
            "starting with a letter or digit"
        )
    return endpoints_root() / name


KAFKA_DEBUG_CONTEXTS = (
    "generic", "broker", "topic", "metadata", "feature", "queue", "msg", "protocol", "cgrp",
    "security", "fetch", "interceptor", "plugin", "consumer", "admin", "eos", "assignor",
    "conf", "all",
)  # fmt: skip
"""librdkafka's debug contexts, for ``kafka_debug``."""


@dataclass(frozen=True)
class EndpointConfig:
    """Everything an agent needs to serve one endpoint."""

    name: str
    endpoint_id: str
    service_url: str
    bootstrap_servers: str
    # The 0600 JSON file with the endpoint's own credential: its API token (and the Kafka
    # principal the service issued it, if any); relative to this endpoint's directory.
    credentials_file: str = "credentials.json"
    topic_prefix: str = "fx."
    workers: int = 2
    prefetch: int = 16
    max_local_queue: int = 2_000
    max_local_queue_bytes: int = 64 * 1024 * 1024
    heartbeat_period_s: float = 5.0
    # How long this agent's tasks stay leased to it without a sign of life (Kafka's
    # consumer session timeout): after that its partitions, and so its unanswered
    # tasks, go to another agent of the endpoint, and a zombie's results are fenced.
    lease_timeout_s: float = 30.0
    engine: str = "process"
    # The largest serialized return value sent inline (by reference with store_url set,
    # above proxy_threshold); the result record must also fit the results topic.
    max_result_bytes: int = 1_000_000
    # Backoff before retry n of a task (n = 1, 2, ...): min(base * 2**(n-1), max).
    retry_backoff_s: float = 0.5
    retry_backoff_max_s: float = 30.0
    # The endpoint's proxy store (a store URL: redis://HOST:PORT, file:///DIR): results
    # above proxy_threshold bytes go there and only a reference goes to Kafka. A Redis
    # URL holds the store's password: kept out of the repr.
    store_url: str | None = field(default=None, repr=False)
    proxy_threshold: int = DEFAULT_PROXY_THRESHOLD_BYTES
    # The endpoint's Kafka principal: the path of its 0600 JSON credentials file
    # (kafka_username, kafka_password, kafka_ca_file), never the secret itself. None: the
    # principal in credentials_file, if the service issued one; else the agent connects
    # unauthenticated (the insecure development platform only).
    kafka_credentials: str | None = None
    # What this endpoint runs (empty: anything its users send): function ids, and the
    # data strategies (ids or names, e.g. "js" or "json") their arguments may use.
    allowed_functions: tuple[str, ...] = ()
    allowed_serializers: tuple[str, ...] = ()
    # The container runtime every worker runs in, the images this endpoint allows (name ->
    # "runtime:reference") and the one its workers use (required unless runtime is process).
    runtime: str = "process"
    image: str | None = None
    images: dict[str, str] = field(default_factory=dict)
    # Host directories the workers may write besides their own sandbox (a file store's
    # directory is added by itself).
    writable_dirs: tuple[str, ...] = ()
    # Seconds an image's pool (not the default image's) may sit idle before its workers
    # stop, and the most workers across the pools, each pool sized to the task mix (None:
    # workers per pool, every image's pool at once).
    pool_idle_s: float = DEFAULT_POOL_IDLE_S
    max_workers: int | None = None
    # With fewer pools than images (max_workers), the agent hands its engine tasks of
    # images whose pools run first; an image's oldest task passed over this long is
    # handed over anyway (its pool started in place of another's).
    max_image_wait_s: float = DEFAULT_MAX_IMAGE_WAIT_S
    # Other Python interpreters the workers may run (absolute paths of virtualenvs'
    # pythons with fxstream-agent installed), for tasks submitted from their versions.
    interpreters: tuple[str, ...] = ()
    # engine "htex": the batch engine's provider, blocks and scaling (batch_settings).
    batch: BatchSettings | None = None
    # Staged files (fxstream.agent.staging): the tasks' working directories, the roots
    # file:// URLs may use, the transfer slots and the Globus collection. None: no staging.
    staging: StagingSettings | None = None
    # librdkafka debug contexts for the agent's queue consumer (e.g. "cgrp,topic": group
    # membership, assignments, fetch starts, offset resets, pauses), written to the
    # agent's log; empty: none. For diagnosing a queue that stops being read.
    kafka_debug: str = ""

    def kafka(self, credentials: EndpointCredentials | None = None) -> KafkaConnection:
        """How the agent connects to Kafka, to ``bootstrap_servers``: as the principal of
        ``kafka_credentials``, else as the one in the endpoint's credential (``credentials``,
        read from ``credentials_file`` if not given and the file exists), else
        unauthenticated. A :class:`ConfigError` says what is wrong with a file."""
        if self.kafka_credentials is not None:
            try:
                principal: KafkaConnection | None = KafkaConnection.from_file(
                    Path(self.kafka_credentials)
                )
            except CredentialFileError as exc:
                raise ConfigError(f"kafka_credentials: {exc}") from None
        else:
            if credentials is None and self.credentials_path.is_file():
                credentials = self.credentials()
            principal = credentials.kafka if credentials is not None else None
        if principal is None or principal.username is None:
            return KafkaConnection(self.bootstrap_servers)
        return KafkaConnection(
            self.bootstrap_servers, principal.username, principal.password, principal.ca_file
        )

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the field when a value cannot work."""
        if self.workers < 1:
            raise ConfigError("workers must be at least 1")
        if self.prefetch < 0:
            raise ConfigError("prefetch must be 0 or more")
        if self.max_local_queue < 1:
            raise ConfigError("max_local_queue must be at least 1")
        if self.max_local_queue_bytes < 1024 * 1024:
            raise ConfigError("max_local_queue_bytes must be at least 1 MiB (1048576)")
        if self.heartbeat_period_s <= 0:
            raise ConfigError("heartbeat_period_s must be positive")
        if not 6.0 <= self.lease_timeout_s <= 3600.0:
            # Kafka's brokers accept session timeouts of 6 s to 30 min by default
            # (group.min/max.session.timeout.ms); the lease must outlast a heartbeat.
            raise ConfigError("lease_timeout_s must be between 6 and 3600 seconds")
        if self.lease_timeout_s < 2 * self.heartbeat_period_s:
            raise ConfigError(
                "lease_timeout_s must be at least twice heartbeat_period_s, or one late "
                "heartbeat would lose the lease"
            )
        if self.retry_backoff_s < 0 or self.retry_backoff_max_s < self.retry_backoff_s:
            raise ConfigError("retry_backoff_s must be >= 0 and <= retry_backoff_max_s")
        if self.proxy_threshold < 0:
            raise ConfigError("proxy_threshold must be 0 or more bytes")
        unknown = {c.strip() for c in self.kafka_debug.split(",") if c.strip()} - set(
            KAFKA_DEBUG_CONTEXTS
        )
        if unknown:
            raise ConfigError(
                f"kafka_debug: unknown librdkafka debug context(s) {sorted(unknown)}; use a "
                f"comma-separated list of {', '.join(KAFKA_DEBUG_CONTEXTS)}"
            )
        if self.store_url is not None:
            try:
                StoreSpec.parse(self.store_url)
            except StoreURLError as exc:
                raise ConfigError(f"store_url: {exc}") from None
        self.serializer_ids()
        if any(not isinstance(f, str) or not f for f in self.allowed_functions):
            raise ConfigError("allowed_functions must be a list of function ids")
        if self.kafka_credentials is not None:
            self.kafka()  # the file exists, is 0600 and names a usable principal
        if self.engine not in ENGINES:
            raise ConfigError(
                f"engine {self.engine!r} is not available: 'process' (warm local worker "
                "processes, in the container runtime `runtime` names) or 'htex' (Parsl's "
                "HighThroughputExecutor on a batch scheduler's blocks, set in `batch:`)"
            )
        self._check_batch()
        self.worker_image()
        self._check_runtimes()
        if any(not os.path.isabs(d) for d in self.writable_dirs):
            raise ConfigError("writable_dirs must be absolute paths")
        self._check_interpreters()
        self._check_pools()
        if self.staging is not None:
            problems = self.staging.problems()
            if problems:
                raise ConfigError("; ".join(problems))

    def staging_root(self) -> Path | None:
        """Where staged tasks' working directories are (None: the endpoint stages nothing)."""
        return None if self.staging is None else self.staging.task_root(self.directory)

    def _check_batch(self) -> None:
        if self.engine != "htex":
            if self.batch is not None:
                raise ConfigError("batch: is read only with engine: htex; remove it or set it")
            return
        if self.interpreters:
            raise ConfigError(
                "engine htex runs every block's workers with one interpreter, the agent's: "
                "remove interpreters, or use engine: process"
            )
        others = sorted(set(self.images) - {self.image})
        if others:
            raise ConfigError(
                "engine htex runs every block's workers in one container, the endpoint's "
                f"image ({self.image or 'none'}): remove {', '.join(others)} from images, "
                "or use engine: process for a pool per image"
            )
        try:
            self.batch_settings().validate()
        except BatchSettingsError as exc:
            raise ConfigError(str(exc)) from None

    def resource_refusal(self, resources: ResourceSpecification | None) -> str | None:
        """Why this endpoint cannot run a task with ``resources`` (its
        ``resource_specification``), or ``None``: only an ``htex`` engine with ``batch.mpi``
        runs MPI tasks, and it runs nothing else."""
        num_nodes = None if resources is None else resources.num_nodes
        if self.engine != "htex":
            if num_nodes is None:
                return None
            return (
                f"endpoint {self.name!r} runs engine {self.engine!r}, which has no MPI mode, so "
                "it cannot run a task with a resource_specification (an MPIFunction): submit "
                "it to an endpoint with engine: htex and batch.mpi, or without "
                "resource_specification"
            )
        return self.batch_settings().resource_refusal(num_nodes)

    def batch_settings(self) -> BatchSettings:
        """The batch engine's settings (its defaults when ``batch:`` is absent)."""
        return self.batch if self.batch is not None else BatchSettings()

    def _check_interpreters(self) -> None:
        """Absolute, distinct, executable paths, none an image's name (they name pools)."""
        for path in self.interpreters:
            if not isinstance(path, str) or not os.path.isabs(path):
                raise ConfigError(
                    f"interpreters: {path!r} is not an absolute path; list the python of a "
                    "virtualenv with fxstream-agent installed, e.g. [/opt/py312/bin/python]"
                )
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                raise ConfigError(f"interpreters: {path} is not an executable file")
            if path in self.images:
                raise ConfigError(
                    f"interpreters: {path} is also the name of an image; rename the image"
                )
        if len(set(self.interpreters)) != len(self.interpreters):
            raise ConfigError("interpreters: an interpreter is listed twice; list it once")

    def pool_count(self) -> int:
        """How many image pools this endpoint may run: one per allowed image and per
        interpreter, plus the no-container pool when ``image`` is not set."""
        return len(self.images) + len(self.interpreters) + (1 if self.image is None else 0)

    def worker_budget(self) -> int:
        """The most workers across the image pools: ``max_workers``, else ``workers`` per
        pool (:meth:`pool_count`)."""
        if self.max_workers is not None:
            return self.max_workers
        return self.workers * self.pool_count()

    def pool_slots(self) -> int:
        """How many image pools run at once when that is fewer than :meth:`pool_count`
        (``max_workers``: pools are sized to the task mix, one worker at least), else 0:
        every pool fits (the heartbeat's ``pool_slots``, which placement reads)."""
        slots = self.worker_budget()
        return slots if slots < self.pool_count() else 0

    def _check_pools(self) -> None:
        if not self.pool_idle_s > 0:
            raise ConfigError(
                f"pool_idle_s must be a positive number of seconds an idle image pool is kept "
                f"(e.g. {DEFAULT_POOL_IDLE_S:g}), not {self.pool_idle_s}"
            )
        if not self.max_image_wait_s > 0:
            raise ConfigError(
                f"max_image_wait_s must be a positive number of seconds an image's tasks may "
                f"wait for warm pools' tasks (e.g. {DEFAULT_MAX_IMAGE_WAIT_S:g}), not "
                f"{self.max_image_wait_s}"
            )
        if self.max_workers is not None and self.max_workers < self.workers:
            raise ConfigError(
                f"max_workers ({self.max_workers}) is below workers ({self.workers}): the "
                f"default image's pool starts with `workers` workers, so set max_workers to "
                f"at least {self.workers} (pools are then sized to the task mix), or remove it "
                f"to allow {self.workers * self.pool_count()} (every image's pool at once)"
            )

    def allowed_images(self) -> dict[str, Image]:
        """The images this endpoint allows, by name; :class:`ConfigError` for a bad entry."""
        allowed: dict[str, Image] = {}
        for name, spec in self.images.items():
            try:
                allowed[name] = Image.parse(name, spec)
            except ContainerError as exc:
                raise ConfigError(f"images: {exc}") from None
        return allowed

    def worker_image(self) -> Image | None:
        """The image every worker runs in (None: ``runtime`` is ``process``);
        :class:`ConfigError` saying what to set when the settings disagree or the runtime
        cannot run here."""
        if self.runtime not in RUNTIMES:
            raise ConfigError(
                f"runtime {self.runtime!r} is unknown; choose one of {', '.join(RUNTIMES)}"
            )
        allowed = self.allowed_images()
        if self.image is not None and self.image not in allowed:
            raise ConfigError(
                f"image {self.image!r} is not among images ({', '.join(allowed) or 'none'}); "
                f"add it, e.g. images: {{{self.image}: '{self.runtime}:<reference>'}}"
            )
        if self.runtime == "process":
            if self.image is not None and allowed[self.image].runtime != "process":
                raise ConfigError(
                    f"image {self.image!r} is a {allowed[self.image].runtime} image but runtime "
                    f"is 'process': set runtime: {allowed[self.image].runtime}"
                )
            return None
        if self.image is None:
            raise ConfigError(
                f"runtime {self.runtime!r} needs the image its workers run in: add "
                f"images: {{worker: '{self.runtime}:<reference>'}} and image: worker "
                "(`fxstream-endpoint image` builds one)"
            )
        image = allowed[self.image]
        if image.runtime != self.runtime:
            raise ConfigError(
                f"image {self.image!r} is a {image.runtime} image ({image.spec}) but runtime "
                f"is {self.runtime!r}: set runtime: {image.runtime}, or choose a "
                f"{self.runtime} image"
            )
        return image

    def _check_runtimes(self) -> None:
        """Every allowed image's runtime must run here."""
        for image in self.allowed_images().values():
            problem = runtime_for(image.runtime).unavailable()
            if problem is not None:
                raise ConfigError(f"images: {image.name!r}: {problem}")

    def worker_paths(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Host paths the workers read and write besides their Python and sandbox:
        ``(readonly, writable)``: a rediss store's ``ca_file``; ``writable_dirs`` and a
        directory store's directory."""
        readonly: list[str] = []
        writable = list(self.writable_dirs)
        staging_root = self.staging_root()
        if staging_root is not None:
            # The workers run staged tasks in their directories there.
            staging_root.mkdir(parents=True, exist_ok=True, mode=0o700)
            writable.append(str(staging_root))
        if self.store_url is not None:
            options = StoreSpec.parse(self.store_url).options
            if "store_dir" in options:
                writable.append(str(options["store_dir"]))
            if "ca_file" in options:
                readonly.append(str(options["ca_file"]))
        return tuple(readonly), tuple(writable)

    def serializer_ids(self) -> frozenset[str]:
        """The data strategy ids ``allowed_serializers`` names (empty: any)."""
        data = [s for s in registered_strategies() if s.kind == "data"]
        by_name = {s.id: s.id for s in data} | {s.name.lower(): s.id for s in data}
        ids = set()
        for entry in self.allowed_serializers:
            found = by_name.get(str(entry).lower())
            if found is None:
                choices = ", ".join(f"{s.id} ({s.name})" for s in data)
                raise ConfigError(
                    f"allowed_serializers: {entry!r} is not a data strategy; choose from {choices}"
                )
            ids.add(found)
        return frozenset(ids)

    @property
    def credentials_path(self) -> Path:
        """The credentials file (``credentials_file`` resolved against the directory)."""
        path = Path(self.credentials_file).expanduser()
        return path if path.is_absolute() else self.directory / path

    def credentials(self) -> EndpointCredentials:
        """The endpoint's credential; :class:`ConfigError` saying what to do if unusable."""
        path = self.credentials_path
        try:
            credentials = EndpointCredentials.load(path)
        except CredentialFileError as exc:
            raise ConfigError(
                f"endpoint {self.name!r}: {exc} (run `fxstream-endpoint configure {self.name}` "
                "to write it)"
            ) from None
        if credentials.endpoint_id != self.endpoint_id:
            raise ConfigError(
                f"{path} is the credential of endpoint {credentials.endpoint_id}, not of "
                f"{self.endpoint_id} (this config's endpoint_id); point credentials_file at "
                f"this endpoint's credential or run `fxstream-endpoint configure {self.name}`"
            )
        return credentials

    @property
    def directory(self) -> Path:
        """This endpoint's directory."""
        return endpoint_dir(self.name)

    @property
    def path(self) -> Path:
        """The YAML file."""
        return self.directory / "config.yaml"

    def save(self) -> Path:
        """Write the YAML file atomically (0600, in the endpoint's 0700 directory)."""
        self.validate()
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.directory.chmod(0o700)
        settings = asdict(self)
        settings["allowed_functions"] = list(self.allowed_functions)
        settings["allowed_serializers"] = list(self.allowed_serializers)
        settings["writable_dirs"] = list(self.writable_dirs)
        settings["interpreters"] = list(self.interpreters)
        staging = settings.get("staging")
        if staging is not None:
            staging["roots"] = list(staging["roots"])
            if staging.get("globus") is not None:
                globus = staging["globus"]
                globus["allowed_collections"] = list(globus["allowed_collections"])
        write_secret_file(self.path, yaml.safe_dump(settings, sort_keys=False).encode())
        return self.path

    @classmethod
    def load(cls, name: str) -> EndpointConfig:
        """Read the endpoint called ``name``; a clear error if it is not configured."""
        path = endpoint_dir(name) / "config.yaml"
        if not path.is_file():
            raise ConfigError(
                f"endpoint {name!r} is not configured ({path} is missing): "
                f"run `fxstream-endpoint configure {name}` first"
            )
        try:
            raw: Any = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of settings")
        if set(raw) & _MOVED:
            raise ConfigError(
                f"{path} holds a token: an endpoint's config no longer holds its owner's "
                "token; the endpoint's own credential goes to its 0600 credentials file. "
                "Run `FXSTREAM_TOKEN=<owner token> fxstream-endpoint configure "
                f"{name} --endpoint-id {raw.get('endpoint_id', '<id>')} --service-url URL "
                "--bootstrap HOST:PORT` to rewrite both"
            )
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"{path}: unknown setting(s) {sorted(unknown)}")
        staging = raw.get("staging")
        if isinstance(staging, dict):
            unknown_staging = set(staging) - {f.name for f in fields(StagingSettings)}
            globus = staging.get("globus")
            if isinstance(globus, dict):
                unknown_staging |= {
                    f"globus.{name}"
                    for name in set(globus) - {f.name for f in fields(GlobusStaging)}
                }
            if unknown_staging:
                raise ConfigError(f"{path}: unknown staging setting(s) {sorted(unknown_staging)}")
        batch = raw.get("batch")
        if isinstance(batch, dict):
            unknown_batch = set(batch) - {f.name for f in fields(BatchSettings)}
            if unknown_batch:
                raise ConfigError(f"{path}: unknown batch setting(s) {sorted(unknown_batch)}")
            if batch.get("mpi") is not None:
                try:  # msgspec would drop unknown keys of the nested mapping silently
                    MpiSettings.from_mapping(batch["mpi"])
                except (BatchSettingsError, TypeError) as exc:
                    raise ConfigError(f"{path}: {exc}") from None
        missing = {f.name for f in fields(cls) if f.name in _REQUIRED} - set(raw)
        if missing:
            raise ConfigError(f"{path}: missing setting(s) {sorted(missing)}")
        try:
            config = msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        config.validate()
        return config


_REQUIRED = {"name", "endpoint_id", "service_url", "bootstrap_servers"}
# Settings of configs written before the endpoint had its own credentials file.
_MOVED = {"token"}
