"""Container runtimes behind one interface: the command line that starts a worker in an image.

An engine (:class:`~fxstream.agent.process_engine.ProcessEngine`) describes the
worker it wants as a :class:`WorkerLaunch`: the interpreter and its arguments,
the environment, the host paths the worker reads (interpreter, virtualenv, code),
the directories it may write (its own sandbox directory first) and how it talks
to the engine (two inherited pipes). A :class:`Runtime` turns that into the
command line that starts the worker inside an :class:`Image`; the engine starts
that command and talks to the worker as to any other.

The runtimes (:data:`RUNTIMES`):

* ``process``: no container; the command is the worker's own.
* ``bubblewrap`` (``bwrap``): new mount, PID, IPC and UTS namespaces (and a
  user namespace when not root); the image's rootfs (``/usr``, ``/bin``,
  ``/lib*``, ``/etc`` of a directory, ``/`` for the host's own) and every
  :attr:`WorkerLaunch.readonly` path bound read-only, a private ``/tmp``,
  ``/proc`` and ``/dev``, and write access only to
  :attr:`WorkerLaunch.writable`. The sandbox dies with the agent
  (``--die-with-parent``). The network is the host's.
* ``podman``: ``podman run --rm --runtime runc --preserve-fds 2 --network host
  --read-only`` with explicit ``--ulimit nofile`` (crun refuses the hybrid
  cgroup layout of these machines, hence runc and explicit limits) and the same
  read-only and writable binds; the image is a local one (``podman import`` of a
  rootfs: :mod:`fxstream.agent.images`), never pulled (``--pull never``).
* ``docker``: the same shape where a daemon answers; Docker cannot pass
  descriptors into a container, so the worker's pipes are its stdin and stdout
  (``-i``).
* ``apptainer``: ``apptainer exec --containall --bind ...`` of a SIF file or a
  sandbox directory (``singularity`` if that is the binary installed); pipes on
  stdin and stdout. Apptainer is not packaged for Debian 12: its command line is
  built here and run only where the binary exists.

Nothing secret goes on a command line: the environment reaches the worker by
name (``--env NAME`` takes the value from the launcher's own environment; for
Apptainer through ``APPTAINERENV_NAME``), and the engine sends the runner on the
task pipe.
"""

from __future__ import annotations

import os
import resource
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Final, Protocol, runtime_checkable

__all__ = [
    "HOST_ROOTFS",
    "RUNTIMES",
    "ApptainerRuntime",
    "BubblewrapRuntime",
    "ContainerError",
    "DockerRuntime",
    "Image",
    "PodmanRuntime",
    "ProcessRuntime",
    "Runtime",
    "WorkerLaunch",
    "runtime_for",
]

RUNTIMES: Final = ("process", "bubblewrap", "podman", "docker", "apptainer")
"""The runtimes an endpoint config may name."""

HOST_ROOTFS: Final = "/"
"""A bubblewrap image whose reference is ``/`` is the host's own ``/usr``, ``/lib*``,
``/bin``, ``/sbin`` and ``/etc``, bound read-only."""

# What of an image's rootfs a bubblewrap sandbox sees (each if present: a directory is
# bound read-only, a symbolic link is recreated).
_ROOTFS_ENTRIES: Final = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
# Paths the rootfs provides: the worker's own read-only paths under them are not bound again.
_ROOTFS_PREFIXES: Final = (*(f"/{entry}" for entry in _ROOTFS_ENTRIES), "/proc", "/dev")

_CONTAINER_HOSTNAME: Final = "fxstream-worker"


class ContainerError(ValueError):
    """An image or runtime cannot be used; the message says what to change."""


@dataclass(frozen=True, slots=True)
class Image:
    """A container image an endpoint allows: its name, runtime and local reference.

    ``reference`` is a directory rootfs (bubblewrap; :data:`HOST_ROOTFS` for the
    host's own), a SIF file or sandbox directory (apptainer) or a local image name
    (podman, docker: never pulled). ``process`` images have no reference.
    """

    name: str
    runtime: str
    reference: str = ""

    @classmethod
    def parse(cls, name: str, spec: str) -> Image:
        """The image ``name`` of an endpoint config's ``images`` entry ``"runtime:reference"``."""
        runtime, sep, reference = spec.partition(":")
        if runtime not in RUNTIMES:
            raise ContainerError(
                f"image {name!r}: {spec!r} does not start with a runtime; write it as "
                f"'<runtime>:<reference>' with a runtime among {', '.join(RUNTIMES)} "
                "(e.g. 'bubblewrap:/' for the host's own rootfs)"
            )
        if runtime != "process" and not (sep and reference):
            raise ContainerError(
                f"image {name!r}: {spec!r} names no reference; write '{runtime}:<reference>' "
                "(a rootfs directory for bubblewrap, a SIF file or directory for apptainer, "
                "a local image name for podman or docker)"
            )
        if runtime in ("bubblewrap", "apptainer") and not reference.startswith("/"):
            raise ContainerError(
                f"image {name!r}: the {runtime} reference {reference!r} must be an absolute path"
            )
        return cls(name=name, runtime=runtime, reference=reference if runtime != "process" else "")

    @property
    def spec(self) -> str:
        """``"runtime:reference"``, as an endpoint config writes it."""
        return f"{self.runtime}:{self.reference}" if self.reference else self.runtime


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """What a worker needs, for a runtime to wrap: see the module notes.

    ``argv`` starts with the interpreter; ``env`` is the worker's whole
    environment; ``readonly`` the host paths it reads (bound at the same path);
    ``writable`` the host directories it may write, its ``sandbox`` (its working
    directory) among them; ``fds`` the descriptors 3 .. 2+``fds`` it inherits
    (its pipes) when the runtime passes descriptors; ``name`` is unique per worker.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    sandbox: str
    name: str
    readonly: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    fds: int = 2
    nofile: tuple[int, int] = field(default_factory=lambda: _limits(resource.RLIMIT_NOFILE))


@runtime_checkable
class Runtime(Protocol):
    """A way to start a worker in an image: see the module notes for each."""

    @property
    def name(self) -> str:
        """The runtime as an endpoint config names it (:data:`RUNTIMES`)."""
        ...

    @property
    def passes_fds(self) -> bool:
        """True: the worker inherits its pipes at descriptors 3 and 4; False: they are
        its stdin and stdout."""
        ...

    def unavailable(self) -> str | None:
        """Why this runtime cannot start workers here (its binary is missing), or None."""
        ...

    def command(self, launch: WorkerLaunch, image: Image | None) -> list[str]:
        """The command line that starts ``launch`` inside ``image``."""
        ...

    def environment(self, launch: WorkerLaunch) -> dict[str, str]:
        """The environment to start :meth:`command` with."""
        ...

    def stop_command(self, launch: WorkerLaunch) -> list[str] | None:
        """A command that kills the worker's container when killing the launcher does not
        (podman, docker), else None."""
        ...


def _limits(which: int) -> tuple[int, int]:
    """This process's (soft, hard) limit, unlimited as a large number."""
    soft, hard = resource.getrlimit(which)
    big = 2**31 - 1
    return (big if soft == resource.RLIM_INFINITY else soft), (
        big if hard == resource.RLIM_INFINITY else hard
    )


def _under(path: str, prefixes: Sequence[str]) -> bool:
    pure = PurePosixPath(path)
    return any(pure == PurePosixPath(p) or PurePosixPath(p) in pure.parents for p in prefixes)


def _outermost(paths: Sequence[str], *, skip: Sequence[str] = ()) -> list[str]:
    """``paths`` (made absolute, in order) without duplicates, those inside another, and
    those under ``skip``; never ``/`` (the host's whole tree is never bound)."""
    unique: list[str] = []
    for path in paths:
        absolute = os.path.abspath(path)
        if absolute != "/" and absolute not in unique and not _under(absolute, skip):
            unique.append(absolute)
    return [p for p in unique if not _under(p, [q for q in unique if q != p])]


def _which(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name) or next(
            (f"{d}/{name}" for d in ("/usr/bin", "/usr/sbin") if os.path.exists(f"{d}/{name}")),
            None,
        )
        if found:
            return found
    return None


def _missing(runtime: str, binaries: Sequence[str], remedy: str) -> str:
    return f"the {runtime} runtime needs {' or '.join(binaries)}, which is not installed: {remedy}"


def _check_image(runtime: str, image: Image | None) -> Image:
    if image is None or image.runtime != runtime:
        named = "no image" if image is None else f"image {image.name!r} ({image.spec})"
        raise ContainerError(f"the {runtime} runtime cannot start a worker in {named}")
    return image


@dataclass(frozen=True, slots=True)
class ProcessRuntime:
    """No container: the worker's own command line, in the agent's environment."""

    @property
    def name(self) -> str:
        """``"process"``."""
        return "process"

    @property
    def passes_fds(self) -> bool:
        """True: a plain child inherits its descriptors."""
        return True

    def unavailable(self) -> str | None:
        """Always available."""
        return None

    def command(self, launch: WorkerLaunch, image: Image | None) -> list[str]:
        """``launch.argv`` itself."""
        return list(launch.argv)

    def environment(self, launch: WorkerLaunch) -> dict[str, str]:
        """``launch.env``."""
        return dict(launch.env)

    def stop_command(self, launch: WorkerLaunch) -> list[str] | None:
        """None: killing the process is enough."""
        return None


@dataclass(frozen=True, slots=True)
class BubblewrapRuntime:
    """Bubblewrap sandboxes (Debian's ``bubblewrap``): see the module notes."""

    binary: str = "bwrap"

    @property
    def name(self) -> str:
        """``"bubblewrap"``."""
        return "bubblewrap"

    @property
    def passes_fds(self) -> bool:
        """True: bwrap's command inherits bwrap's descriptors."""
        return True

    def unavailable(self) -> str | None:
        """Why ``bwrap`` cannot be run here, or None."""
        if _which(self.binary) is None:
            return _missing("bubblewrap", [self.binary], "apt-get install -y bubblewrap")
        return None

    def command(self, launch: WorkerLaunch, image: Image | None) -> list[str]:
        """``bwrap`` with the image's rootfs, the worker's binds and new namespaces."""
        rootfs = _check_image("bubblewrap", image).reference
        binary = _which(self.binary) or self.binary
        argv = [binary, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        argv += ["--unshare-cgroup-try", "--hostname", _CONTAINER_HOSTNAME]
        if os.geteuid() != 0:
            argv.append("--unshare-user")  # mounts without privileges need a user namespace
        for entry in _ROOTFS_ENTRIES:
            source = os.path.join(rootfs, entry)
            if os.path.islink(source):
                argv += ["--symlink", os.readlink(source), f"/{entry}"]
            elif os.path.isdir(source):
                argv += ["--ro-bind", source, f"/{entry}"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run"]
        writable = _outermost(launch.writable)
        for path in _outermost(launch.readonly):
            if any(_under(path, [w]) for w in writable):
                continue
            if _under(path, _ROOTFS_PREFIXES) and (
                # The host's rootfs has it already; another is bound over where the image
                # has a place for it (a rootfs cannot be written to make one).
                rootfs == HOST_ROOTFS or not os.path.isdir(os.path.join(rootfs, path[1:]))
            ):
                continue
            argv += ["--ro-bind", path, path]
        for path in writable:
            argv += ["--bind", path, path]
        argv += ["--chdir", launch.sandbox, "--"]
        return argv + list(launch.argv)

    def environment(self, launch: WorkerLaunch) -> dict[str, str]:
        """``launch.env``: bwrap passes its own environment on."""
        return dict(launch.env)

    def stop_command(self, launch: WorkerLaunch) -> list[str] | None:
        """None: killing bwrap's process group ends its PID namespace, so the worker too."""
        return None


@dataclass(frozen=True, slots=True)
class PodmanRuntime:
    """Podman containers of a local image (Debian's ``podman`` with ``runc``)."""

    binary: str = "podman"
    oci_runtime: str | None = "runc"
    # Rootful podman's default process limit (1048576) is refused on these machines: the
    # container's is explicit, at most this (and never above the agent's own).
    max_processes: int = 32_768

    @property
    def name(self) -> str:
        """``"podman"``."""
        return "podman"

    @property
    def passes_fds(self) -> bool:
        """True: ``--preserve-fds``."""
        return True

    def unavailable(self) -> str | None:
        """Why podman (with runc) cannot be run here, or None."""
        if _which(self.binary) is None:
            return _missing("podman", [self.binary], "apt-get install -y podman runc")
        if self.oci_runtime is not None and _which(self.oci_runtime) is None:
            return _missing("podman", [self.oci_runtime], f"apt-get install -y {self.oci_runtime}")
        return None

    def _run_options(self, launch: WorkerLaunch) -> list[str]:
        soft, hard = launch.nofile
        processes = min(self.max_processes, *_limits(resource.RLIMIT_NPROC))
        return [
            "--ulimit",
            f"nofile={soft}:{hard}",
            "--ulimit",
            f"nproc={processes}:{processes}",
        ]

    def command(self, launch: WorkerLaunch, image: Image | None) -> list[str]:
        """``podman run`` of the image with the worker's binds and descriptors."""
        reference = _check_image(self.name, image).reference
        argv = [_which(self.binary) or self.binary, "run", "--rm", "-i", "--pull", "never"]
        if self.oci_runtime is not None:
            argv += ["--runtime", self.oci_runtime]
        argv += self._run_options(launch)
        if self.passes_fds and launch.fds:
            argv += ["--preserve-fds", str(launch.fds)]
        argv += ["--network", "host", "--read-only", "--name", launch.name]
        argv += ["--hostname", _CONTAINER_HOSTNAME]
        writable = _outermost(launch.writable)
        for path in _outermost(launch.readonly):
            if not any(_under(path, [w]) for w in writable):
                argv += ["--volume", f"{path}:{path}:ro"]
        for path in writable:
            argv += ["--volume", f"{path}:{path}:rw"]
        for name in sorted(launch.env):
            argv += ["--env", name]  # the value comes from podman's own environment
        argv += ["--workdir", launch.sandbox, reference]
        return argv + list(launch.argv)

    def environment(self, launch: WorkerLaunch) -> dict[str, str]:
        """``launch.env``, which ``--env NAME`` hands to the container."""
        return dict(launch.env)

    def stop_command(self, launch: WorkerLaunch) -> list[str] | None:
        """``podman kill``: the container outlives a killed ``podman run``."""
        return [_which(self.binary) or self.binary, "kill", "--signal", "KILL", launch.name]


@dataclass(frozen=True, slots=True)
class DockerRuntime(PodmanRuntime):
    """Docker containers of a local image, where a Docker daemon answers."""

    binary: str = "docker"
    oci_runtime: str | None = None

    @property
    def name(self) -> str:
        """``"docker"``."""
        return "docker"

    @property
    def passes_fds(self) -> bool:
        """False: Docker cannot pass descriptors; the pipes are stdin and stdout."""
        return False

    def unavailable(self) -> str | None:
        """Why Docker cannot be run here, or None (the daemon is asked when a worker starts)."""
        if _which(self.binary) is None:
            return _missing("docker", [self.binary], "install Docker and start its daemon")
        return None


@dataclass(frozen=True, slots=True)
class ApptainerRuntime:
    """Apptainer (or Singularity) containers of a SIF file or sandbox directory."""

    binaries: tuple[str, ...] = ("apptainer", "singularity")

    @property
    def name(self) -> str:
        """``"apptainer"``."""
        return "apptainer"

    @property
    def passes_fds(self) -> bool:
        """False: the pipes are stdin and stdout, which every Apptainer version keeps."""
        return False

    def unavailable(self) -> str | None:
        """Why neither ``apptainer`` nor ``singularity`` can be run here, or None."""
        if _which(*self.binaries) is None:
            return _missing(
                "apptainer",
                self.binaries,
                "it is not packaged for Debian 12; install Apptainer from apptainer.org",
            )
        return None

    def _binary(self) -> str:
        return _which(*self.binaries) or self.binaries[0]

    def command(self, launch: WorkerLaunch, image: Image | None) -> list[str]:
        """``apptainer exec --containall`` of the image with the worker's binds."""
        reference = _check_image(self.name, image).reference
        writable = _outermost(launch.writable)
        binds = [
            f"{path}:{path}:ro"
            for path in _outermost(launch.readonly, skip=_ROOTFS_PREFIXES)
            if not any(_under(path, [w]) for w in writable)
        ]
        binds += [f"{path}:{path}:rw" for path in writable]
        argv = [self._binary(), "exec", "--containall", "--no-home"]
        if binds:
            argv += ["--bind", ",".join(binds)]
        argv += ["--hostname", _CONTAINER_HOSTNAME, "--pwd", launch.sandbox, reference]
        return argv + list(launch.argv)

    def environment(self, launch: WorkerLaunch) -> dict[str, str]:
        """The launcher's own minimal environment plus ``APPTAINERENV_<NAME>`` per variable
        (``--containall`` cleans the environment; these pass it in)."""
        env = {k: v for k, v in launch.env.items() if k in ("PATH", "HOME", "LANG")}
        for prefix in ("APPTAINERENV_", "SINGULARITYENV_"):
            env.update({f"{prefix}{k}": v for k, v in launch.env.items()})
        return env

    def stop_command(self, launch: WorkerLaunch) -> list[str] | None:
        """None: ``--containall`` gives the container its own PID namespace under the
        launcher, which dies with it."""
        return None


def runtime_for(name: str) -> Runtime:
    """The runtime an endpoint config names; :class:`ContainerError` for an unknown one."""
    runtimes: dict[str, Runtime] = {
        "process": ProcessRuntime(),
        "bubblewrap": BubblewrapRuntime(),
        "podman": PodmanRuntime(),
        "docker": DockerRuntime(),
        "apptainer": ApptainerRuntime(),
    }
    try:
        return runtimes[name]
    except KeyError:
        raise ContainerError(
            f"runtime {name!r} is unknown; choose one of {', '.join(RUNTIMES)}"
        ) from None
