"""Endpoint config files and the fxstream-endpoint CLI's handling of bad set-ups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import Consumer

from fxstream.agent.config import KAFKA_DEBUG_CONTEXTS, ConfigError, EndpointConfig
from fxstream.agent.credentials import EndpointCredentials
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
    }
    values.update(changes)
    return EndpointConfig(**values)  # type: ignore[arg-type]


def test_save_and_load_round_trip_private_file(endpoints_dir: Path) -> None:
    config = _config(workers=3, allowed_functions=("f-1",), allowed_serializers=("json",))
    path = config.save()
    assert path == endpoints_dir / "laptop" / "config.yaml"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert EndpointConfig.load("laptop") == config
    assert config.serializer_ids() == {"js"}


def test_a_config_holding_a_token_is_refused_saying_how_to_move_it(endpoints_dir: Path) -> None:
    path = _config().save()
    path.write_text(path.read_text() + "token: owner-secret\n")
    with pytest.raises(ConfigError, match="FXSTREAM_TOKEN=<owner token> fxstream-endpoint"):
        EndpointConfig.load("laptop")


def test_unknown_serializer_names_the_choices(endpoints_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"js \(JSON\)"):
        _config(allowed_serializers=("yaml",)).save()


def test_credentials_file_is_private_and_checked(endpoints_dir: Path) -> None:
    config = _config()
    credentials = EndpointCredentials("ep-1", "ep-token")
    credentials.save(config.credentials_path)
    assert oct(config.credentials_path.stat().st_mode & 0o777) == "0o600"
    assert "ep-token" not in repr(credentials)
    assert config.credentials() == credentials
    config.credentials_path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        config.credentials()
    config.credentials_path.chmod(0o600)
    with pytest.raises(ConfigError, match="credential of endpoint ep-1, not of ep-2"):
        _config(endpoint_id="ep-2").credentials()


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
        ({"engine": "slurm"}, "is not available: 'process'"),
        ({"name": "bad name"}, "not usable"),
        (
            {"kafka_debug": "cgrp,bogus"},
            r"kafka_debug: unknown librdkafka debug context\(s\) \['bogus'\]",
        ),
    ],
)
def test_invalid_values_are_refused(
    endpoints_dir: Path, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(**changes).save()


def test_every_debug_context_the_config_offers_is_one_librdkafka_takes(
    endpoints_dir: Path,
) -> None:
    """The contexts the kafka_debug error lists (its remedy) are all accepted by the
    consumer the agent builds from them."""
    offered = ",".join(KAFKA_DEBUG_CONTEXTS)
    _config(kafka_debug=offered).save()
    Consumer({"group.id": "g", "debug": offered, "log_level": 0}).close()


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
        "--endpoint-id",
        "ep-lab",
        "--workers",
        "4",
        "--max-image-wait",
        "12.5",
    ]
    owner = "owner-secret-7f3a"
    done = subprocess.run(
        args, env={**env, "FXSTREAM_TOKEN": owner}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    config = EndpointConfig.load("lab")
    assert config.workers == 4
    assert config.max_image_wait_s == 12.5
    assert owner not in config.path.read_text()
    # The service issued no endpoint token (it runs nowhere here): the owner's is kept in
    # the 0600 credentials file, said loudly.
    assert "no API token of its own" in done.stdout
    assert config.credentials().token == owner
    assert oct(config.credentials_path.stat().st_mode & 0o777) == "0o600"
    listed = subprocess.run(
        [str(ENDPOINT_CLI), "list"], env=env, capture_output=True, text=True, timeout=60
    )
    assert "ep-lab" in listed.stdout
    assert "stopped" in listed.stdout


def test_cli_configure_without_a_reachable_service_fails_clearly(endpoints_dir: Path) -> None:
    env = {**os.environ, "FXSTREAM_ENDPOINTS_DIR": str(endpoints_dir)}
    args = [str(ENDPOINT_CLI), "configure", "lab", "--service-url", "http://127.0.0.1:9"]
    args += ["--bootstrap", "127.0.0.1:9"]
    done = subprocess.run(
        args, env={**env, "FXSTREAM_TOKEN": "t"}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "cannot configure endpoint 'lab'" in done.stdout


def test_cli_takes_no_token_on_the_command_line(endpoints_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FXSTREAM_TOKEN"}
    env["FXSTREAM_ENDPOINTS_DIR"] = str(endpoints_dir)
    args = [str(ENDPOINT_CLI), "configure", "lab", "--service-url", "http://127.0.0.1:9"]
    args += ["--bootstrap", "127.0.0.1:9"]
    done = subprocess.run([*args, "--token", "t"], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "No such option" in done.stdout + done.stderr
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "set FXSTREAM_TOKEN (never on the command line)" in done.stdout


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
    args += ["--bootstrap", "127.0.0.1:9", "--endpoint-id", "ep-lab"]
    done = subprocess.run(
        args, env={**env, "FXSTREAM_TOKEN": "t"}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    config = EndpointConfig.load("lab")
    assert config.kafka_credentials == str(credentials)
    assert "s3cret-password" not in config.path.read_text()
    assert config.kafka().username == "ep.ep-1"


def test_a_principal_issued_to_the_endpoint_is_kept_in_its_credential(
    endpoints_dir: Path, tmp_path: Path
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("only the path matters here\n")
    config = _config()
    issued = EndpointCredentials(
        "ep-1", "ep-token", KafkaConnection("127.0.0.1:1", "ep.ep-1", "issued-password", ca)
    )
    issued.save(config.credentials_path)
    config.save()
    assert "issued-password" not in config.path.read_text()
    kafka = EndpointConfig.load("laptop").kafka()
    assert (kafka.username, kafka.password, kafka.bootstrap) == (
        "ep.ep-1",
        "issued-password",
        "127.0.0.1:1",
    )
