"""Other Pythons for the tests: this machine's pyenv interpreters, and a virtualenv of one
with this workspace's packages installed (editable), as an endpoint's ``interpreters``
entry needs them and as a client of that Python would have them.

The virtualenv is built once per interpreter, workspace checkout and dependency set
(``uv venv`` and ``uv pip install -e``, the registry's wheels for that Python) and cached
under ``~/.cache/fxstream``, like the worker rootfs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["PACKAGES", "REPO", "other_python", "workspace_venv"]

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("topics", "connectors", "endpoint-agent", "stream-sdk")
_PYENV = Path(os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))) / "versions"
_BUILD_S = 600


def other_python(minor: str) -> str:
    """The newest pyenv interpreter of Python ``minor`` (e.g. ``"3.12"``) on this machine."""
    found = sorted(_PYENV.glob(f"{minor}.*/bin/python{minor}"))
    assert found, (
        f"no Python {minor} under {_PYENV}: this machine's image (and CI's) has pyenv's "
        f"3.10-3.13; install one with `pyenv install {minor}`"
    )
    return str(found[-1])


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))) / "fxstream"


def _uv() -> list[str]:
    found = shutil.which("uv")
    return [found] if found else ["python3", "-m", "uv"]  # as ./fx runs it


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_BUILD_S, check=False)
    assert done.returncode == 0, f"{' '.join(argv)} failed: {done.stderr.strip()[-2000:]}"


def workspace_venv(interpreter: str) -> tuple[Path, float]:
    """A virtualenv of ``interpreter`` with the workspace's agent, SDK, topics and connectors
    installed editable (so it runs this checkout's code), and the seconds it took to build
    (0 when it was cached)."""
    version = subprocess.run(
        [interpreter, "-c", "import sys; print(sys.version)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    digest = hashlib.sha256(f"{REPO}\0{interpreter}\0{version}".encode())
    for package in PACKAGES:
        digest.update((REPO / package / "pyproject.toml").read_bytes())
    cache = _cache()
    cache.mkdir(parents=True, exist_ok=True)
    venv = cache / f"python-venv-{digest.hexdigest()[:16]}"
    marker = venv / ".fxstream-ready"
    with (cache / "python-venv.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time, across test processes
        if marker.is_file():
            return venv, 0.0
        began = time.monotonic()
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(venv)
        _run([*_uv(), "venv", "--quiet", "--python", interpreter, str(venv)])
        editable = [arg for p in PACKAGES for arg in ("-e", str(REPO / p))]
        python = str(venv / "bin" / "python")
        _run([*_uv(), "pip", "install", "--quiet", "--python", python, *editable])
        marker.write_text(f"built by the tests of Python {sys.version.split()[0]}\n")
        return venv, time.monotonic() - began
