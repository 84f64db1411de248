"""Install what the platform needs and is missing: Apache Kafka's jars, Redis, the container
runtimes, and checks for Java.

Kafka is fetched by Maven from Maven Central with ``broker-config/pom.xml``
into a cache outside the repo; Redis comes from Debian's ``redis-server``
package; the container runtimes an endpoint may use come from Debian's
``bubblewrap``, ``podman`` and ``runc`` packages (:data:`CONTAINER_PACKAGES`;
Apptainer is not packaged for Debian 12 and Docker needs a daemon: neither is
installed here); MPICH (``mpiexec`` and ``mpicc``, for MPI functions on the batch
engine) from Debian's ``mpich`` and ``libmpich-dev`` (:data:`MPI_PACKAGES`); the headless
browser the dashboard's test drives from Debian's ``chromium`` (:data:`BROWSER_PACKAGES`).
Each step is idempotent and cheap when there is nothing to do.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from fxstream.ops.config import PlatformConfig

__all__ = [
    "BROWSER_PACKAGES",
    "CONTAINER_PACKAGES",
    "MIN_JAVA",
    "MPI_PACKAGES",
    "InstallError",
    "apt_install",
    "ensure_browser",
    "ensure_container_runtimes",
    "ensure_java",
    "ensure_kafka",
    "ensure_mpi",
    "ensure_redis",
    "ensure_requirements",
]

MIN_JAVA = 17

CONTAINER_PACKAGES: dict[str, str] = {"bwrap": "bubblewrap", "runc": "runc", "podman": "podman"}
"""The container runtimes' binaries and the Debian packages that provide them (podman runs
its containers with runc here: crun refuses these machines' hybrid cgroup layout)."""
MPI_PACKAGES: dict[str, str] = {"mpiexec": "mpich", "mpicc": "libmpich-dev"}
"""MPICH's launcher and compiler wrapper and the Debian packages that provide them (the
MPI engine's tests start real ranks with ``mpiexec`` and build an MPI program with
``mpicc``)."""
BROWSER_PACKAGES: dict[str, str] = {"chromium": "chromium"}
"""The headless browser the dashboard's test drives (through Playwright, with this binary:
Playwright's own browser download needs the internet) and its Debian package."""
_COMPLETE = ".complete"


class InstallError(RuntimeError):
    """A requirement is missing and could not be installed; the message says what to do."""


def _is_root() -> bool:
    return os.geteuid() == 0


def apt_install(package: str, binary: str) -> str:
    """Install Debian's ``package`` (as root) and return the path of its ``binary``;
    :class:`InstallError` says what to run when that cannot be done here."""
    if not _is_root():
        raise InstallError(
            f"{binary} is not installed: install the Debian package {package!r} "
            f"(sudo apt-get install -y {package}) and run again"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]
    done = subprocess.run(install, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        # A fresh machine has no package lists yet.
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
    path = shutil.which(binary) or next(
        (f"{d}/{binary}" for d in ("/usr/bin", "/usr/sbin") if Path(f"{d}/{binary}").exists()),
        None,
    )
    if done.returncode != 0 or path is None:
        raise InstallError(
            f"apt-get could not install {package!r} (exit {done.returncode}):\n"
            f"{done.stderr[-2000:]}"
        )
    return path


def ensure_java() -> str:
    """Return the ``java`` binary, checking it is Java 17 or newer."""
    java = shutil.which("java")
    if java is None:
        raise InstallError(
            f"Java {MIN_JAVA}+ is required to run Apache Kafka and none was found on PATH: "
            "install a JDK or JRE (e.g. apt-get install -y openjdk-17-jre-headless)"
        )
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if match is None:
        raise InstallError(f"cannot tell the Java version from `java -version`: {out.strip()}")
    major = int(match.group(1))
    if major == 1 and match.group(2):  # "1.8" style
        major = int(match.group(2))
    if major < MIN_JAVA:
        raise InstallError(
            f"Java {MIN_JAVA}+ is required to run Apache Kafka; {java} is Java {major}: "
            "install openjdk-17-jre-headless or newer and put it first on PATH"
        )
    return java


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_kafka(config: PlatformConfig) -> Path:
    """Fetch the pinned Kafka broker jars with Maven unless cached; return the libs dir."""
    libs = config.kafka_libs
    if (libs / _COMPLETE).exists():
        return libs
    mvn = shutil.which("mvn") or apt_install("maven", "mvn")
    # Two processes (a test run and `fx up`) may fetch at once: one fetches, the other waits.
    with _locked(libs.parent / ".fetch.lock"):
        if (libs / _COMPLETE).exists():
            return libs
        staging = libs.parent / "libs.partial"
        shutil.rmtree(staging, ignore_errors=True)
        done = subprocess.run(
            [
                mvn,
                "-B",
                "-q",
                "-f",
                str(config.broker_config_dir / "pom.xml"),
                "dependency:copy-dependencies",
                f"-DoutputDirectory={staging}",
                "-DincludeScope=runtime",
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
            raise InstallError(
                f"Maven could not fetch Apache Kafka {config.kafka_version} from Maven Central "
                f"(exit {done.returncode}); its output ends:\n{(done.stdout + done.stderr)[-3000:]}"
            )
        (staging / _COMPLETE).write_text(config.kafka_version + "\n")
        shutil.rmtree(libs, ignore_errors=True)
        staging.rename(libs)
    return libs


def ensure_redis() -> str:
    """Return the ``redis-server`` binary, installing Debian's package when missing (as root)."""
    found = shutil.which("redis-server")
    if found:
        return found
    if Path("/usr/bin/redis-server").exists():
        return "/usr/bin/redis-server"
    return apt_install("redis-server", "redis-server")


def ensure_container_runtimes() -> dict[str, str]:
    """Return the container runtimes' binaries (bwrap, runc, podman), installing Debian's
    packages for those missing (as root)."""
    return _ensure_binaries(CONTAINER_PACKAGES)


def ensure_mpi() -> dict[str, str]:
    """Return MPICH's ``mpiexec`` and ``mpicc``, installing Debian's packages for those
    missing (as root), and make sure ``mpicc`` finds ``mpi.h``; nothing is installed when
    all are there.

    Debian's ``mpich`` alone provides the ``mpicc`` wrapper (an alternative) but not the
    headers (``libmpich-dev``), so a found ``mpicc`` does not prove a program compiles:
    the header is checked by the preprocessor itself.
    """
    found = _ensure_binaries(MPI_PACKAGES)
    mpicc = found["mpicc"]
    if not _finds_mpi_header(mpicc):
        apt_install(MPI_PACKAGES["mpicc"], "mpicc")
        if not _finds_mpi_header(mpicc):
            raise InstallError(
                f"{mpicc} cannot find mpi.h although {MPI_PACKAGES['mpicc']!r} is installed: "
                f"check that `{mpicc} -show` names MPICH (update-alternatives --config mpi)"
            )
    return found


def _finds_mpi_header(mpicc: str) -> bool:
    """Whether ``mpicc`` preprocesses ``#include <mpi.h>`` (its headers are installed)."""
    try:
        done = subprocess.run(
            [mpicc, "-E", "-x", "c", "-"],
            input="#include <mpi.h>\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def ensure_browser() -> dict[str, str]:
    """Return Debian's ``chromium`` (the dashboard's browser test), installing it when
    missing (as root)."""
    return _ensure_binaries(BROWSER_PACKAGES)


def _ensure_binaries(packages: Mapping[str, str]) -> dict[str, str]:
    """Binary -> its path, for each binary of ``packages`` (binary -> Debian package),
    installing the package of each one missing from PATH and /usr/bin."""
    found: dict[str, str] = {}
    for binary, package in packages.items():
        path = shutil.which(binary)
        if path is None and Path(f"/usr/bin/{binary}").exists():
            path = f"/usr/bin/{binary}"
        found[binary] = path or apt_install(package, binary)
    return found


def ensure_requirements(config: PlatformConfig) -> dict[str, str]:
    """Everything the platform needs, installed; returns what was found where."""
    return {
        "java": ensure_java(),
        "kafka": str(ensure_kafka(config)),
        "redis-server": ensure_redis(),
        **ensure_container_runtimes(),
        **_ensure_slurm(),
        **ensure_mpi(),
        **ensure_browser(),
    }


def _ensure_slurm() -> dict[str, str]:
    # slurm imports this module (apt_install): imported here, not at the top.
    from fxstream.ops.slurm import ensure_slurm

    return ensure_slurm()
