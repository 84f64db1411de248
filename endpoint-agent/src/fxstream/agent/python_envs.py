"""The Python environments an endpoint's workers run in, and which one runs a submission.

Why the Python version matters: a function reaches a worker as its submitter's client
serialized it, and the code strategy (dill, :class:`~fxstream.topics.serialize.DillCode`)
pickles the function's *code object*, whose bytecode and constructor change with every
Python minor release (3.11 to 3.12 renumbers opcodes and adds fields). Such code loads,
if at all, only into the major.minor that wrote it; a patch release (3.11.2 against
3.11.7) keeps the bytecode. So a submission (its ``client.python_version``) runs only in
an environment of the same major.minor, and one that no environment of the endpoint
matches is refused before it runs (``PythonVersionMismatch``, never retried), naming
both versions, the endpoint's versions and what to do, instead of failing to load in a
worker (or, worse, loading and misbehaving).

The environments (:class:`PythonEnvironment`), each knowing its version:

* the *default*: the endpoint's ``image`` (or no container, ``runtime: process``) with the
  agent's own interpreter;
* every other allowed image (``images``), with the agent's own interpreter, which the
  engine binds read-only into every container;
* every entry of ``interpreters`` (absolute paths of other Python interpreters on the
  host), each run in the default image's container when the endpoint has one. An
  interpreter must import what a worker imports (``fxstream.agent.worker_process`` and
  the runner's module): a virtualenv's ``python`` with fxstream-agent installed
  (:func:`install_hint`). One that cannot stops the agent at its start with a
  :class:`PythonEnvironmentError` naming the interpreter, its version and what failed.

Each version is found once, when the agent starts (:func:`probe_environments`): the
interpreter is run (in its container when there is one, by the same runtime command line
a worker gets) with ``-c`` printing ``sys.version_info`` and the paths it reads, bounded
by :data:`PROBE_TIMEOUT_S`, and the answer is kept for the agent's life. The agent's own
interpreter outside any container is this process: its ``sys.version_info`` is the
answer. An image whose probe fails (a runtime that cannot start it now) is logged and
its version left unknown: its tasks are not refused for their version (its workers'
start failures are reported as before).

Matching (:meth:`PythonEnvironments.environment_for`): a function registered with a
container runs only in that image (its own environment, or, for the default image, an
interpreter in it); one without runs in the default environment or an interpreter,
whichever has the submission's major.minor (the default first). No match: refused.
A submission whose client names no parsable version runs where it did before (the
default environment), to fail there with the serializer's own explanation if it must.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from fxstream.agent.containers import Image, ProcessRuntime, Runtime, WorkerLaunch, runtime_for

if TYPE_CHECKING:
    from fxstream.agent.config import EndpointConfig
    from fxstream.agent.worker_process import RunnerSpec

__all__ = [
    "OLDEST_WORKER_PYTHON",
    "PROBE_TIMEOUT_S",
    "WORKER_MODULE",
    "PythonEnvironment",
    "PythonEnvironmentError",
    "PythonEnvironments",
    "PythonInterpreter",
    "install_hint",
    "minor_of",
    "probe_environments",
    "probe_interpreter",
]

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S: Final = 60.0
"""The longest one probe (an interpreter started, in its container, and its imports) may
take; the probes of an agent's environments run at once."""

WORKER_MODULE: Final = "fxstream.agent.worker_process"
"""What every worker imports first."""

OLDEST_WORKER_PYTHON: Final = (3, 11)
"""The oldest Python fxstream-agent installs into (its ``requires-python``)."""

_MARKER: Final = "fxstream-python-probe "
# Runs in the probed interpreter: plain enough for any Python 3 to report its version
# (an old one then fails the imports, which is reported, not a syntax error).
_PROBE: Final = r"""
import json, os, sys
path = [os.path.abspath(p) for p in sys.path if p and os.path.exists(p)]
home = os.path.dirname(os.path.realpath(sys.executable))
base = getattr(sys, "base_prefix", sys.prefix)
paths = [sys.prefix, base, sys.exec_prefix, home] + path
paths = paths + [os.path.realpath(p) for p in paths]
missing = None
for name in sys.argv[1:]:
    try:
        __import__(name)
    except BaseException as exc:
        missing = "import %s failed: %s: %s" % (name, type(exc).__name__, exc)
        break
info = {
    "version": list(sys.version_info[:3]),
    "executable": sys.executable,
    "paths": list(dict.fromkeys(paths)),
    "sys_path": path,
    "missing": missing,
}
sys.stdout.write("\n" + "fxstream-python-probe " + json.dumps(info) + "\n")
"""
_VERSION = re.compile(r"^\s*(\d+)\.(\d+)")
# What the probe's own environment must not carry (another Python's paths).
_FOREIGN_VARIABLES: Final = ("PYTHONPATH", "PYTHONHOME")

Version = tuple[int, int, int]


class PythonEnvironmentError(ValueError):
    """An interpreter in the endpoint's config cannot run workers; the message says why and
    what to do."""


def minor_of(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``"3.12.1"``; None if it names none."""
    found = _VERSION.match(version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _dotted(version: Sequence[int]) -> str:
    return ".".join(str(part) for part in version)


@dataclass(frozen=True, slots=True)
class PythonInterpreter:
    """A Python interpreter workers run: its executable and version, the host paths it
    reads (bound read-only into a container) and its import path (the worker's
    ``PYTHONPATH``)."""

    executable: str
    version: Version
    paths: tuple[str, ...]
    sys_path: tuple[str, ...]

    @classmethod
    def current(cls) -> PythonInterpreter:
        """This process's interpreter (the agent's): the virtualenv, the interpreter's
        directory and every directory on ``sys.path`` (the editable sources)."""
        interpreter = os.path.dirname(os.path.realpath(sys.executable))
        paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, interpreter]
        paths += [os.path.abspath(p) for p in sys.path if os.path.exists(p or ".")]
        paths += [os.path.realpath(p) for p in paths]
        major, minor, micro = sys.version_info[:3]
        return cls(
            executable=sys.executable,
            version=(major, minor, micro),
            paths=tuple(dict.fromkeys(paths)),
            sys_path=tuple(os.path.abspath(p) for p in sys.path if os.path.exists(p or ".")),
        )

    @property
    def minor(self) -> str:
        """``"3.12"``."""
        return _dotted(self.version[:2])


@dataclass(frozen=True, slots=True)
class PythonEnvironment:
    """One place workers run: ``image`` (an allowed image's name; None: no container),
    ``interpreter`` (None: the agent's own), its probed ``version`` (None: unknown, its
    probe failed) and ``pool``: the name the engine's pool of it goes by (an image's
    name, an interpreter's path; None: the endpoint's default)."""

    pool: str | None
    image: str | None
    interpreter: str | None
    version: Version | None

    def describe(self) -> str:
        """E.g. ``"Python 3.12.1 (/opt/py312/bin/python, in image 'worker')"``."""
        version = _dotted(self.version) if self.version is not None else "of unknown version"
        where = self.interpreter or "the agent's own interpreter"
        if self.image is not None:
            where += f", in image {self.image!r}"
        return f"Python {version} ({where})"


class PythonEnvironments:
    """An endpoint's environments in the order they are preferred: the default, the other
    images, then the interpreters (see the module notes)."""

    def __init__(
        self,
        environments: Sequence[PythonEnvironment],
        *,
        interpreters: Mapping[str, PythonInterpreter] | None = None,
        default_image: str | None = None,
        endpoint: str = "this endpoint",
        config_path: str = "config.yaml",
    ) -> None:
        self.environments = tuple(environments)
        self.interpreters: dict[str, PythonInterpreter] = dict(interpreters or {})
        """The interpreters' probed details, by pool name (their paths)."""
        self.default_image = default_image
        self._endpoint = endpoint
        self._config_path = config_path

    def versions(self) -> list[str]:
        """The major.minor versions the workers run, e.g. ``["3.11", "3.12"]`` (sorted)."""
        known = {e.version[:2] for e in self.environments if e.version is not None}
        return [_dotted(v) for v in sorted(known)]

    def environment_for(
        self, function_id: str, client_version: str, image: str | None
    ) -> tuple[str | None, str | None]:
        """Where a task of ``function_id`` submitted from Python ``client_version`` runs,
        its function's container being ``image`` (an allowed image's name; None: none):
        ``(pool, None)``, with ``image`` itself as the pool when the image's own
        environment runs it; or ``(None, why it is refused)`` (see the module notes)."""
        required = image if image is not None else self.default_image
        candidates = [e for e in self.environments if e.image == required]
        own = next((e for e in candidates if e.interpreter is None), None)
        wanted = minor_of(client_version)
        if wanted is None or not candidates:
            return image, None
        for environment in candidates:
            if environment.version is not None and environment.version[:2] == wanted:
                return (image if environment is own else environment.pool), None
        if own is not None and own.version is None:
            return image, None  # its version is unknown: not refused for it
        return None, self._refusal(function_id, client_version, wanted, image, candidates)

    def _refusal(
        self,
        function_id: str,
        client_version: str,
        wanted: tuple[int, int],
        image: str | None,
        candidates: Sequence[PythonEnvironment],
    ) -> str:
        minor = _dotted(wanted)
        known = {e.version[:2] for e in candidates if e.version is not None}
        runs = [_dotted(version) for version in sorted(known)]
        where = f"in image {image!r}" if image is not None else "for functions without a container"
        listed = "; ".join(e.describe() for e in self.environments)
        remedies = [f"submit from Python {' or '.join(runs)}"]
        if wanted < OLDEST_WORKER_PYTHON:
            pass  # no interpreter of it can run fxstream's workers
        elif image is None or image == self.default_image:
            remedies.append(
                f"the endpoint's owner adds a Python {minor} interpreter to interpreters in "
                f"{self._config_path} ({install_hint(minor)}) and restarts the endpoint"
            )
        else:
            remedies.append(
                "register the function without a container, for an endpoint with a "
                f"Python {minor} interpreter"
            )
        return (
            f"function {function_id} was serialized by Python {client_version} (the "
            f"submitting client's) and {self._endpoint} runs Python {' and '.join(runs)} "
            f"{where} (its environments: {listed}); a function's code, pickled as bytecode, "
            f"loads only into the Python minor version that wrote it, so the task was refused "
            f"before it ran. To run it, {' or '.join(remedies)}"
        )


def install_hint(minor: str, python: str | None = None) -> str:
    """How to make an interpreter of Python ``minor`` (the interpreter ``python`` when given)
    that runs workers: a virtualenv with this fxstream-agent installed (from its source
    tree when the agent runs from one)."""
    root = Path(__file__).resolve().parents[4]
    members = [root / m for m in ("topics", "connectors", "endpoint-agent")]
    if all((member / "pyproject.toml").is_file() for member in members):
        packages = " ".join(f"-e {member}" for member in members)
    else:
        packages = "fxstream-agent"
    return (
        f"a virtualenv's python with fxstream-agent installed: {python or 'python' + minor} "
        "-m venv DIR && "
        f"DIR/bin/python -m pip install {packages}; then interpreters: [DIR/bin/python]"
    )


def _runner_module(runner: RunnerSpec) -> str | None:
    """The module a worker imports for ``runner`` (a spec string's, a callable's own)."""
    if isinstance(runner, str):
        return runner.partition(":")[0] or None
    target = getattr(runner, "func", runner)  # a functools.partial's function
    module = getattr(target, "__module__", None)
    return module if isinstance(module, str) and module != "__main__" else None


def _run_probe(
    executable: str,
    *,
    runtime: Runtime,
    image: Image | None,
    readonly: Sequence[str],
    modules: Sequence[str],
    sys_path: Sequence[str] | None,
) -> dict[str, object]:
    """Run the probe in ``executable`` (in ``image`` by ``runtime``); its report, or
    :class:`PythonEnvironmentError` saying what went wrong."""
    sandbox = tempfile.mkdtemp(prefix="fxstream-probe-")
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_VARIABLES}
    if sys_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(sys_path)  # as its workers get it
    launch = WorkerLaunch(
        argv=(executable, "-c", _PROBE, *modules),
        env=env,
        sandbox=sandbox,
        name=f"fxstream-probe-{uuid.uuid4().hex[:12]}",
        readonly=tuple(readonly),
        writable=(sandbox,),
        fds=0,
    )
    where = f" in image {image.name!r} ({image.spec})" if image is not None else ""
    try:
        done = subprocess.run(
            runtime.command(launch, image),
            env=runtime.environment(launch),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
            cwd=sandbox,
        )
    except subprocess.TimeoutExpired:
        _stop(runtime, launch)
        raise PythonEnvironmentError(
            f"{executable}{where} did not report its version within {PROBE_TIMEOUT_S:g} s"
        ) from None
    except OSError as exc:
        raise PythonEnvironmentError(f"cannot run {executable}{where}: {exc}") from None
    finally:
        shutil.rmtree(sandbox, ignore_errors=True)
    reports = [line for line in done.stdout.splitlines() if line.startswith(_MARKER)]
    if done.returncode != 0 or not reports:
        said = (done.stderr.strip() or done.stdout.strip())[-800:] or "nothing"
        raise PythonEnvironmentError(
            f"{executable}{where} did not report its version (exit {done.returncode}); "
            f"it said: {said}"
        )
    report: dict[str, object] = json.loads(reports[-1][len(_MARKER) :])
    return report


def _stop(runtime: Runtime, launch: WorkerLaunch) -> None:
    stop = runtime.stop_command(launch)
    if stop is not None:
        subprocess.run(stop, capture_output=True, timeout=PROBE_TIMEOUT_S, check=False)


def _version(report: Mapping[str, object]) -> Version:
    raw = report["version"]
    assert isinstance(raw, list)
    major, minor, micro = (int(part) for part in raw)
    return major, minor, micro


def _strings(report: Mapping[str, object], key: str) -> tuple[str, ...]:
    raw = report[key]
    assert isinstance(raw, list)
    return tuple(str(item) for item in raw)


def probe_interpreter(
    executable: str,
    *,
    modules: Sequence[str] = (WORKER_MODULE,),
    image: Image | None = None,
    readonly: Sequence[str] = (),
) -> PythonInterpreter:
    """Run ``executable`` (on the host, then in ``image`` if given, as its workers will
    run) and return what it reports; :class:`PythonEnvironmentError` saying why it cannot
    run workers: it does not start, does not answer in time, or cannot import ``modules``."""
    if not os.path.isabs(executable):
        raise PythonEnvironmentError(f"interpreter {executable!r} is not an absolute path")
    if not (os.path.isfile(executable) and os.access(executable, os.X_OK)):
        raise PythonEnvironmentError(f"interpreter {executable} is not an executable file")
    report = _run_probe(
        executable,
        runtime=ProcessRuntime(),
        image=None,
        readonly=(),
        modules=modules,
        sys_path=None,
    )
    interpreter = PythonInterpreter(
        executable=executable,
        version=_version(report),
        paths=_strings(report, "paths"),
        sys_path=_strings(report, "sys_path"),
    )
    missing = report.get("missing")
    if modules and interpreter.version[:2] < OLDEST_WORKER_PYTHON:
        oldest = _dotted(OLDEST_WORKER_PYTHON)
        raise PythonEnvironmentError(
            f"interpreter {executable} is Python {_dotted(interpreter.version)}: fxstream's "
            f"workers need Python {oldest} or newer; list an interpreter of {oldest} or newer"
        )
    if missing:
        raise PythonEnvironmentError(
            f"interpreter {executable} (Python {_dotted(interpreter.version)}) cannot run "
            f"workers: {missing}. Use {install_hint(interpreter.minor, executable)}"
        )
    if image is not None and image.runtime != "process":
        inside = _run_probe(
            executable,
            runtime=runtime_for(image.runtime),
            image=image,
            readonly=(*interpreter.paths, *readonly),
            modules=modules,
            sys_path=interpreter.sys_path,
        )
        if inside.get("missing") or _version(inside) != interpreter.version:
            why = inside.get("missing") or f"it reports Python {_dotted(_version(inside))} there"
            raise PythonEnvironmentError(
                f"interpreter {executable} (Python {_dotted(interpreter.version)}) cannot run "
                f"workers in the endpoint's image {image.name!r} ({image.spec}): {why}. Use "
                "an interpreter whose libraries the image has (an image built from the "
                "host's rootfs, bubblewrap:/, has them all)"
            )
    return interpreter


def _probe_image(own: PythonInterpreter, image: Image, readonly: Sequence[str]) -> Version | None:
    """The version the agent's interpreter reports in ``image``; None (logged) if the
    probe fails."""
    try:
        report = _run_probe(
            own.executable,
            runtime=runtime_for(image.runtime),
            image=image,
            readonly=(*own.paths, *readonly),
            modules=(),
            sys_path=own.sys_path,
        )
    except (PythonEnvironmentError, OSError, ValueError) as exc:
        log.warning(
            "cannot find the Python version of image %r (%s): %s; its tasks are not "
            "matched by version",
            image.name,
            image.spec,
            exc,
        )
        return None
    return _version(report)


def probe_environments(config: EndpointConfig, runner: RunnerSpec) -> PythonEnvironments:
    """Every environment of ``config``'s endpoint with its Python version (the probes run
    at once, each bounded by :data:`PROBE_TIMEOUT_S`); :class:`PythonEnvironmentError` if
    an entry of ``interpreters`` cannot run workers."""
    own = PythonInterpreter.current()
    readonly, _ = config.worker_paths()
    default = config.worker_image()
    images = config.allowed_images()
    modules = [WORKER_MODULE]
    runner_module = _runner_module(runner)
    if runner_module is not None and runner_module not in modules:
        modules.append(runner_module)
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="fxstream-probe") as pool:
        image_versions = {
            name: pool.submit(_probe_image, own, image, readonly)
            for name, image in images.items()
            if image.runtime != "process"  # no container: the agent's own interpreter
        }
        probed = {
            path: pool.submit(
                probe_interpreter, path, modules=modules, image=default, readonly=readonly
            )
            for path in config.interpreters
        }
        failures: list[str] = []
        interpreters: dict[str, PythonInterpreter] = {}
        for path, future in probed.items():
            try:
                interpreters[path] = future.result()
            except PythonEnvironmentError as exc:
                failures.append(str(exc))
        versions = {
            name: image_versions[name].result() if name in image_versions else own.version
            for name in images
        }
    if failures:
        raise PythonEnvironmentError(
            f"endpoint {config.name!r}: {'; '.join(failures)} (interpreters in {config.path})"
        )
    default_name = default.name if default is not None else None
    environments = [
        PythonEnvironment(
            pool=None,
            image=default_name,
            interpreter=None,
            version=versions.get(default_name) if default_name is not None else own.version,
        )
    ]
    environments += [
        PythonEnvironment(pool=name, image=name, interpreter=None, version=version)
        for name, version in versions.items()
        if name != default_name
    ]
    environments += [
        PythonEnvironment(
            pool=path, image=default_name, interpreter=path, version=interpreter.version
        )
        for path, interpreter in interpreters.items()
    ]
    result = PythonEnvironments(
        environments,
        interpreters=interpreters,
        default_image=default_name,
        endpoint=f"endpoint {config.name!r} ({config.endpoint_id})",
        config_path=str(config.path),
    )
    log.info("worker environments: %s", "; ".join(e.describe() for e in environments))
    return result
