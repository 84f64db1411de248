"""Platform config: defaults, TOML file, environment, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxstream.ops import ConfigError, PlatformConfig


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
