"""Worker Python environments: each interpreter's version found by running it, the
environment a submission's Python version picks, and what is refused (and how it says so).

Real interpreters: the agent's own and this machine's pyenv Pythons (3.10, 3.12, 3.13, none
of them with fxstream installed). Nothing here needs a broker; the end to end refusal and
a task run by another Python's workers are in tests/containers/test_python_versions.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fxstream.agent.config import ConfigError, EndpointConfig
from fxstream.agent.credentials import EndpointCredentials
from fxstream.agent.python_envs import (
    PythonEnvironment,
    PythonEnvironmentError,
    PythonEnvironments,
    minor_of,
    probe_environments,
    probe_interpreter,
)
from fxstream.agent.runner import RUNNER
from tests.python_venvs import other_python

ENDPOINT_CLI = Path(sys.executable).parent / "fxstream-endpoint"
OWN = sys.version_info[:3]
OWN_MINOR = f"{OWN[0]}.{OWN[1]}"


def config(**settings: object) -> EndpointConfig:
    base: dict[str, object] = {
        "name": "lab",
        "endpoint_id": "ep-1",
        "service_url": "http://127.0.0.1:1",
        "bootstrap_servers": "127.0.0.1:1",
    }
    return EndpointConfig(**(base | settings))  # type: ignore[arg-type]


@pytest.fixture
def endpoints_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FXSTREAM_ENDPOINTS_DIR", str(tmp_path))
    return tmp_path


def test_the_agents_own_interpreter_reports_its_version_and_imports_the_worker() -> None:
    found = probe_interpreter(
        sys.executable, modules=("fxstream.agent.worker_process", "fxstream.agent.runner")
    )
    assert found.version == OWN
    assert os.path.realpath(sys.prefix) in found.paths


def test_other_interpreters_report_their_own_versions() -> None:
    for minor in ("3.10", "3.12", "3.13"):
        path = other_python(minor)
        found = probe_interpreter(path, modules=())  # the version only: no fxstream there
        assert f"{found.version[0]}.{found.version[1]}" == minor, path
        assert found.executable == path
        assert any(p.startswith(str(Path(path).parents[1])) for p in found.paths)


def test_an_interpreter_without_the_worker_stops_the_agent_at_start_saying_what_to_do(
    endpoints_dir: Path,
) -> None:
    bare = other_python("3.12")
    with pytest.raises(PythonEnvironmentError) as caught:
        probe_environments(config(interpreters=(bare,)), RUNNER)
    message = str(caught.value)
    assert f"interpreter {bare} (Python 3.12." in message
    assert "import fxstream.agent.worker_process failed: ModuleNotFoundError" in message
    assert f"{bare} -m venv DIR && DIR/bin/python -m pip install" in message
    assert "interpreters in" in message and "config.yaml" in message

    # Through `fxstream-endpoint start`: refused before it connects to anything.
    saved = config(interpreters=(bare,))
    saved.save()
    EndpointCredentials("ep-1", "ep-token").save(saved.credentials_path)
    env = {**os.environ, "FXSTREAM_ENDPOINTS_DIR": str(endpoints_dir)}
    done = subprocess.run(
        [str(ENDPOINT_CLI), "start", "lab"], env=env, capture_output=True, text=True, timeout=120
    )
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1, said
    assert "endpoint 'lab' cannot start" in said
    assert "import fxstream.agent.worker_process failed" in said
    assert "Traceback" not in said


def test_an_interpreter_too_old_for_the_workers_is_refused() -> None:
    old = other_python("3.10")
    with pytest.raises(PythonEnvironmentError, match=r"workers need Python 3\.11 or newer"):
        probe_interpreter(old)


def test_interpreters_in_the_config_are_checked(endpoints_dir: Path) -> None:
    with pytest.raises(ConfigError, match="not an absolute path"):
        config(interpreters=("python3.12",)).validate()
    with pytest.raises(ConfigError, match="not an executable file"):
        config(interpreters=(str(endpoints_dir / "python"),)).validate()
    py312 = other_python("3.12")
    with pytest.raises(ConfigError, match="listed twice"):
        config(interpreters=(py312, py312)).validate()
    # Each interpreter has a pool of its own in the worker budget.
    assert config(interpreters=(py312,)).worker_budget() == 2 * 2
    path = config(interpreters=(py312,)).save()
    assert EndpointConfig.load("lab").interpreters == (py312,)
    assert f"- {py312}" in path.read_text()


def environments() -> PythonEnvironments:
    """The agent's own Python (no container), an image 'gpu' of it, and the real 3.12 and
    3.13 interpreters, with the versions they report."""
    py312, py313 = other_python("3.12"), other_python("3.13")
    found = {path: probe_interpreter(path, modules=()) for path in (py312, py313)}
    return PythonEnvironments(
        [
            PythonEnvironment(pool=None, image=None, interpreter=None, version=OWN),
            PythonEnvironment(pool="gpu", image="gpu", interpreter=None, version=OWN),
            *(
                PythonEnvironment(pool=p, image=None, interpreter=p, version=i.version)
                for p, i in found.items()
            ),
        ],
        interpreters=found,
        endpoint="endpoint 'lab' (ep-1)",
        config_path="/srv/lab/config.yaml",
    )


def test_a_submission_runs_in_the_environment_of_its_python_version() -> None:
    pythons = environments()
    py312, py313 = other_python("3.12"), other_python("3.13")
    assert pythons.versions() == sorted([OWN_MINOR, "3.12", "3.13"])
    # The default environment first; a patch release of the same minor is the same.
    assert pythons.environment_for("f", f"{OWN_MINOR}.99", None) == (None, None)
    assert pythons.environment_for("f", "3.12.7", None) == (py312, None)
    assert pythons.environment_for("f", "3.13.0rc1", None) == (py313, None)
    # A function registered with a container runs in it, of the version it has.
    assert pythons.environment_for("f", f"{OWN_MINOR}.0", "gpu") == ("gpu", None)
    # A client that names no version runs where it did before: the default.
    assert pythons.environment_for("f", "", None) == (None, None)


def test_a_version_no_environment_runs_is_refused_naming_both_and_what_to_do() -> None:
    pythons = environments()
    py312 = other_python("3.12")
    version312 = ".".join(map(str, probe_interpreter(py312, modules=()).version))
    pool, refusal = pythons.environment_for("f-1", "3.10.13", None)
    assert pool is None and refusal is not None
    runs = " and ".join(sorted([OWN_MINOR, "3.12", "3.13"]))
    assert refusal.startswith(
        "function f-1 was serialized by Python 3.10.13 (the submitting client's) and endpoint "
        f"'lab' (ep-1) runs Python {runs} for functions without a container"
    )
    assert f"Python {'.'.join(map(str, OWN))} (the agent's own interpreter)" in refusal
    assert f"Python {version312} ({py312})" in refusal
    assert "refused before it ran" in refusal
    assert f"submit from Python {' or '.join(sorted([OWN_MINOR, '3.12', '3.13']))}" in refusal
    # fxstream's workers need 3.11 or newer: no interpreter of 3.10 is suggested.
    assert "interpreter" not in refusal.partition("To run it")[2]

    pool, refusal = pythons.environment_for("f-1", "3.14.0", None)
    assert pool is None and refusal is not None
    assert "adds a Python 3.14 interpreter to interpreters in /srv/lab/config.yaml" in refusal
    assert "python3.14 -m venv DIR && DIR/bin/python -m pip install -e " in refusal

    # In a function's container: only that image's version runs it.
    pool, refusal = pythons.environment_for("f-2", "3.12.1", "gpu")
    assert pool is None and refusal is not None
    assert f"and endpoint 'lab' (ep-1) runs Python {OWN_MINOR} in image 'gpu'" in refusal
    assert f"submit from Python {OWN_MINOR}" in refusal
    assert "register the function without a container" in refusal


def test_an_image_of_unknown_version_is_not_refused_for_it() -> None:
    pythons = PythonEnvironments(
        [
            PythonEnvironment(pool=None, image="worker", interpreter=None, version=None),
        ],
        default_image="worker",
    )
    assert pythons.versions() == []
    assert pythons.environment_for("f", "3.12.1", None) == (None, None)


def test_minor_of() -> None:
    assert minor_of("3.12.1") == (3, 12)
    assert minor_of("3.13.0rc1") == (3, 13)
    assert minor_of("PyPy") is None
