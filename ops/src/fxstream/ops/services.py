"""The platform's Python services: the REST API, the stream processors and one local endpoint.

Each runs as its own process under the platform's supervisor
(:mod:`fxstream.ops.supervisor`): the API, the router, the ingress, the task-state
processor, the liveness processor, the trigger processor, the dependencies processor,
the analytics processor and the local endpoint. Each
stream processor runs as many processes as the config says (``router_instances`` and the
like, 1 by default),
numbered from 0: the first is named for its role (``router``), the others ``router-1``,
``router-2``, ..., each started with ``--instance N`` (its own transactional id, one
member of its role's consumer group). The supervisor is
itself a process started detached and tracked by PID (like the broker and
Redis); it restarts a crashed child with backoff and records its restarts,
which ``status`` reports. ``start`` also makes sure a local user exists
(its credentials go to ``<home>/credentials.json``, created 0600, which the SDK
reads through ``FXSTREAM_CREDENTIALS``; they include the user's Kafka principal as
:meth:`~fxstream.topics.KafkaConnection.to_json` fields) and that the local endpoint is
configured under ``<home>/endpoints``.

Kafka credentials reach the processes as file paths, never secrets on a command line: the
API and the processors get ``FXSTREAM_KAFKA_CREDENTIALS=<home>/credentials/service.json``.
The router and the ingress also get ``FXSTREAM_ROUTING_KEYS=<home>/credentials/routing-keys.json``
(0600, made with one random 32-byte key at the first start and kept after: the router
stamps every dispatch with it and the ingress verifies every result and task event with
it; :mod:`fxstream.topics.routing_stamp`).
The local endpoint's agent connects as its own principal ``ep.<endpoint id>`` and fetches
code with its own API token, both issued when it is registered and kept in its 0600
``<home>/endpoints/local/credentials.json``: never the admin's or its owner's.
The platform admin's API token (the only one that creates users) is made at the first
start in ``<home>/credentials/api-admin.json`` (0600); the API gets the file's path.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from fxstream.ops.config import INSTANCE_SETTINGS, MAX_INSTANCES, PlatformConfig
from fxstream.ops.process import ManagedProcess, ProcessStartError, ensure_port_free, tail
from fxstream.ops.supervisor import (
    ChildSpec,
    SupervisedProcess,
    SupervisorSpec,
    read_metrics_port,
)
from fxstream.service.account_files import ADMIN_TOKEN_FILE_NAME, ensure_admin_token_file
from fxstream.service.accounts import AccountManager
from fxstream.service.task_expiry import RETENTION_ENV
from fxstream.topics import (
    ROUTING_KEYS_ENV,
    ROUTING_KEYS_FILE_NAME,
    Catalogue,
    CredentialFileError,
    KafkaConnection,
    ensure_routing_keys,
    read_secret_json,
    write_secret_file,
)
from fxstream.topics.acls import Role, username_for

__all__ = [
    "KAFKA_CREDENTIALS_ENV",
    "LOCAL_ENDPOINT",
    "ComponentStatus",
    "Credentials",
    "ServiceSet",
    "instance_name",
]

LOCAL_ENDPOINT = "local"
# Names the Kafka credentials file a service process or `fxstream-endpoint configure` reads.
KAFKA_CREDENTIALS_ENV = "FXSTREAM_KAFKA_CREDENTIALS"
# How often the start looks whether the API answers and the endpoint is online (each look
# is one local HTTP request: cheap, and every second of a start is spent waiting on them).
READY_POLL_S = 0.05
# The local agent's start-up: seconds on an idle machine, but a 2-core machine that
# starts a 3-node cluster beside other platforms was seen to need 108 s.
ENDPOINT_READY_S = 180.0


@dataclass(frozen=True)
class ComponentStatus:
    """One process of the platform as seen by ``status``."""

    name: str
    address: str
    pid: int | None
    healthy: bool
    detail: str = ""
    # Service processes only: how often the supervisor restarted it, and the last time.
    restarts: int = 0
    last_exit_code: int | None = None
    last_restart_at: float | None = None
    crash_looping: bool = False
    # Where its Prometheus metrics are served (docs/metrics.md), if anywhere.
    metrics_url: str = ""


@dataclass(frozen=True)
class Credentials:
    """The local user and where everything is: what ``FXSTREAM_CREDENTIALS`` points at.

    The file holds the SDK's credentials keys (:mod:`fxstream.sdk.settings`): the user's
    Kafka principal as :meth:`~fxstream.topics.KafkaConnection.to_json` fields
    (``bootstrap``, and on the secure platform ``kafka_username``, ``kafka_password``,
    ``kafka_ca_file``).
    """

    service_url: str
    kafka: KafkaConnection
    topic_prefix: str
    user_id: str
    token: str = field(repr=False)
    store_url: str | None = None

    def to_json(self) -> dict[str, str | None]:
        """The file's fields."""
        return {
            "service_url": self.service_url,
            **self.kafka.to_json(),
            "topic_prefix": self.topic_prefix,
            "user_id": self.user_id,
            "token": self.token,
            "store_url": self.store_url,
        }

    def save(self, path: Path) -> None:
        """Write the file readable by its owner only, atomically (it holds secrets)."""
        write_secret_file(path, (json.dumps(self.to_json(), indent=2) + "\n").encode())

    @classmethod
    def load(cls, path: Path) -> Credentials | None:
        """The saved credentials, or None if there are none (refused if others may read it)."""
        if not path.is_file():
            return None
        fields = read_secret_json(path)
        if "bootstrap_servers" in fields:  # the layout before the Kafka principal was in it
            fields["bootstrap"] = fields.pop("bootstrap_servers")
        return cls(
            service_url=fields["service_url"],
            kafka=KafkaConnection.from_json(fields, source=str(path)),
            topic_prefix=fields["topic_prefix"],
            user_id=fields["user_id"],
            token=fields["token"],
            store_url=fields.get("store_url"),
        )


def _bin(name: str) -> str:
    # The console scripts live beside the interpreter in the workspace's virtualenv.
    return str(Path(sys.executable).parent / name)


class ServiceSet:
    """The supervisor, API, processors and local endpoint of one platform home."""

    def __init__(self, config: PlatformConfig) -> None:
        self.config = config
        self.service_url = f"http://127.0.0.1:{config.service_port}"
        logs = config.home / "logs"
        self.state_dir = config.home / "services"
        self.spec_file = self.state_dir / "supervisor-spec.json"
        self.supervisor = ManagedProcess(
            name="supervisor",
            argv=[sys.executable, "-m", "fxstream.ops.supervisor", str(self.spec_file)],
            pid_file=self.state_dir / "supervisor.pid",
            log_file=logs / "supervisor.log",
            die_with_parent=config.tie_to_caller,
        )
        connection = str(config.home / "platform.json")
        self.admin_token_file = config.home / "credentials" / ADMIN_TOKEN_FILE_NAME
        worker = [_bin("fxstream-service"), "worker", "--connection", connection, "--only"]
        endpoints_env = {"FXSTREAM_ENDPOINTS_DIR": str(config.home / "endpoints")}
        # How long finished tasks stay in task-state: the task-state processor expires them,
        # the API says so in its 404 (docs/lifecycle.md, "Retention").
        retention = {RETENTION_ENV: str(config.task_retention_s)}
        service_env = {KAFKA_CREDENTIALS_ENV: str(self.service_credentials_file), **retention}
        # Only the router (stamps) and the ingress (verifies) are told where the keys are.
        keyed_env = {**service_env, ROUTING_KEYS_ENV: str(self.routing_keys_file)}
        # The API manages accounts (credentials, ACLs, topics): it acts as the admin.
        api_env = {KAFKA_CREDENTIALS_ENV: str(self.api_credentials_file), **retention}
        self._specs = [
            ChildSpec(
                name="service api",
                key="api",
                argv=[
                    _bin("fxstream-service"),
                    "api",
                    "--connection",
                    connection,
                    "--port",
                    str(config.service_port),
                    "--admin-token-file",
                    str(self.admin_token_file),
                ],
                log_file=str(logs / "service-api.log"),
                env=api_env,
            ),
            *(
                ChildSpec(
                    name=instance_name(role, n),
                    key=instance_name(role, n),
                    argv=[*worker, role, *(["--instance", str(n)] if n else [])],
                    log_file=str(logs / f"service-{instance_name(role, n)}.log"),
                    cwd=str(self.state_dir),
                    stop_wave=1,
                    env=keyed_env if role in ("router", "ingress") else service_env,
                    metrics=True,
                )
                for role in INSTANCE_SETTINGS
                for n in range(config.instances(role))
            ),
            ChildSpec(
                name=f"endpoint {LOCAL_ENDPOINT}",
                key="endpoint",
                argv=[_bin("fxstream-endpoint"), "start", LOCAL_ENDPOINT],
                log_file=str(logs / f"endpoint-{LOCAL_ENDPOINT}.log"),
                env=endpoints_env,
                stop_wave=2,
                metrics=True,
            ),
        ]
        running = self._running_specs()
        if running is not None:
            # A running supervisor runs the spec it was started with (the config may
            # have changed since): status and stop are about those processes.
            self._specs = running
        handles = {
            spec.key: SupervisedProcess(
                name=spec.name,
                key=spec.key,
                argv=spec.argv,
                log_file=Path(spec.log_file),
                state_dir=self.state_dir,
                supervisor=self.supervisor,
                env_overrides=dict(spec.env),
            )
            for spec in self._specs
        }
        self.api = handles["api"]
        self.endpoint = handles["endpoint"]
        # Per role, its processes in instance order (the first is named for the role).
        self.instances: dict[str, list[SupervisedProcess]] = {
            role: [
                handles[instance_name(role, n)]
                for n in range(MAX_INSTANCES)
                if instance_name(role, n) in handles
            ]
            for role in INSTANCE_SETTINGS
        }
        self.router = self.instances["router"][0]
        self.ingress = self.instances["ingress"][0]
        self.task_state = self.instances["task-state"][0]
        self.liveness = self.instances["liveness"][0]
        self.trigger = self.instances["trigger"][0]
        self.dependencies = self.instances["dependencies"][0]
        self.analytics = self.instances["analytics"][0]

    def _running_specs(self) -> list[ChildSpec] | None:
        """The children of the running supervisor's saved spec; None if none runs."""
        if self.supervisor.pid() is None or not self.spec_file.is_file():
            return None
        try:
            children = SupervisorSpec.load(self.spec_file).children
        except (OSError, ValueError, TypeError, KeyError):
            return None
        keys = {child.key for child in children}
        wanted = {"api", "endpoint", *INSTANCE_SETTINGS}
        return children if wanted <= keys else None

    @property
    def credentials_file(self) -> Path:
        """The local user's credentials (for the SDK)."""
        return self.config.home / "credentials.json"

    @property
    def service_credentials_file(self) -> Path:
        """The service processes' Kafka principal (written by the platform, 0600)."""
        return self.config.home / "credentials" / "service.json"

    @property
    def routing_keys_file(self) -> Path:
        """The router's and the ingress's routing keys (written by the platform, 0600)."""
        return self.config.home / "credentials" / ROUTING_KEYS_FILE_NAME

    @property
    def api_credentials_file(self) -> Path:
        """The REST API's Kafka principal: the admin, which makes accounts (0600)."""
        return self.config.home / "credentials" / "api.json"

    @property
    def endpoint_credentials_file(self) -> Path:
        """The local endpoint's own credential (0600): its API token and Kafka principal."""
        return self.endpoints_dir / LOCAL_ENDPOINT / "credentials.json"

    @property
    def endpoints_dir(self) -> Path:
        """Where the local endpoint's config lives."""
        return self.config.home / "endpoints"

    def processes(self) -> list[SupervisedProcess]:
        """Every supervised service process, in start order."""
        return [self.api, *self.processors(), self.endpoint]

    def processors(self) -> list[SupervisedProcess]:
        """The stream processors: every router, ingress, task-state, liveness, trigger,
        dependencies and analytics process."""
        return [process for role in INSTANCE_SETTINGS for process in self.instances[role]]

    def supervisor_spec(self) -> SupervisorSpec:
        """What the supervisor runs, with this platform's backoff settings."""
        return SupervisorSpec(
            state_dir=str(self.state_dir),
            children=self._specs,
            backoff_max_s=float(self.config.restart_backoff_max_s),
            stable_s=float(self.config.restart_stable_s),
        )

    def _endpoint_env(self) -> dict[str, str]:
        return {**os.environ, "FXSTREAM_ENDPOINTS_DIR": str(self.config.home / "endpoints")}

    # --- start / stop ------------------------------------------------------------------

    def start(
        self, kafka: KafkaConnection, topic_prefix: str, store_url: str | None = None
    ) -> tuple[Credentials, str]:
        """Start the API and processors, ensure the local user and endpoint, start the endpoint.

        ``kafka`` is the platform's admin connection: the API connects as that principal
        (it makes accounts), the processors as ``fxstream-service`` (made here, with the ACL
        table's rights); the local endpoint as its own principal ``ep.<id>``, issued when
        it is registered (the CA certificate is all it is given here); the local user's
        SDK as its own ``u.<user id>`` (from registration, in ``<home>/credentials.json``,
        0600).
        ``store_url`` (the platform's Redis) becomes the proxy store of the local
        user's credentials and of the local endpoint. Returns the local user's
        credentials and the local endpoint's id.
        """
        self.state_dir.mkdir(parents=True, exist_ok=True)
        admin_token = ensure_admin_token_file(self.admin_token_file)
        # Made once, then kept: a new key would refuse the results of tasks in flight.
        ensure_routing_keys(self.routing_keys_file)
        text = (json.dumps(kafka.to_json(), indent=2) + "\n").encode()
        write_secret_file(self.api_credentials_file, text)
        # The processors act as fxstream-service, with only the ACL table's rights; a new
        # password at every start (read again by any processor the supervisor restarts).
        service = kafka
        if kafka.secure:
            manager = AccountManager.connect(kafka, Catalogue(prefix=topic_prefix))
            service = manager.ensure_service_principal().connection(kafka)
        write_secret_file(
            self.service_credentials_file,
            (json.dumps(service.to_json(), indent=2) + "\n").encode(),
        )
        # Earlier platforms gave the local endpoint a copy of the admin's credential here.
        (self.config.home / "credentials" / f"endpoint-{LOCAL_ENDPOINT}.json").unlink(
            missing_ok=True
        )
        if not self.supervisor.is_running():
            if not self.api.is_running():
                ensure_port_free(self.config.service_port, "FXSTREAM_SERVICE_PORT")
            self.supervisor_spec().save(self.spec_file)
            for process in self.processes():
                process.hold_file.unlink(missing_ok=True)
            # The endpoint starts once its user and config exist (below).
            self.endpoint.hold_file.touch()
            self.supervisor.start()
        self._wait_for_api()
        credentials = self._ensure_user(kafka, topic_prefix, store_url, admin_token)
        endpoint_id = self._ensure_endpoint(credentials, kafka)
        self.endpoint.start()
        self._wait_for_endpoint(credentials, endpoint_id)
        return credentials, endpoint_id

    def stop(self, timeout_s: float = 60.0) -> list[str]:
        """Stop the supervisor by PID, which stops the endpoint (it finishes what it
        holds), then the processors, then the API, each by PID."""
        running = [(p, p.pid()) for p in reversed(self.processes())]
        stopped = [f"{p.name} (pid {pid})" for p, pid in running if pid is not None]
        pid = self.supervisor.pid()
        # Its children stop in three waves of at most timeout_s each.
        if pid is not None and self.supervisor.stop(3 * timeout_s + 10):
            stopped.append(f"supervisor (pid {pid})")
        # Children of a supervisor that died get SIGTERM from the kernel; anything
        # still alive is stopped here, by PID.
        for process, _ in running:
            if process.pid() is not None:
                process.stop(timeout_s)
        return stopped

    def status(self, *, expected: bool) -> list[ComponentStatus]:
        """The supervisor and each service process, with restarts; once set up here, a
        stopped one is reported, not hidden. A crash-looping process is unhealthy."""
        configured = expected and self.credentials_file.is_file()
        found = []
        supervisor_pid = self.supervisor.pid()
        if supervisor_pid is not None or configured:
            port = read_metrics_port(self.state_dir) if supervisor_pid is not None else None
            found.append(
                ComponentStatus(
                    "supervisor",
                    "",
                    supervisor_pid,
                    supervisor_pid is not None,
                    "" if supervisor_pid is not None else "not running",
                    metrics_url=_metrics_url(port),
                )
            )
        for process in self.processes():
            pid = process.pid()
            if pid is None and not configured:
                continue
            state = process.state()
            healthy = pid is not None
            address = ""
            metrics_url = _metrics_url(state.metrics_port if state and pid else None)
            if process is self.api:
                address = self.service_url
                healthy = healthy and self._api_answers()
                metrics_url = f"{self.service_url}/metrics" if pid else ""
            detail = "" if healthy else ("not running" if pid is None else "not answering")
            if state is not None and state.crash_looping:
                healthy = False
                detail = (
                    f"crash-looping: exited {state.exits_in_a_row} times in a row, last exit "
                    f"code {state.last_exit_code}; see {process.log_file}"
                )
            elif state is not None and pid is None and state.state == "backoff":
                detail = f"restarting in {state.next_start_in_s} s"
            found.append(
                ComponentStatus(
                    process.name,
                    address,
                    pid,
                    healthy,
                    detail,
                    restarts=state.restarts if state else 0,
                    last_exit_code=state.last_exit_code if state else None,
                    last_restart_at=state.last_restart_at if state else None,
                    crash_looping=state.crash_looping if state else False,
                    metrics_url=metrics_url,
                )
            )
        return found

    def metrics_urls(self) -> dict[str, str]:
        """Each running service process's metrics address (docs/metrics.md)."""
        return {c.name: c.metrics_url for c in self.status(expected=False) if c.metrics_url}

    def _api_answers(self) -> bool:
        try:
            return httpx.get(f"{self.service_url}/v1/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    # --- readiness ---------------------------------------------------------------------

    def _wait_for_api(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for process in (self.api, *self.processors()):
                process.check_alive()
            if self._api_answers():
                return
            time.sleep(READY_POLL_S)
        raise TimeoutError(f"the service API at {self.service_url} did not answer in time")

    def _wait_for_endpoint(
        self, credentials: Credentials, endpoint_id: str, timeout_s: float = ENDPOINT_READY_S
    ) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"{self.service_url}/v1/endpoints/{endpoint_id}"
        headers = {"Authorization": f"Bearer {credentials.token}"}
        while time.monotonic() < deadline:
            self.endpoint.check_alive()
            response = httpx.get(url, headers=headers, timeout=5)
            if response.status_code == 200 and response.json()["status"]["state"] == "online":
                return
            time.sleep(READY_POLL_S)
        raise TimeoutError(
            f"the local endpoint did not come online in {timeout_s:.0f} s; last lines of "
            f"{self.endpoint.log_file}:\n{tail(self.endpoint.log_file)}"
        )

    # --- the local user and endpoint ---------------------------------------------------

    def _ensure_user(
        self, kafka: KafkaConnection, topic_prefix: str, store_url: str | None, admin_token: str
    ) -> Credentials:
        saved = Credentials.load(self.credentials_file)
        if saved is not None and not self._token_works(saved.token):
            # Expired or revoked: the admin issues the same user a new token.
            saved = self._reissue(saved, admin_token)
        if saved is not None:
            # Rewritten every time: the store or the principal may have changed, and the file
            # may be of an older layout.
            own = _user_connection(kafka, topic_prefix, saved)
            updated = dataclasses.replace(saved, kafka=own, store_url=store_url)
            updated.save(self.credentials_file)
            return updated
        response = httpx.post(
            f"{self.service_url}/v1/users",
            json={"name": getpass.getuser()},
            headers={"Authorization": f"Bearer {admin_token}"},
            timeout=30,
        )
        if response.status_code != 201:
            raise ProcessStartError(
                f"the service refused to create the local user: {response.text}"
            )
        body = response.json()
        # The user's own principal (u.<user id>), shown only in this answer.
        own = kafka
        if kafka.secure and body.get("kafka_password"):
            own = kafka.as_user(body["kafka_username"], body["kafka_password"])
        credentials = Credentials(
            service_url=self.service_url,
            kafka=own,
            topic_prefix=topic_prefix,
            user_id=body["user_id"],
            token=body["token"],
            store_url=store_url,
        )
        credentials.save(self.credentials_file)
        return credentials

    def _reissue(self, saved: Credentials, admin_token: str) -> Credentials | None:
        response = httpx.post(
            f"{self.service_url}/v1/users/{saved.user_id}/token",
            headers={"Authorization": f"Bearer {admin_token}"},
            timeout=30,
        )
        if response.status_code != 200:
            return None  # the user is gone (a new platform): register a new one
        renewed = dataclasses.replace(saved, token=response.json()["token"])
        renewed.save(self.credentials_file)
        return renewed

    def _token_works(self, token: str) -> bool:
        response = httpx.get(
            f"{self.service_url}/v1/users/me",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
        return response.status_code == 200

    def local_endpoint_id(self) -> str | None:
        """The local endpoint's id, once configured."""
        config_file = self.endpoints_dir / LOCAL_ENDPOINT / "config.yaml"
        return _endpoint_id(config_file) if config_file.is_file() else None

    def _ensure_endpoint(self, credentials: Credentials, kafka: KafkaConnection) -> str:
        """Configure the local endpoint (registered by the local user) unless it is current.

        On the secure platform its agent connects as the endpoint's own principal
        ``ep.<id>``, which the service issued when it registered the endpoint (kept in the
        endpoint's credentials file); an endpoint configured without one (by an earlier
        platform, which gave it the admin's) is deleted and registered again.
        """
        config_file = self.endpoints_dir / LOCAL_ENDPOINT / "config.yaml"
        owned = config_file.is_file() and self._owns(credentials, _endpoint_id(config_file))
        if owned and kafka.secure and not self._has_own_principal(config_file):
            self._delete_endpoint(credentials, _endpoint_id(config_file))
            owned = False
        if (
            owned
            and _setting(config_file, "store_url") == credentials.store_url
            and self.endpoint_credentials_file.is_file()
            and _setting(config_file, "kafka_credentials") is None
            and _setting(config_file, "bootstrap_servers") == credentials.kafka.bootstrap
        ):
            return _endpoint_id(config_file)
        # The store URL holds the Redis password: it goes through the environment.
        env = self._endpoint_env()
        env.pop("FXSTREAM_STORE_URL", None)
        # No other principal's file: the agent connects as the endpoint's own.
        env.pop(KAFKA_CREDENTIALS_ENV, None)
        if credentials.store_url is not None:
            env["FXSTREAM_STORE_URL"] = credentials.store_url
        store: list[str] = []
        if owned:
            # Same owner, new settings: keep the registered endpoint.
            store += ["--endpoint-id", _endpoint_id(config_file)]
        done = subprocess.run(
            [
                _bin("fxstream-endpoint"),
                "configure",
                LOCAL_ENDPOINT,
                "--service-url",
                credentials.service_url,
                "--bootstrap",
                credentials.kafka.bootstrap,
                "--prefix",
                credentials.topic_prefix,
                *store,
            ],
            # The owner's token registers the endpoint; it goes through the environment
            # of this one command, never its command line or the endpoint's config (the
            # agent gets its own credential file, with the Kafka principal the service
            # issues the endpoint; only the CA certificate is given here). The store URL
            # (it holds the Redis password) goes through the environment too.
            env={
                **env,
                "FXSTREAM_TOKEN": credentials.token,
                **({"FXSTREAM_KAFKA_CA_FILE": str(kafka.ca_file)} if kafka.ca_file else {}),
            },
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise ProcessStartError(f"cannot configure the local endpoint: {done.stdout}")
        return _endpoint_id(config_file)

    def _has_own_principal(self, config_file: Path) -> bool:
        """True when the endpoint's credentials file names its own principal ``ep.<id>``."""
        try:
            fields = read_secret_json(self.endpoint_credentials_file)
        except CredentialFileError:
            return False
        expected = username_for(Role.ENDPOINT, _endpoint_id(config_file))
        return (
            _setting(config_file, "kafka_credentials") is None
            and fields.get("kafka_username") == expected
            and bool(fields.get("kafka_password"))
        )

    def _delete_endpoint(self, credentials: Credentials, endpoint_id: str) -> None:
        """Delete the local user's endpoint ``endpoint_id`` (its principal and topics too)."""
        response = httpx.delete(
            f"{self.service_url}/v1/endpoints/{endpoint_id}",
            headers={"Authorization": f"Bearer {credentials.token}"},
            timeout=30,
        )
        if response.status_code not in (204, 404):
            raise ProcessStartError(
                f"cannot replace the local endpoint {endpoint_id}, which has no Kafka "
                f"principal of its own: deleting it failed: {response.text}"
            )

    def _owns(self, credentials: Credentials, endpoint_id: str) -> bool:
        """True when the local user owns ``endpoint_id`` (its config is still current)."""
        response = httpx.get(
            f"{self.service_url}/v1/endpoints/{endpoint_id}",
            headers={"Authorization": f"Bearer {credentials.token}"},
            timeout=10,
        )
        return response.status_code == 200 and response.json().get("owner_id") == (
            credentials.user_id
        )


def _metrics_url(port: int | None) -> str:
    return f"http://127.0.0.1:{port}/metrics" if port else ""


def instance_name(role: str, instance: int) -> str:
    """The name (and supervisor key) of process ``instance`` of stream processor ``role``:
    the role itself for the first, ``<role>-<instance>`` for the others."""
    return role if instance == 0 else f"{role}-{instance}"


def _setting(config_file: Path, name: str) -> object:
    return yaml.safe_load(config_file.read_text()).get(name)


def _endpoint_id(config_file: Path) -> str:
    endpoint_id = yaml.safe_load(config_file.read_text()).get("endpoint_id")
    if not isinstance(endpoint_id, str):
        raise ProcessStartError(f"{config_file} has no endpoint_id")
    return endpoint_id


def _user_connection(
    kafka: KafkaConnection, topic_prefix: str, saved: Credentials
) -> KafkaConnection:
    """The saved user's own Kafka principal on ``kafka``'s brokers (never the admin's).

    A file that already names ``u.<user id>`` keeps its password; one of an older layout (the
    admin's principal, or an insecure platform's) gets the user's principal made again,
    with a new password, by the admin.
    """
    if not kafka.secure:
        return kafka
    username = username_for(Role.USER, saved.user_id)
    if saved.kafka.username == username and saved.kafka.password:
        return kafka.as_user(username, saved.kafka.password)
    manager = AccountManager.connect(kafka, Catalogue(prefix=topic_prefix))
    return manager.create_user_principal(saved.user_id).connection(kafka)
