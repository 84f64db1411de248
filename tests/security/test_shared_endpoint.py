"""A shared endpoint runs only what its owner allows, and keeps its secrets from the tasks.

Real broker, service and agent processes (the private platform of tests/e2e/stack.py).
The "shared" endpoint allows three functions and JSON arguments only. Refusals must come
before anything of the task is deserialized: the payloads below create a marker file when
they are unpickled, and each refusal test first shows, on the platform's open local
endpoint, that the same payload does create its marker there (so the check can fail).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pickle
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fxstream.agent.config import EndpointConfig
from fxstream.agent.credentials import EndpointCredentials
from fxstream.ops.private import ExtraEndpoint
from fxstream.sdk import Client, TaskExecutionFailed
from fxstream.topics import Serializer
from tests.e2e.stack import Stack, added_endpoint

pytestmark = pytest.mark.platform

RESULT_S = 60.0
# Put in the agent's environment at its start: neither it nor its workers may keep them.
PLANTED = {"FXSTREAM_TOKEN": "planted-owner-token-5c1e", "LAB_API_KEY": "planted-key-9d2b"}


class Marker:
    """Unpickling this creates the file ``path`` (a stand-in for any code a pickle runs)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def add(a: int, b: int) -> int:
    return a + b


def environment() -> dict[str, str]:
    return dict(os.environ)


def snoop() -> dict[str, Any]:
    """What a task can see of the agent that started its worker, and of its own call."""
    import sys

    seen: dict[str, Any] = {"ppid": os.getppid(), "cmdline": Path("/proc/self/cmdline").read_text()}
    for what in ("environ", "mem"):
        try:
            with open(f"/proc/{os.getppid()}/{what}", "rb"):
                seen[what] = "opened"
        except OSError as exc:
            seen[what] = type(exc).__name__
    frames = []
    frame: Any = sys._getframe(1)
    while frame is not None:
        for value in frame.f_locals.values():
            try:
                frames.append(repr(value)[:20_000])
            except Exception:
                continue
        frame = frame.f_back
    seen["stack"] = "\n".join(frames)[:500_000]
    return seen


def code_that_marks(path: Path) -> bytes:
    """A code payload ("dc") whose loading creates ``path``."""
    return b"fxdc\n" + pickle.dumps(Marker(path), protocol=5)


@dataclass
class Shared:
    endpoint: ExtraEndpoint
    config: EndpointConfig
    credentials: EndpointCredentials
    credentials_path: Path
    kafka_password: str | None
    add: str
    environment: str
    snoop: str
    evil: str
    owner_token: str


@pytest.fixture(scope="module")
def stack(shared_platform: Stack) -> Stack:
    """The session's shared platform (tests/conftest.py): this module only uses it."""
    return shared_platform


@pytest.fixture(scope="module")
def markers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("markers")


@pytest.fixture(scope="module")
def shared(stack: Stack, markers: Path) -> Iterator[Shared]:
    with stack.client() as owner:
        ids = {fn.__name__: owner.register_function(fn) for fn in (add, environment, snoop)}
        evil = owner.register_code(code_that_marks(markers / "code-unused"), name="evil")
    with contextlib.ExitStack() as stopped_after_the_module:
        with pytest.MonkeyPatch.context() as planted:
            for name, value in PLANTED.items():
                planted.setenv(name, value)
            endpoint = stopped_after_the_module.enter_context(
                added_endpoint(
                    stack,
                    "shared",
                    store_url=None,
                    allowed_functions=list(ids.values()),
                    allowed_serializers=["json"],
                )
            )
        with pytest.MonkeyPatch.context() as env:
            env.setenv("FXSTREAM_ENDPOINTS_DIR", str(stack.home / "extra-endpoints"))
            config = EndpointConfig.load(endpoint.name)
            credentials, credentials_path = config.credentials(), config.credentials_path
            kafka_password = config.kafka(credentials).password
            assert config.directory == stack.home / "extra-endpoints" / endpoint.name
        token = stack.settings.token
        assert token is not None
        yield Shared(
            endpoint,
            config,
            credentials,
            credentials_path,
            kafka_password,
            ids["add"],
            ids["environment"],
            ids["snoop"],
            evil,
            token,
        )


def json_client(stack: Stack) -> Client:
    return Client.from_settings(stack.settings, serializer=Serializer(data="js"))


def result(client: Client, task_id: str) -> Any:
    return client.future(task_id).result(timeout=RESULT_S)


def refusal(client: Client, task_id: str) -> TaskExecutionFailed:
    with pytest.raises(TaskExecutionFailed) as caught:
        result(client, task_id)
    assert caught.value.remote_type == "NotAllowedOnEndpoint", caught.value
    assert not caught.value.retryable
    return caught.value


def test_a_function_not_allowed_is_refused_before_anything_is_deserialized(
    stack: Stack, shared: Shared, markers: Path
) -> None:
    # Control: on the open local endpoint the same code runs its pickle as it loads (and
    # fails, holding no function, before the arguments load: the next test controls those).
    with stack.client() as owner:
        control_code = markers / "control-code"
        evil_here = owner.register_code(code_that_marks(control_code), name="evil")
        task = owner.run(endpoint_id=stack.endpoint_id, function_id=evil_here)
        with pytest.raises(TaskExecutionFailed):
            result(owner, task)
    assert control_code.exists()

    code_marker, args_marker = markers / "shared-code", markers / "shared-args"
    with stack.client() as owner:
        evil_there = owner.register_code(code_that_marks(code_marker), name="evil")
        task = owner.run(
            Marker(args_marker), endpoint_id=shared.endpoint.endpoint_id, function_id=evil_there
        )
        refused = refusal(owner, task)
    assert f"function {evil_there} is not one of them" in refused.remote_message
    assert "allowed_functions in the endpoint's config.yaml" in refused.remote_message
    assert shared.add in refused.remote_message
    assert not code_marker.exists() and not args_marker.exists()


def test_pickled_arguments_to_a_json_only_endpoint_are_refused_json_ones_run(
    stack: Stack, shared: Shared, markers: Path
) -> None:
    control = markers / "control-pickled-arg"
    with stack.client() as owner:
        add_here = owner.register_function(add)
        task = owner.run(Marker(control), 1, endpoint_id=stack.endpoint_id, function_id=add_here)
        with pytest.raises(TaskExecutionFailed):
            result(owner, task)  # the marker's Path + 1 fails, after it was unpickled
    assert control.exists()

    marker = markers / "shared-pickled-arg"
    with stack.client() as owner:  # the default data strategy: dill
        task = owner.run(
            Marker(marker), 1, endpoint_id=shared.endpoint.endpoint_id, function_id=shared.add
        )
        refused = refusal(owner, task)
        plain = owner.run(2, 3, endpoint_id=shared.endpoint.endpoint_id, function_id=shared.add)
        refusal(owner, plain)  # dill even for plain ints: refused
    assert "JSON (js) only" in refused.remote_message
    assert "dill (dl)" in refused.remote_message
    assert "Serializer(data='js')" in refused.remote_message
    assert not marker.exists()
    with json_client(stack) as client:
        task = client.run(2, 3, endpoint_id=shared.endpoint.endpoint_id, function_id=shared.add)
        assert result(client, task) == 5


def test_the_agents_credentials_are_private(stack: Stack, shared: Shared) -> None:
    credentials, path = shared.credentials, shared.credentials_path
    assert credentials.endpoint_id == shared.endpoint.endpoint_id
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    text = (path.parent / "config.yaml").read_text()
    assert shared.owner_token not in text and credentials.token not in text

    pid = shared.endpoint.process.pid()
    assert pid is not None
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    secrets = [shared.owner_token, credentials.token, *PLANTED.values()]
    if shared.kafka_password:
        secrets.append(shared.kafka_password)
    assert not [s for s in secrets if s in cmdline]
    if os.geteuid() == 0:
        # Root reads any process's environment (CAP_SYS_PTRACE): it shows the agent was
        # started again without the planted variables (/proc shows the exec-time one).
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        assert "PATH=" in environ
        assert not [s for s in secrets if s in environ]
        assert not set(PLANTED) & {line.split("=")[0] for line in environ.split("\0")}
    else:
        # Non-dumpable: its owner's other processes read neither its environment nor memory.
        with pytest.raises(PermissionError):
            Path(f"/proc/{pid}/environ").read_bytes()


def test_protect_memory_makes_a_process_non_dumpable() -> None:
    # PR_GET_DUMPABLE (3) in a process that called protect_memory: 0, no longer dumpable.
    script = (
        "import ctypes; from fxstream.agent.environment import protect_memory; "
        "assert protect_memory(); print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


def test_a_task_finds_no_secret_in_its_environment_or_its_agent(
    stack: Stack, shared: Shared
) -> None:
    credentials = shared.credentials
    secrets = [shared.owner_token, credentials.token, *PLANTED.values()]
    if shared.kafka_password:
        secrets.append(shared.kafka_password)
    with json_client(stack) as client:
        endpoint = shared.endpoint.endpoint_id
        env = result(client, client.run(endpoint_id=endpoint, function_id=shared.environment))
        seen = result(client, client.run(endpoint_id=endpoint, function_id=shared.snoop))
    assert isinstance(env, dict) and "PATH" in env  # the worker's real environment
    assert not set(PLANTED) & set(env)
    assert not [name for name in env if "TOKEN" in name or "CREDENTIAL" in name]
    assert not [s for s in secrets if s in "\n".join(env.values())]
    assert seen["ppid"] == shared.endpoint.process.pid()
    assert not [s for s in secrets if s in seen["cmdline"]]
    if os.geteuid() != 0:
        # The agent is non-dumpable: a task of the same (non-root) user cannot open them.
        # (Root, as in some CI containers, opens any process's: see the test above.)
        assert seen["environ"] == "PermissionError"
        assert seen["mem"] == "PermissionError"


def test_a_task_finds_no_token_on_its_workers_stack(stack: Stack, shared: Shared) -> None:
    with json_client(stack) as client:
        seen = result(
            client,
            client.run(endpoint_id=shared.endpoint.endpoint_id, function_id=shared.snoop),
        )
    assert "TaskSubmission(" in seen["stack"]  # it did see the record it was called with
    assert shared.owner_token not in seen["stack"]
