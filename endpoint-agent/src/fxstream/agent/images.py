"""Worker images built on this machine: a directory rootfs and an OCI image made from it.

Nothing is pulled from a registry. :func:`build_rootfs` makes a minimal
operating-system layer from the host's own files: the shared libraries this
Python's interpreter and extension modules load (their ``ldd`` closure, with the
dynamic loader and its cache), ``/bin/sh``, and a few files of ``/etc``
(``passwd``, ``group``, ``nsswitch.conf``, ``hosts``, ``resolv.conf``, the CA
bundle). The interpreter, the virtualenv and the code are not copied: the
engine binds them read-only into every container at their own paths (see
:mod:`fxstream.agent.containers`), so one image serves any virtualenv of the
same interpreter build. :func:`build_podman_image` imports that rootfs as a
local podman (or docker) image (``podman import``: an image ``FROM scratch``
with one layer), tagged with a fingerprint of what went in.

Both are cached: a rootfs directory holding a ``.fxstream-rootfs`` file with the
current fingerprint, or an image whose tag exists, is not built again.
``fxstream-endpoint image`` runs them and prints the ``images:`` entries to add
to an endpoint's config. For bubblewrap the host's own ``/`` (``bubblewrap:/``)
is an image too, needing no build.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from fxstream.agent.containers import ContainerError

__all__ = [
    "DEFAULT_IMAGE_REPOSITORY",
    "build_podman_image",
    "build_rootfs",
    "rootfs_fingerprint",
]

DEFAULT_IMAGE_REPOSITORY: Final = "localhost/fxstream-worker"
"""The repository of the images :func:`build_podman_image` tags (the tag is the fingerprint)."""

_MARKER: Final = ".fxstream-rootfs"
# Bumped whenever what build_rootfs puts in a rootfs changes (part of the fingerprint).
_LAYOUT_VERSION: Final = "2"
_ETC_FILES: Final = (
    "passwd",
    "group",
    "nsswitch.conf",
    "hosts",
    "host.conf",
    "resolv.conf",
    "ld.so.cache",
    "ssl/certs/ca-certificates.crt",
)
_BINARIES: Final = ("sh",)
_EMPTY_DIRS: Final = ("tmp", "var/tmp", "run", "proc", "dev", "sys", "root", "home")
_TOP_LEVEL_LINKS: Final = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_ROOTFS_TOP: Final = ("usr", "etc", *_TOP_LEVEL_LINKS)
_LDD_LINE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")


def _python_dirs() -> list[str]:
    return list(dict.fromkeys(os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)))


def _elf_files(roots: Iterable[str]) -> list[str]:
    """The interpreter and every shared object under ``roots``."""
    found = [os.path.realpath(sys.executable)]
    for root in roots:
        for directory, _, names in os.walk(root):
            found += [os.path.join(directory, n) for n in names if n.endswith(".so") or ".so." in n]
    return found


def _closure(files: list[str]) -> set[str]:
    """The shared libraries (and the loader) ``files`` load, as ``ldd`` resolves them."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise ContainerError("building a rootfs needs ldd (Debian's libc-bin): install it")
    libraries: set[str] = set()
    for start in range(0, len(files), 200):
        done = subprocess.run(
            [ldd, *files[start : start + 200]], capture_output=True, text=True, check=False
        )
        libraries.update(match.group(1) for match in _LDD_LINE.finditer(done.stdout))
    return {lib for lib in libraries if os.path.exists(lib)}


def rootfs_fingerprint() -> str:
    """What a rootfs built now depends on: this machine, this interpreter, its libraries."""
    digest = hashlib.sha256()
    parts = (_LAYOUT_VERSION, platform.machine(), sys.version, *_python_dirs())
    for part in (*parts, *_ETC_FILES, *_BINARIES):
        digest.update(part.encode() + b"\0")
    for path in ("/etc/ld.so.cache", os.path.realpath(sys.executable)):
        stat = os.stat(path)
        digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _copy_at_own_path(source: str, rootfs: Path) -> None:
    """Copy ``source`` (followed) into ``rootfs`` at its path (top-level links mirrored)."""
    target = rootfs / os.path.realpath(os.path.dirname(source)).lstrip("/")
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target / os.path.basename(source))


def build_rootfs(destination: str | Path) -> Path:
    """Build (or keep, when current) the minimal rootfs at ``destination``; its path.

    See the module notes for what it holds. Building takes a few seconds.
    """
    rootfs = Path(destination).resolve()
    fingerprint = rootfs_fingerprint()
    marker = rootfs / _MARKER
    if marker.is_file() and marker.read_text().strip() == fingerprint:
        return rootfs
    rootfs.parent.mkdir(parents=True, exist_ok=True)
    # Two processes (a test session and an operator, say) may build it at once: one does.
    with open(rootfs.parent / f".{rootfs.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and marker.read_text().strip() == fingerprint:
            return rootfs
        _build(rootfs, fingerprint)
    return rootfs


def _build(rootfs: Path, fingerprint: str) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{rootfs.name}.", dir=rootfs.parent))
    try:
        for name in _TOP_LEVEL_LINKS:  # merged /usr: /lib -> usr/lib and the like
            host = Path("/", name)
            if host.is_symlink():
                (staging / name).symlink_to(os.readlink(host))
        for name in _EMPTY_DIRS:
            (staging / name).mkdir(parents=True, exist_ok=True)
        (staging / "tmp").chmod(0o1777)
        (staging / "var/tmp").chmod(0o1777)
        python_dirs = _python_dirs()
        # Where this Python lives under the rootfs's own directories (a Debian python3 in
        # /usr, say), the image keeps an empty place for bubblewrap to bind it over.
        for path in [*python_dirs, *(os.path.realpath(p) for p in sys.path if p)]:
            top = path.strip("/").split("/")[0]
            if top in _ROOTFS_TOP and os.path.isdir(path):
                (staging / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
        binaries = [b for b in (shutil.which(n) for n in _BINARIES) if b is not None]
        for library in sorted(_closure(_elf_files(python_dirs) + binaries)):
            if not any(os.path.realpath(library).startswith(d + os.sep) for d in python_dirs):
                _copy_at_own_path(library, staging)
        for binary in binaries:
            _copy_at_own_path(binary, staging)
        for name in _ETC_FILES:
            source = Path("/etc", name)
            if source.exists():
                (staging / "etc" / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, staging / "etc" / name)
        staging.chmod(0o755)
        (staging / _MARKER).write_text(fingerprint + "\n")
        shutil.rmtree(rootfs, ignore_errors=True)
        staging.rename(rootfs)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _image_exists(binary: str, tag: str) -> bool:
    done = subprocess.run(
        [binary, "image", "inspect", tag], capture_output=True, text=True, check=False
    )
    return done.returncode == 0


def build_podman_image(
    rootfs: str | Path,
    repository: str = DEFAULT_IMAGE_REPOSITORY,
    *,
    binary: str = "podman",
) -> str:
    """Import ``rootfs`` (built by :func:`build_rootfs`) as a local image; its tag.

    The tag is the rootfs's fingerprint, so an image that exists already is
    kept. ``binary`` may be ``docker`` where a Docker daemon answers.
    """
    root = Path(rootfs)
    marker = root / _MARKER
    if not marker.is_file():
        raise ContainerError(f"{root} is not a rootfs build_rootfs made (no {_MARKER})")
    tag = f"{repository}:{marker.read_text().strip()}"
    runtime = shutil.which(binary)
    if runtime is None:
        raise ContainerError(f"{binary} is not installed: apt-get install -y {binary}")
    if _image_exists(runtime, tag):
        return tag
    with tempfile.TemporaryDirectory(prefix="fxstream-image-") as scratch:
        archive = os.path.join(scratch, "rootfs.tar")
        with tarfile.open(archive, "w") as tar:
            for entry in sorted(root.iterdir()):
                if entry.name != _MARKER:
                    tar.add(entry, arcname=entry.name)
        done = subprocess.run(
            [runtime, "import", "--message", "fxstream worker rootfs", archive, tag],
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise ContainerError(
            f"{binary} import of {root} failed (exit {done.returncode}): {done.stderr.strip()}"
        )
    return tag
