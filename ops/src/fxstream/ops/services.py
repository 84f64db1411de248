"""The platform's Python services: the REST API, the stream processors and one local endpoint.

Each runs as its own process (started detached, tracked by PID like the
broker and Redis). ``start_services`` also makes sure a local user exists
(its credentials go to ``<home>/credentials.json``, mode 600, which the SDK
reads through ``FXSTREAM_CREDENTIALS``) and that the local endpoint is
configured under ``<home>/endpoints``.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from fxstream.ops.config import PlatformConfig
from fxstream.ops.process import ManagedProcess, ProcessStartError, ensure_port_free

__all__ = ["LOCAL_ENDPOINT", "ComponentStatus", "Credentials", "ServiceSet"]

LOCAL_ENDPOINT = "local"


@dataclass(frozen=True)
class ComponentStatus:
    """One process of the platform as seen by ``status``."""

    name: str
    address: str
    pid: int | None
    healthy: bool
    detail: str = ""


@dataclass(frozen=True)
class Credentials:
    """The local user and where everything is: what ``FXSTREAM_CREDENTIALS`` points at."""

    service_url: str
    bootstrap_servers: str
    topic_prefix: str
    user_id: str
    token: str
    store_url: str | None = None

    def save(self, path: Path) -> None:
        """Write the file readable by its owner only (it holds a token)."""
        path.write_text(json.dumps(self.__dict__, indent=2) + "\n")
        path.chmod(0o600)

    @classmethod
    def load(cls, path: Path) -> Credentials | None:
        """The saved credentials, or None if there are none."""
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))


def _bin(name: str) -> str:
    # The console scripts live beside the interpreter in the workspace's virtualenv.
    return str(Path(sys.executable).parent / name)


class ServiceSet:
    """The API, processors and local endpoint of one platform home."""

    def __init__(self, config: PlatformConfig) -> None:
        self.config = config
        self.service_url = f"http://127.0.0.1:{config.service_port}"
        logs = config.home / "logs"
        services = config.home / "services"
        connection = str(config.home / "platform.json")
        self.api = ManagedProcess(
            name="service api",
            argv=[
                _bin("fxstream-service"),
                "api",
                "--connection",
                connection,
                "--port",
                str(config.service_port),
            ],
            pid_file=services / "api.pid",
            log_file=logs / "service-api.log",
            die_with_parent=config.tie_to_caller,
        )
        self.processors = ManagedProcess(
            name="stream processors",
            argv=[_bin("fxstream-service"), "worker", "--connection", connection],
            pid_file=services / "processors.pid",
            log_file=logs / "service-processors.log",
            cwd=services,
            die_with_parent=config.tie_to_caller,
        )
        self.endpoint = ManagedProcess(
            name=f"endpoint {LOCAL_ENDPOINT}",
            argv=[_bin("fxstream-endpoint"), "start", LOCAL_ENDPOINT],
            pid_file=services / "endpoint.pid",
            log_file=logs / f"endpoint-{LOCAL_ENDPOINT}.log",
            env=self._endpoint_env(),
            die_with_parent=config.tie_to_caller,
        )

    @property
    def credentials_file(self) -> Path:
        """The local user's credentials (for the SDK)."""
        return self.config.home / "credentials.json"

    @property
    def endpoints_dir(self) -> Path:
        """Where the local endpoint's config lives."""
        return self.config.home / "endpoints"

    def processes(self) -> list[ManagedProcess]:
        """Every service process, in start order."""
        return [self.api, self.processors, self.endpoint]

    def _endpoint_env(self) -> dict[str, str]:
        return {**os.environ, "FXSTREAM_ENDPOINTS_DIR": str(self.config.home / "endpoints")}

    # --- start / stop ------------------------------------------------------------------

    def start(
        self, bootstrap_servers: str, topic_prefix: str, store_url: str | None = None
    ) -> tuple[Credentials, str]:
        """Start the API and processors, ensure the local user and endpoint, start the endpoint.

        ``store_url`` (the platform's Redis) becomes the proxy store of the local
        user's credentials and of the local endpoint. Returns the local user's
        credentials and the local endpoint's id.
        """
        self.config.home.joinpath("services").mkdir(parents=True, exist_ok=True)
        if not self.api.is_running():
            ensure_port_free(self.config.service_port, "FXSTREAM_SERVICE_PORT")
        self.api.start()
        self.processors.start()
        self._wait_for_api()
        credentials = self._ensure_user(bootstrap_servers, topic_prefix, store_url)
        endpoint_id = self._ensure_endpoint(credentials)
        self.endpoint.start()
        self._wait_for_endpoint(credentials, endpoint_id)
        return credentials, endpoint_id

    def stop(self, timeout_s: float = 60.0) -> list[str]:
        """Stop the endpoint (it finishes what it holds), then the processors and the API."""
        stopped = []
        for process in reversed(self.processes()):
            pid = process.pid()
            if pid is not None and process.stop(timeout_s):
                stopped.append(f"{process.name} (pid {pid})")
        return stopped

    def status(self, *, expected: bool) -> list[ComponentStatus]:
        """Each service process; once set up here, a stopped one is reported, not hidden."""
        configured = expected and self.credentials_file.is_file()
        found = []
        for process in self.processes():
            pid = process.pid()
            if pid is None and not configured:
                continue
            healthy = pid is not None
            address = ""
            if process is self.api:
                address = self.service_url
                healthy = healthy and self._api_answers()
            detail = "" if healthy else ("not running" if pid is None else "not answering")
            found.append(ComponentStatus(process.name, address, pid, healthy, detail))
        return found

    def _api_answers(self) -> bool:
        try:
            return httpx.get(f"{self.service_url}/v1/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    # --- readiness ---------------------------------------------------------------------

    def _wait_for_api(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.api.check_alive()
            self.processors.check_alive()
            if self._api_answers():
                return
            time.sleep(0.2)
        raise TimeoutError(f"the service API at {self.service_url} did not answer in time")

    def _wait_for_endpoint(
        self, credentials: Credentials, endpoint_id: str, timeout_s: float = 60.0
    ) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"{self.service_url}/v1/endpoints/{endpoint_id}"
        headers = {"Authorization": f"Bearer {credentials.token}"}
        while time.monotonic() < deadline:
            self.endpoint.check_alive()
            response = httpx.get(url, headers=headers, timeout=5)
            if response.status_code == 200 and response.json()["status"]["state"] == "online":
                return
            time.sleep(0.2)
        raise TimeoutError("the local endpoint did not come online in time")

    # --- the local user and endpoint ---------------------------------------------------

    def _ensure_user(
        self, bootstrap_servers: str, topic_prefix: str, store_url: str | None
    ) -> Credentials:
        saved = Credentials.load(self.credentials_file)
        if saved is not None and self._token_works(saved.token):
            if saved.store_url != store_url:
                saved = dataclasses.replace(saved, store_url=store_url)
                saved.save(self.credentials_file)
            return saved
        response = httpx.post(
            f"{self.service_url}/v1/users", json={"name": getpass.getuser()}, timeout=30
        )
        if response.status_code != 201:
            raise ProcessStartError(
                f"the service refused to create the local user: {response.text}"
            )
        body = response.json()
        credentials = Credentials(
            service_url=self.service_url,
            bootstrap_servers=bootstrap_servers,
            topic_prefix=topic_prefix,
            user_id=body["user_id"],
            token=body["token"],
            store_url=store_url,
        )
        credentials.save(self.credentials_file)
        return credentials

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

    def _ensure_endpoint(self, credentials: Credentials) -> str:
        config_file = self.endpoints_dir / LOCAL_ENDPOINT / "config.yaml"
        if (
            config_file.is_file()
            and _setting(config_file, "token") == credentials.token
            and _setting(config_file, "store_url") == credentials.store_url
        ):
            return _endpoint_id(config_file)
        store = [] if credentials.store_url is None else ["--store-url", credentials.store_url]
        if config_file.is_file() and _setting(config_file, "token") == credentials.token:
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
                credentials.bootstrap_servers,
                "--token",
                credentials.token,
                "--prefix",
                credentials.topic_prefix,
                *store,
            ],
            env=self._endpoint_env(),
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise ProcessStartError(f"cannot configure the local endpoint: {done.stdout}")
        return _endpoint_id(config_file)


def _setting(config_file: Path, name: str) -> object:
    return yaml.safe_load(config_file.read_text()).get(name)


def _endpoint_id(config_file: Path) -> str:
    endpoint_id = yaml.safe_load(config_file.read_text()).get("endpoint_id")
    if not isinstance(endpoint_id, str):
        raise ProcessStartError(f"{config_file} has no endpoint_id")
    return endpoint_id
