"""Requirement checks: Java's version is checked with a clear message; installs are idempotent."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fxstream.ops import InstallError, PlatformConfig, install
from fxstream.ops.install import MPI_PACKAGES, ensure_java, ensure_kafka, ensure_mpi, ensure_redis


def _fake_java(directory: Path, version_line: str) -> None:
    # A stand-in `java` that only answers `java -version`: what an old JDK prints.
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "java"
    script.write_text(f"#!/bin/sh\necho '{version_line}' >&2\n")
    script.chmod(0o755)


def test_missing_java_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(InstallError, match=r"Java 17\+ is required.*openjdk-17"):
        ensure_java()


def test_old_java_is_refused_with_its_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_java(tmp_path, 'openjdk version "11.0.2" 2019-01-15')
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(InstallError, match="is Java 11"):
        ensure_java()
    _fake_java(tmp_path, 'java version "1.8.0_292"')
    with pytest.raises(InstallError, match="is Java 8"):
        ensure_java()


def test_this_machines_java_is_accepted() -> None:
    assert Path(ensure_java()).name == "java"


def test_kafka_fetch_is_cached_and_complete() -> None:
    config = PlatformConfig.load(env={})
    libs = ensure_kafka(config)
    assert libs == ensure_kafka(config)
    assert (libs / f"kafka_2.13-{config.kafka_version}.jar").exists()
    assert (libs / ".complete").read_text().strip() == config.kafka_version


def test_redis_server_is_found() -> None:
    assert Path(ensure_redis()).name == "redis-server"


def test_mpich_is_ensured_and_a_second_ensure_installs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first call installs what is missing (here MPICH is installed already, by hand or
    # by an earlier run); every later one finds both binaries and never calls apt-get.
    first = ensure_mpi()
    assert set(first) == set(MPI_PACKAGES) == {"mpiexec", "mpicc"}
    calls: list[str] = []
    monkeypatch.setattr(install, "apt_install", lambda package, binary: calls.append(package))
    assert ensure_mpi() == first
    assert calls == []
    version = subprocess.run([first["mpiexec"], "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "HYDRA" in version.stdout
    # The compiler wrapper finds MPICH's header (Debian's mpich alone has the wrapper,
    # libmpich-dev the header: a machine with only the first cannot build an MPI program).
    header = subprocess.run(
        [first["mpicc"], "-E", "-x", "c", "-"],
        input="#include <mpi.h>\n",
        capture_output=True,
        text=True,
    )
    assert header.returncode == 0, header.stderr
