"""Where the router and the ingress get the service's routing keys, and what to do without.

The router stamps every dispatch and the ingress verifies every result and task event
with the routing keys (:mod:`fxstream.topics.routing_stamp`). They live in one 0600 JSON
file, named to a processor by ``--routing-keys FILE`` or the ``FXSTREAM_ROUTING_KEYS``
variable: never a key on a command line, in a record or in a log (only key ids, which
are not secret, are ever shown). ``./fx up`` makes ``<home>/credentials/routing-keys.json``
at its first start and passes it to the router and ingress processes; elsewhere
``fxstream-service routing-keys FILE`` makes one. There is no default key: a router or
ingress without a readable file does not start, and says what to run.

Both re-read the file when it changes, without a restart (:class:`RoutingKeyFile`): it is
looked at (``stat``) at most once a second, and read again when its inode, size, times or
mode changed, with the same checks as at start (0600, the format). So a rotation
(``fxstream-service routing-keys FILE --rotate``) reaches the routers and the ingresses
within about a second, in any order: an ingress handed a stamp under a key id it does not
hold looks at the file again at once (:meth:`RoutingKeyFile.recheck`, never waiting)
before refusing it. A new file that fails the checks is logged as an error
and the last good keys stay in use (the process neither stops nor takes the bad file);
fixing the file is picked up the same way.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection
from pathlib import Path
from typing import Final

from fxstream.topics import (
    ROUTING_KEYS_ENV,
    CredentialFileError,
    RoutingKeys,
    read_routing_keys,
)

__all__ = [
    "CHECK_INTERVAL_S",
    "ROLES_WITH_KEYS",
    "RoutingKeyFile",
    "RoutingKeysUnavailable",
    "routing_keys_for",
]

log = logging.getLogger(__name__)

ROLES_WITH_KEYS: Final = frozenset({"router", "ingress"})
"""The processors that read the routing keys (the others never open the file)."""
CHECK_INTERVAL_S: Final = 1.0
"""The least time between two looks (``stat``) at the routing keys file, on the monotonic
clock: a change reaches the router and the ingress within about this."""

# What says that the file changed: its device and inode (a rename into place, as
# write_secret_file does), size, modification and change times, and mode (a chmod); or
# the error of a stat that failed (a deleted file), so the same error is logged once.
_Fingerprint = tuple[int, ...] | str


def _fingerprint(path: Path) -> _Fingerprint:
    """What :class:`RoutingKeyFile` compares to notice a change of ``path``."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"cannot stat {path}: {exc.strerror or exc}"
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


class RoutingKeyFile:
    """The routing keys of a 0600 file, re-read when the file changes (no restart needed).

    :meth:`current` looks at the file at most once per ``check_interval_s`` (monotonic
    clock) and reads it again when it changed, with :func:`~fxstream.topics.read_routing_keys`'s
    checks (owner-only mode, the format). A file that fails them is logged as an error,
    once per change, and the last good keys stay in use; they are never replaced by an
    unreadable file's. Only key ids are logged, never a key. For one event loop (the
    router's and the ingress's): not thread-safe.
    """

    def __init__(self, path: Path, *, check_interval_s: float = CHECK_INTERVAL_S) -> None:
        """Read ``path`` now. Raises :class:`~fxstream.topics.CredentialFileError` if it is
        missing, readable by others or malformed (:func:`routing_keys_for` adds the remedy)."""
        if check_interval_s < 0:
            raise ValueError(f"check_interval_s must be 0 or more; got {check_interval_s}")
        self._path = path
        self._interval = check_interval_s
        self._checked_at = time.monotonic()
        self._seen = _fingerprint(path)
        self._keys = read_routing_keys(path)
        self._failing = False  # the last read after a change failed

    @property
    def path(self) -> Path:
        """The file."""
        return self._path

    @property
    def keys(self) -> RoutingKeys:
        """The last good keys, without looking at the file."""
        return self._keys

    def current(self) -> RoutingKeys:
        """The last good keys, after looking at the file if ``check_interval_s`` has passed
        since the last look (and reading it again if it changed)."""
        if time.monotonic() - self._checked_at >= self._interval:
            self._check()
        return self._keys

    def recheck(self) -> RoutingKeys:
        """The last good keys after looking at the file now, whatever the interval (one
        ``stat``; the file is read again only if it changed).

        For a verifier handed a stamp under a key id it does not hold: the stamp was made
        with a key the file held when its router looked (the file is replaced whole, by a
        rename), so if the file as it is now holds no such key, the key was retired (or
        never the platform's). Never waits: a flood of stamps under made-up key ids costs
        one ``stat`` a batch, not a stalled ingress.
        """
        self._check()
        return self._keys

    def _check(self) -> None:
        """Look at the file; read it again if it changed since the last look."""
        self._checked_at = time.monotonic()
        fingerprint = _fingerprint(self._path)
        if fingerprint == self._seen:
            return
        self._seen = fingerprint
        still = (
            f"still using the last good keys (signing {self._keys.signing.key_id}; "
            f"accepted {', '.join(self._keys.key_ids)})"
        )
        was_failing, self._failing = self._failing, True
        if isinstance(fingerprint, str):
            log.error("routing keys changed but cannot be read: %s; %s", fingerprint, still)
            return
        try:
            keys = read_routing_keys(self._path)
        except CredentialFileError as exc:
            log.error("routing keys changed but cannot be read: %s; %s", exc, still)
            return
        except Exception as exc:  # never crash the router or the ingress over the file
            # The type only: an unforeseen error's message might quote the file.
            log.error(
                "routing keys changed but cannot be read (%s): %s; %s",
                type(exc).__name__,
                self._path,
                still,
            )
            return
        self._failing = False
        if keys != self._keys or was_failing:
            retired = ", ".join(k.key_id for k in keys.retired) or "none"
            log.info(
                "routing keys re-read from %s: signing key %s; also accepted: %s",
                self._path,
                keys.signing.key_id,
                retired,
            )
        self._keys = keys


class RoutingKeysUnavailable(RuntimeError):
    """The router or the ingress cannot start without routing keys; the message says why and
    what to run."""


def routing_keys_for(roles: Collection[str], path: Path | None) -> RoutingKeyFile | None:
    """The routing keys file ``path``, read now and re-read when it changes
    (:class:`RoutingKeyFile`), if ``roles`` include the router or the ingress (None if they
    include neither: the file is not even opened).

    Raises :class:`RoutingKeysUnavailable` naming the remedy when no file is named, or it is
    missing, readable by others or malformed.
    """
    if not ROLES_WITH_KEYS & set(roles):
        return None
    make = (
        "`./fx up` makes <home>/credentials/routing-keys.json and passes it on; for processors "
        "run by hand, make one with `fxstream-service routing-keys FILE` (owner-only, a new "
        "random key) and pass the same file to every router and ingress"
    )
    if path is None:
        raise RoutingKeysUnavailable(
            "the router and the ingress need the service's routing keys: name the file with "
            f"--routing-keys FILE or ${ROUTING_KEYS_ENV}. {make}"
        )
    try:
        return RoutingKeyFile(path)
    except CredentialFileError as exc:
        if not path.exists():
            remedy = make
        elif "chmod" in str(exc):
            remedy = "its mode must let only its owner read it"
        else:
            remedy = (
                "restore it from the platform's credentials, or replace it with "
                "`fxstream-service routing-keys FILE` (results of tasks routed under the "
                "old keys will then be refused)"
            )
        raise RoutingKeysUnavailable(f"cannot read the routing keys: {exc}. {remedy}") from None
