"""The running platform an end-to-end module shares: started as `./fx up` starts it.

Broker, Redis, the service API, the stream processors and the local endpoint, each
its own process in a private home on free ports; stopped by PID at the end.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fxstream.ops import Platform
from fxstream.sdk import Client, ClientSettings, Executor, NotFound
from tests.conftest import private_config


@dataclass
class Stack:
    """A running platform and how to reach it as its local user."""

    platform: Platform
    bootstrap: str
    prefix: str
    credentials: Path
    endpoint_id: str

    @property
    def settings(self) -> ClientSettings:
        """The local user's client settings."""
        return ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(self.credentials)})

    def client(self) -> Client:
        """A client of the local user (the caller closes it)."""
        return Client.from_settings(self.settings)

    @contextmanager
    def executor(self) -> Iterator[Executor]:
        """An executor on the local endpoint whose client is closed with it."""
        client = self.client()
        try:
            with Executor(endpoint_id=self.endpoint_id, client=client) as executor:
                yield executor
        finally:
            client.close()


def running_stack(home: Path) -> Iterator[Stack]:
    """Start a platform with its services in ``home``, yield it, stop it (for a fixture)."""
    platform = Platform(private_config(home))
    try:
        connection = platform.up(services=True)
        services = platform.services()
        endpoint_id = services.local_endpoint_id()
        assert endpoint_id is not None
        yield Stack(
            platform,
            connection.bootstrap_servers,
            connection.topic_prefix,
            services.credentials_file,
            endpoint_id,
        )
    finally:
        platform.down()


def wait_for_state(client: Client, task_id: str, state: str, *, timeout_s: float = 30.0) -> None:
    """Wait until the service shows ``task_id`` in ``state``.

    ``NotFound`` is expected at first: a future can resolve (the SDK reads the results
    topic itself) before the task-state processor has folded the task at all.
    """
    deadline = time.monotonic() + timeout_s
    seen = "not yet known to the service"
    while True:
        with contextlib.suppress(NotFound):
            seen = client.get_task(task_id)["state"]
            if seen == state:
                return
        assert time.monotonic() < deadline, f"task {task_id} never showed {state}; last: {seen}"
        time.sleep(0.2)
