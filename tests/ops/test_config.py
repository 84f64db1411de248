"""Platform config: defaults, TOML file, environment, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxstream.ops import ConfigError, PlatformConfig
from fxstream.ops.services import ServiceSet
from fxstream.service.task_expiry import RETENTION_ENV


def test_defaults_live_in_a_per_user_state_dir(tmp_path: Path) -> None:
    config = PlatformConfig.load(env={"XDG_STATE_HOME": str(tmp_path)})
    assert config.home == tmp_path / "fxstream"
    assert config.kafka_port == 19092
    assert config.kafka_version == "4.3.1"
    assert config.kafka_libs.name == "libs"
    assert "kafka-4.3.1" in str(config.kafka_libs)


def test_environment_beats_file_beats_defaults(tmp_path: Path) -> None:
    (tmp_path / "fxstream.toml").write_text("kafka_port = 20001\nredis_port = 20002\n")
    config = PlatformConfig.load(
        env={"FXSTREAM_HOME": str(tmp_path), "FXSTREAM_REDIS_PORT": "20003"}
    )
    assert config.home == tmp_path
    assert config.kafka_port == 20001
    assert config.redis_port == 20003
    assert config.controller_port == 19093


def test_explicit_config_file_and_overrides(tmp_path: Path) -> None:
    file = tmp_path / "elsewhere.toml"
    file.write_text('topic_prefix = "lab."\n')
    config = PlatformConfig.load(
        env={"FXSTREAM_CONFIG": str(file)}, home=tmp_path, kafka_port=21000
    )
    assert config.topic_prefix == "lab."
    assert config.kafka_port == 21000


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FXSTREAM_KAFKA_PORT": "abc"}, r"kafka_port \(FXSTREAM_KAFKA_PORT\) must be an integer"),
        ({"FXSTREAM_REDIS_PORT": "80"}, r"redis_port \(FXSTREAM_REDIS_PORT\) must be a port"),
        ({"FXSTREAM_REDIS_PORT": "19092"}, "ports must differ"),
        ({"FXSTREAM_KAFKA_HEAP_MB": "64"}, "FXSTREAM_KAFKA_HEAP_MB"),
        ({"FXSTREAM_ROUTER_INSTANCES": "0"}, r"router_instances \(FXSTREAM_ROUTER_INSTANCES\)"),
        ({"FXSTREAM_TASK_STATE_INSTANCES": "9"}, "must be 1 to 8"),
        ({"FXSTREAM_DEPENDENCIES_INSTANCES": "2"}, r"dependencies_instances .* must be 1"),
        ({"FXSTREAM_ANALYTICS_INSTANCES": "2"}, r"analytics_instances .* must be 1"),
        ({"FXSTREAM_TASK_RETENTION_S": "0"}, r"task_retention_s \(FXSTREAM_TASK_RETENTION_S\)"),
        ({"FXSTREAM_TASK_RETENTION_S": "a week"}, r"task_retention_s .* must be an integer"),
    ],
)
def test_bad_values_name_the_setting(tmp_path: Path, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PlatformConfig.load(env={"FXSTREAM_HOME": str(tmp_path), **env})


def test_unknown_or_broken_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "fxstream.toml").write_text("kafka_prot = 1\n")
    with pytest.raises(ConfigError, match="unknown setting"):
        PlatformConfig.load(env={"FXSTREAM_HOME": str(tmp_path)})
    (tmp_path / "fxstream.toml").write_text("kafka_port = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        PlatformConfig.load(env={"FXSTREAM_HOME": str(tmp_path)})


def test_the_task_retention_reaches_the_processors_and_the_api(tmp_path: Path) -> None:
    """The setting (file or environment) is handed to every service process, so the
    task-state processor expires by it and the API's 404 names it."""
    (tmp_path / "fxstream.toml").write_text("task_retention_s = 3600\n")
    config = PlatformConfig.load(env={"FXSTREAM_HOME": str(tmp_path)})
    assert config.task_retention_s == 3600
    children = ServiceSet(config).supervisor_spec().children
    services = [c for c in children if c.key == "api" or c.key.startswith("task-state")]
    assert {c.key for c in services} >= {"api", "task-state"}
    for child in services:
        assert child.env[RETENTION_ENV] == "3600", child.key
    assert PlatformConfig.load(env={"FXSTREAM_HOME": str(tmp_path / "x")}).task_retention_s == (
        7 * 24 * 3600
    )
