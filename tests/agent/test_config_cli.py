"""Endpoint config files and the fxstream-endpoint CLI's handling of bad set-ups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fxstream.agent.config import ConfigError, EndpointConfig
from fxstream.topics import KafkaConnection, write_secret_file

ENDPOINT_CLI = Path(sys.executable).parent / "fxstream-endpoint"


@pytest.fixture
def endpoints_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FXSTREAM_ENDPOINTS_DIR", str(tmp_path))
    return tmp_path


def _config(**changes: object) -> EndpointConfig:
    values: dict[str, object] = {
        "name": "laptop",
        "endpoint_id": "ep-1",
        "service_url": "http://127.0.0.1:1",
        "bootstrap_servers": "127.0.0.1:1",
        "token": "secret",
    }
    values.update(changes)
    return EndpointConfig(**values)  # type: ignore[arg-type]


def test_save_and_load_round_trip_private_file(endpoints_dir: Path) -> None:
    path = _config(workers=3).save()
    assert path == endpoints_dir / "laptop" / "config.yaml"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert EndpointConfig.load("laptop") == _config(workers=3)


def test_unconfigured_endpoint_says_how_to_configure(endpoints_dir: Path) -> None:
    with pytest.raises(ConfigError, match="fxstream-endpoint configure nope"):
        EndpointConfig.load("nope")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("workers: many\n", r"\$\.workers"),
        ("colour: blue\n", "unknown setting"),
        ("- a list\n", "mapping"),
        (": : :\n", "not valid YAML"),
    ],
)
def test_bad_files_name_the_problem(endpoints_dir: Path, text: str, message: str) -> None:
    path = _config().save()
    base = path.read_text() if "workers" in text or "colour" in text else ""
    path.write_text(base + text)
    with pytest.raises(ConfigError, match=message):
        EndpointConfig.load("laptop")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"workers": 0}, "workers"),
        ({"engine": "slurm"}, "only 'process'"),
        ({"name": "bad name"}, "not usable"),
    ],
)
def test_invalid_values_are_refused(
    endpoints_dir: Path, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(**changes).save()


def test_cli_start_of_unconfigured_endpoint_says_why(endpoints_dir: Path) -> None:
    env = {**os.environ, "FXSTREAM_ENDPOINTS_DIR": str(endpoints_dir)}
    done = subprocess.run(
        [str(ENDPOINT_CLI), "start", "ghost"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "fxstream-endpoint configure ghost" in done.stdout


def test_cli_configure_with_an_id_and_list(endpoints_dir: Path) -> None:
    env = {**os.environ, "FXSTREAM_ENDPOINTS_DIR": str(endpoints_dir)}
    args = [
        str(ENDPOINT_CLI),
        "configure",
        "lab",
        "--service-url",
        "http://127.0.0.1:9",
        "--bootstrap",
        "127.0.0.1:9",
        "--token",
        "t",
        "--endpoint-id",
        "ep-lab",
        "--workers",
        "4",
    ]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert EndpointConfig.load("lab").workers == 4
    listed = subprocess.run(
        [str(ENDPOINT_CLI), "list"], env=env, capture_output=True, text=True, timeout=60
    )
    assert "ep-lab" in listed.stdout
    assert "stopped" in listed.stdout


def test_cli_configure_without_a_reachable_service_fails_clearly(endpoints_dir: Path) -> None:
    env = {**os.environ, "FXSTREAM_ENDPOINTS_DIR": str(endpoints_dir)}
    args = [str(ENDPOINT_CLI), "configure", "lab", "--service-url", "http://127.0.0.1:9"]
    args += ["--bootstrap", "127.0.0.1:9", "--token", "t"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "cannot configure endpoint 'lab'" in done.stdout


def _secure_credentials(directory: Path) -> Path:
    """An endpoint principal's credentials file, 0600, as the service hands it out."""
    ca = directory / "ca.pem"
    ca.write_text("not parsed here: only the path goes to the Kafka client\n")
    kafka = KafkaConnection("127.0.0.1:9", "ep.ep-1", "s3cret-password", ca)
    path = directory / "kafka.json"
    write_secret_file(path, json.dumps(kafka.to_json()).encode())
    return path


def test_the_agent_connects_as_the_principal_of_its_credentials_file(
    endpoints_dir: Path, tmp_path: Path
) -> None:
    credentials = _secure_credentials(tmp_path)
    path = _config(kafka_credentials=str(credentials)).save()
    assert "s3cret-password" not in path.read_text()  # the config names the file only
    kafka = EndpointConfig.load("laptop").kafka()
    assert kafka.bootstrap == "127.0.0.1:1"  # the config's brokers
    settings = kafka.confluent()
    assert settings["security.protocol"] == "SASL_SSL"
    assert settings["sasl.username"] == "ep.ep-1"
    assert settings["sasl.password"] == "s3cret-password"
    assert _config().kafka() == KafkaConnection("127.0.0.1:1")  # insecure platform only


def test_a_credentials_file_others_can_read_is_refused(endpoints_dir: Path, tmp_path: Path) -> None:
    credentials = _secure_credentials(tmp_path)
    credentials.chmod(0o640)
    with pytest.raises(ConfigError, match=f"chmod 600 {credentials}"):
        _config(kafka_credentials=str(credentials)).save()
    with pytest.raises(ConfigError, match="no credentials file"):
        _config(kafka_credentials=str(tmp_path / "nowhere.json")).save()


def test_cli_configure_records_the_credentials_file_not_the_secret(
    endpoints_dir: Path, tmp_path: Path
) -> None:
    credentials = _secure_credentials(tmp_path)
    env = {
        **os.environ,
        "FXSTREAM_ENDPOINTS_DIR": str(endpoints_dir),
        "FXSTREAM_KAFKA_CREDENTIALS": str(credentials),
    }
    args = [str(ENDPOINT_CLI), "configure", "lab", "--service-url", "http://127.0.0.1:9"]
    args += ["--bootstrap", "127.0.0.1:9", "--token", "t", "--endpoint-id", "ep-lab"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    config = EndpointConfig.load("lab")
    assert config.kafka_credentials == str(credentials)
    assert "s3cret-password" not in config.path.read_text()
    assert config.kafka().username == "ep.ep-1"
