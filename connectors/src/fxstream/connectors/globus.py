"""Globus transfers for inter-site bulk data: a transfer helper and a ProxyStore connector.

`GlobusTransferHelper` drives the Globus Transfer API through globus-sdk
(``globus_sdk.TransferClient``): it submits a transfer of files between two
collections (sync level, checksum verification, label, deadline), waits for
the task with a timeout and a polling backoff, and turns a failed, faulting
or overdue task into an exception that says what to do.

`GlobusConnector` is a ProxyStore connector for objects that cross sites.
Every site has a Globus collection and a local directory that is the same
storage seen from the file system. ``put`` writes the object into the local
site's directory; ``get`` at another site pulls it from the writer's
collection into its own collection with one Globus transfer, then reads the
file. Nothing is pushed on ``put``: objects move only to sites that read them.

The helper never asks a human: it takes a globus-sdk authorizer
(``AccessTokenAuthorizer`` or ``ClientCredentialsAuthorizer``), and the
connector builds one from `GlobusAuthConfig`, which names where the secret is
(an environment variable or a file), never the secret itself, so a
connector's ``config()`` can travel inside proxies.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal, NamedTuple

import globus_sdk
from globus_sdk.authorizers import GlobusAuthorizer
from globus_sdk.scopes import TransferScopes
from globus_sdk.transport import RetryConfig
from proxystore.serialize import BytesLike

from fxstream.connectors.integrity import sha256_of, verify_digest
from fxstream.topics import StorageTier

__all__ = [
    "DEFAULT_SITE_ENV_VAR",
    "GlobusAuthConfig",
    "GlobusConnector",
    "GlobusKey",
    "GlobusObjectLocation",
    "GlobusSite",
    "GlobusTransferError",
    "GlobusTransferFailed",
    "GlobusTransferFaulted",
    "GlobusTransferHelper",
    "GlobusTransferRejected",
    "GlobusTransferTimeout",
    "SyncLevel",
    "TransferEvent",
    "TransferItem",
    "TransferTaskStatus",
]

logger = logging.getLogger(__name__)

SyncLevel = Literal["exists", "size", "mtime", "checksum"]
"""Globus sync levels: skip a file whose destination already matches by this test."""

DEFAULT_SITE_ENV_VAR = "FXSTREAM_GLOBUS_SITE"
"""Environment variable naming the site a process runs at (see `GlobusConnector`)."""

_SYNC_LEVELS: tuple[str, ...] = ("exists", "size", "mtime", "checksum")
_MAX_LABEL_CHARS = 128  # the Transfer API's limit on task labels
_SITE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_OBJECT_ID = re.compile(r"^[0-9a-f]{32}$")
_MKDIR_EXISTS = "ExternalError.MkdirFailed.Exists"


# --- transfer helper ------------------------------------------------------------------------


class TransferItem(NamedTuple):
    """One file (or, with ``recursive``, directory) to transfer, as paths on the collections."""

    source_path: str
    destination_path: str
    recursive: bool = False


@dataclass(frozen=True)
class TransferEvent:
    """One entry of a task's event list (faults and errors), as the Transfer API reports it."""

    code: str
    description: str
    details: str
    is_error: bool
    time: str

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> TransferEvent:
        """Build from an ``event`` document of ``GET /task/<id>/event_list``."""
        return cls(
            code=str(doc.get("code") or ""),
            description=str(doc.get("description") or ""),
            details=str(doc.get("details") or ""),
            is_error=bool(doc.get("is_error")),
            time=str(doc.get("time") or ""),
        )

    def __str__(self) -> str:
        text = f"{self.code}: {self.description}"
        return f"{text} ({self.details})" if self.details else text


@dataclass(frozen=True)
class TransferTaskStatus:
    """The fields of a Transfer task document that fxstream acts on."""

    task_id: str
    status: str
    """``ACTIVE``, ``INACTIVE``, ``SUCCEEDED`` or ``FAILED``."""
    label: str | None
    nice_status: str | None
    """Globus's short reason while ACTIVE, e.g. ``OK``, ``Queued``, ``PERMISSION_DENIED``."""
    faults: int
    files: int
    files_transferred: int
    files_skipped: int
    bytes_transferred: int
    fatal_error_code: str | None
    fatal_error_description: str | None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> TransferTaskStatus:
        """Build from a ``task`` document (``GET /task/<id>``)."""
        fatal = doc.get("fatal_error") or {}
        return cls(
            task_id=str(doc["task_id"]),
            status=str(doc["status"]),
            label=doc.get("label"),
            nice_status=doc.get("nice_status"),
            faults=int(doc.get("faults") or 0),
            files=int(doc.get("files") or 0),
            files_transferred=int(doc.get("files_transferred") or 0),
            files_skipped=int(doc.get("files_skipped") or 0),
            bytes_transferred=int(doc.get("bytes_transferred") or 0),
            fatal_error_code=fatal.get("code"),
            fatal_error_description=fatal.get("description"),
        )


class GlobusTransferError(RuntimeError):
    """A Globus transfer did not complete; the message says what to do."""

    def __init__(self, message: str, *, task_id: str | None = None) -> None:
        super().__init__(message)
        self.task_id = task_id


class GlobusTransferRejected(GlobusTransferError):
    """The Transfer API refused a request (bad token, unknown collection, bad path...)."""

    def __init__(self, message: str, *, http_status: int, code: str | None) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.code = code


class GlobusTransferFailed(GlobusTransferError):
    """The task ended ``FAILED`` (or stopped ``INACTIVE``, waiting for new credentials)."""

    def __init__(
        self, message: str, *, status: TransferTaskStatus, events: Sequence[TransferEvent]
    ) -> None:
        super().__init__(message, task_id=status.task_id)
        self.status = status
        self.events = list(events)


class GlobusTransferFaulted(GlobusTransferFailed):
    """The task kept faulting (Globus retries faults) beyond ``max_faults``; it was cancelled."""


class GlobusTransferTimeout(GlobusTransferError):
    """The task was still running when the timeout expired."""

    def __init__(self, message: str, *, status: TransferTaskStatus, cancelled: bool) -> None:
        super().__init__(message, task_id=status.task_id)
        self.status = status
        self.cancelled = cancelled


def _activity_link(task_id: str) -> str:
    return f"https://app.globus.org/activity/{task_id}"


def _unreachable(action: str, base_url: str, error: globus_sdk.NetworkError) -> GlobusTransferError:
    return GlobusTransferError(
        f"cannot reach the Globus Transfer API at {base_url} to {action} ({error}). What to "
        "do: check that this host reaches it (network, HTTPS proxy, firewall) and retry"
    )


def _rejection(action: str, error: globus_sdk.GlobusAPIError) -> GlobusTransferRejected:
    """Translate an API error into one that names the likely fix."""
    if error.http_status == 401:
        hint = (
            "the access token is missing, expired or not a Transfer token: provide a fresh "
            f"token with the scope {TransferScopes.all}"
        )
    elif error.http_status == 403:
        hint = (
            "the identity behind the token may not use this collection: grant it access on "
            "the collection (or its data_access consent) in the Globus web app"
        )
    elif error.http_status == 404:
        hint = "check the collection id and the path exist"
    else:
        hint = "see the Globus Transfer API error code above"
    return GlobusTransferRejected(
        f"Globus Transfer refused to {action}: HTTP {error.http_status} {error.code}: "
        f"{error.message}. What to do: {hint}.",
        http_status=error.http_status,
        code=error.code,
    )


class GlobusTransferHelper:
    """Submits and waits for Globus transfers through ``globus_sdk.TransferClient``.

    Args:
        authorizer: How requests are authenticated, e.g.
            ``globus_sdk.AccessTokenAuthorizer(token)`` or
            ``globus_sdk.ClientCredentialsAuthorizer(app_client, TransferScopes.all)``.
        base_url: Transfer API root, for a non-production deployment or a
            local stand-in (tests); ``None`` uses globus-sdk's resolution
            (``environment``, ``GLOBUS_SDK_SERVICE_URL_TRANSFER``, production).
        environment: globus-sdk environment name (``None``: production).
        poll_initial_s: First wait between task status polls.
        poll_max_s: Longest wait between polls (the wait doubles up to it).
        max_faults: Cancel and raise `GlobusTransferFaulted` once a task has
            more faults than this (Globus otherwise retries until the task's
            deadline); ``None`` tolerates any number.
        cancel_on_timeout: Cancel a task still running at the end of ``wait``.
        max_retries: globus-sdk's retries of one request on network errors and
            transient HTTP statuses (``None``: its default, 5, with backoff).
    """

    def __init__(
        self,
        authorizer: GlobusAuthorizer,
        *,
        base_url: str | None = None,
        environment: str | None = None,
        poll_initial_s: float = 1.0,
        poll_max_s: float = 30.0,
        max_faults: int | None = 5,
        cancel_on_timeout: bool = True,
        app_name: str = "fxstream",
        max_retries: int | None = None,
    ) -> None:
        if poll_initial_s <= 0 or poll_max_s < poll_initial_s:
            raise ValueError(
                f"poll intervals must satisfy 0 < poll_initial_s <= poll_max_s, got "
                f"{poll_initial_s} and {poll_max_s}"
            )
        if max_faults is not None and max_faults < 0:
            raise ValueError(f"max_faults must be >= 0 or None, got {max_faults}")
        self.client = globus_sdk.TransferClient(
            authorizer=authorizer,
            base_url=base_url,
            environment=environment,
            app_name=app_name,
            retry_config=RetryConfig()
            if max_retries is None
            else RetryConfig(max_retries=max_retries),
        )
        self.poll_initial_s = poll_initial_s
        self.poll_max_s = poll_max_s
        self.max_faults = max_faults
        self.cancel_on_timeout = cancel_on_timeout

    def close(self) -> None:
        """Release the HTTP session."""
        self.client.close()

    @contextlib.contextmanager
    def _api(self, action: str) -> Iterator[None]:
        """Turn globus-sdk's API and network errors into ones that say what to do."""
        try:
            yield
        except globus_sdk.GlobusAPIError as error:
            raise _rejection(action, error) from error
        except globus_sdk.NetworkError as error:
            raise _unreachable(action, self.client.base_url, error) from error

    def submit(
        self,
        source_collection: str,
        destination_collection: str,
        items: Iterable[TransferItem | tuple[str, str]],
        *,
        label: str | None = None,
        sync_level: SyncLevel | None = None,
        verify_checksum: bool = True,
        preserve_timestamp: bool = False,
        deadline: datetime.datetime | None = None,
        fail_on_quota_errors: bool = True,
    ) -> str:
        """Submit one transfer task for ``items``; return its task id.

        ``sync_level`` skips files whose destination already matches
        (``exists`` < ``size`` < ``mtime`` < ``checksum``); ``None`` always
        copies. ``verify_checksum`` makes Globus checksum source and
        destination after copying and retry on a mismatch.
        """
        transfer_items = [TransferItem(*item) for item in items]
        if not transfer_items:
            raise ValueError("a Globus transfer needs at least one item (source, destination)")
        if sync_level is not None and sync_level not in _SYNC_LEVELS:
            raise ValueError(
                f"sync_level must be one of {_SYNC_LEVELS} or None, got {sync_level!r}"
            )
        if label is not None and len(label) > _MAX_LABEL_CHARS:
            raise ValueError(
                f"Globus task labels are at most {_MAX_LABEL_CHARS} characters, got {len(label)}"
            )
        data = globus_sdk.TransferData(
            source_collection,
            destination_collection,
            label=label if label is not None else globus_sdk.MISSING,
            sync_level=sync_level if sync_level is not None else globus_sdk.MISSING,
            verify_checksum=verify_checksum,
            preserve_timestamp=preserve_timestamp,
            deadline=deadline if deadline is not None else globus_sdk.MISSING,
            fail_on_quota_errors=fail_on_quota_errors,
        )
        for item in transfer_items:
            data.add_item(item.source_path, item.destination_path, recursive=item.recursive)
        with self._api(f"submit a transfer {source_collection} -> {destination_collection}"):
            response = self.client.submit_transfer(data)
        task_id = str(response["task_id"])
        logger.debug("submitted Globus transfer %s (%d items)", task_id, len(transfer_items))
        return task_id

    def delete(
        self,
        collection: str,
        paths: Iterable[str],
        *,
        label: str | None = None,
        ignore_missing: bool = True,
    ) -> str:
        """Submit a delete task for ``paths`` on ``collection``; return its task id."""
        data = globus_sdk.DeleteData(
            collection,
            label=label if label is not None else globus_sdk.MISSING,
            ignore_missing=ignore_missing,
        )
        count = 0
        for path in paths:
            data.add_item(path)
            count += 1
        if count == 0:
            raise ValueError("a Globus delete needs at least one path")
        with self._api(f"submit a delete on {collection}"):
            response = self.client.submit_delete(data)
        return str(response["task_id"])

    def status(self, task_id: str) -> TransferTaskStatus:
        """The task's current status document."""
        with self._api(f"read task {task_id}"):
            return TransferTaskStatus.from_document(self.client.get_task(task_id).data)

    def events(self, task_id: str, *, limit: int = 10) -> list[TransferEvent]:
        """The task's latest events (faults, errors), newest first."""
        with self._api(f"read the events of task {task_id}"):
            response = self.client.task_event_list(task_id, limit=limit)
        return [TransferEvent.from_document(doc) for doc in response]

    def cancel(self, task_id: str) -> None:
        """Ask Globus to cancel the task (it then ends ``FAILED``)."""
        with self._api(f"cancel task {task_id}"):
            self.client.cancel_task(task_id)

    def wait(self, task_id: str, *, timeout_s: float) -> TransferTaskStatus:
        """Poll the task until it succeeds; raise if it fails, keeps faulting or times out.

        The poll interval starts at ``poll_initial_s`` and doubles up to
        ``poll_max_s``, so short transfers return quickly and long ones do not
        hammer the API.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        deadline = time.monotonic() + timeout_s
        interval = self.poll_initial_s
        while True:
            status = self.status(task_id)
            if status.status == "SUCCEEDED":
                return status
            if status.status == "FAILED":
                raise self._failed(status)
            if status.status == "INACTIVE":
                raise GlobusTransferFailed(
                    f"Globus task {task_id} is INACTIVE ({status.nice_status}): Globus paused "
                    "it because the credentials for a collection expired or consent is "
                    "missing. What to do: re-authenticate or grant data_access consent for "
                    f"the collections, then resume it at {_activity_link(task_id)}.",
                    status=status,
                    events=self.events(task_id),
                )
            if self.max_faults is not None and status.faults > self.max_faults:
                self.cancel(task_id)
                events = self.events(task_id)
                raise GlobusTransferFaulted(
                    f"Globus task {task_id} hit {status.faults} faults (max_faults="
                    f"{self.max_faults}), last reason {status.nice_status}; it was cancelled. "
                    f"Latest events: {_summarise(events)}. What to do: fix the cause "
                    "(permissions on the collections, paths, a collection that is down) and "
                    "resubmit, or raise max_faults to let Globus keep retrying.",
                    status=status,
                    events=events,
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                cancelled = False
                if self.cancel_on_timeout:
                    self.cancel(task_id)
                    cancelled = True
                raise GlobusTransferTimeout(
                    f"Globus task {task_id} was still {status.status} "
                    f"({status.nice_status}, {status.faults} faults, "
                    f"{status.bytes_transferred} bytes moved) after {timeout_s:g} s"
                    f"{'; it was cancelled' if cancelled else ''}. What to do: raise the "
                    "timeout for large data or busy collections, or look at the task at "
                    f"{_activity_link(task_id)}.",
                    status=status,
                    cancelled=cancelled,
                )
            time.sleep(min(interval, remaining))
            interval = min(interval * 2, self.poll_max_s)

    def _failed(self, status: TransferTaskStatus) -> GlobusTransferFailed:
        events = self.events(status.task_id)
        reason = (
            f"{status.fatal_error_code}: {status.fatal_error_description}"
            if status.fatal_error_code
            else str(status.nice_status)
        )
        return GlobusTransferFailed(
            f"Globus task {status.task_id} FAILED: {reason}. Latest events: "
            f"{_summarise(events)}. What to do: check that the source paths exist, that the "
            "identity behind the token can read the source and write the destination "
            f"collection, and see {_activity_link(status.task_id)}.",
            status=status,
            events=events,
        )

    def transfer(
        self,
        source_collection: str,
        destination_collection: str,
        items: Iterable[TransferItem | tuple[str, str]],
        *,
        timeout_s: float,
        label: str | None = None,
        sync_level: SyncLevel | None = None,
        verify_checksum: bool = True,
        preserve_timestamp: bool = False,
        deadline: datetime.datetime | None = None,
    ) -> TransferTaskStatus:
        """Submit a transfer and wait for it (see `submit` and `wait`)."""
        task_id = self.submit(
            source_collection,
            destination_collection,
            items,
            label=label,
            sync_level=sync_level,
            verify_checksum=verify_checksum,
            preserve_timestamp=preserve_timestamp,
            deadline=deadline,
        )
        return self.wait(task_id, timeout_s=timeout_s)

    def stat(self, collection: str, path: str) -> dict[str, Any] | None:
        """The file document of ``path`` on ``collection``, or ``None`` if it does not exist."""
        with self._api(f"stat {path} on {collection}"):
            try:
                response = self.client.operation_stat(collection, path)
            except globus_sdk.GlobusAPIError as error:
                if error.http_status == 404 and error.code in ("NotFound", "ClientError.NotFound"):
                    return None
                raise
        return dict(response.data)

    def mkdir(self, collection: str, path: str) -> None:
        """Create a directory on ``collection``; an existing one is fine."""
        with self._api(f"create directory {path} on {collection}"):
            try:
                self.client.operation_mkdir(collection, path)
            except globus_sdk.GlobusAPIError as error:
                if error.code != _MKDIR_EXISTS:
                    raise


def _summarise(events: Sequence[TransferEvent], limit: int = 3) -> str:
    errors = [event for event in events if event.is_error] or list(events)
    if not errors:
        return "none"
    return "; ".join(str(event) for event in errors[:limit])


# --- authentication ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GlobusAuthConfig:
    """Where the Globus credentials are: names of env vars or files, never the secrets.

    Give either an access token (``access_token_env`` or
    ``access_token_file``: a Transfer access token, e.g. from
    ``globus login`` or an app's token storage) or a confidential client
    (``client_id`` with ``client_secret_env`` or ``client_secret_file``),
    which mints Transfer tokens itself through the client-credentials
    grant. ``auth_base_url`` points at a non-production Globus Auth.
    """

    access_token_env: str | None = None
    access_token_file: str | None = None
    client_id: str | None = None
    client_secret_env: str | None = None
    client_secret_file: str | None = None
    auth_base_url: str | None = None

    def __post_init__(self) -> None:
        token_sources = [self.access_token_env, self.access_token_file]
        secret_sources = [self.client_secret_env, self.client_secret_file]
        uses_token = any(source is not None for source in token_sources)
        uses_client = self.client_id is not None or any(s is not None for s in secret_sources)
        if uses_token == uses_client:
            raise ValueError(
                "GlobusAuthConfig needs exactly one kind of credential: access_token_env or "
                "access_token_file (a Transfer access token), or client_id with "
                "client_secret_env or client_secret_file (a confidential client)"
            )
        if uses_token and all(source is not None for source in token_sources):
            raise ValueError("give access_token_env or access_token_file, not both")
        if uses_client:
            if self.client_id is None:
                raise ValueError("client_secret_env/client_secret_file need client_id too")
            if sum(source is not None for source in secret_sources) != 1:
                raise ValueError(
                    "a confidential client needs exactly one of client_secret_env or "
                    "client_secret_file"
                )

    def to_dict(self) -> dict[str, str]:
        """The non-empty fields, for a connector's ``config()``."""
        return {name: value for name, value in vars(self).items() if value is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GlobusAuthConfig:
        """Inverse of `to_dict`."""
        return cls(**{str(name): str(value) for name, value in data.items()})

    def authorizer(self) -> GlobusAuthorizer:
        """Read the secret now and build the globus-sdk authorizer for Transfer requests."""
        if self.client_id is not None:
            secret = _read_secret(self.client_secret_env, self.client_secret_file, "client secret")
            app = globus_sdk.ConfidentialAppAuthClient(
                self.client_id, secret, base_url=self.auth_base_url, app_name="fxstream"
            )
            return globus_sdk.ClientCredentialsAuthorizer(app, TransferScopes.all)
        token = _read_secret(self.access_token_env, self.access_token_file, "access token")
        return globus_sdk.AccessTokenAuthorizer(token)


def _read_secret(env_name: str | None, file_name: str | None, what: str) -> str:
    if env_name is not None:
        value = os.environ.get(env_name, "").strip()
        if not value:
            raise GlobusTransferError(
                f"the Globus {what} is expected in the environment variable {env_name}, "
                f"which is unset or empty: export {env_name}=<{what}> in this process"
            )
        return value
    assert file_name is not None
    path = Path(file_name).expanduser()
    try:
        value = path.read_text().strip()
    except OSError as error:
        raise GlobusTransferError(
            f"cannot read the Globus {what} from {path} ({error.strerror}): write it there "
            "(mode 600) or configure another source"
        ) from error
    if not value:
        raise GlobusTransferError(f"the Globus {what} file {path} is empty: write the {what} there")
    return value


# --- connector --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GlobusSite:
    """One site's storage: a Globus collection and the same directory seen locally.

    Args:
        name: The site's name (e.g. an endpoint id), used in keys.
        collection_id: The Globus collection (UUID) that serves the directory.
        collection_path: The directory as a path on the collection (as the
            Globus web app shows it, e.g. ``/~/fxstream`` or ``/projects/x/fxstream``).
        local_path: The same directory as processes at the site see it.
    """

    name: str
    collection_id: str
    collection_path: str
    local_path: str

    def __post_init__(self) -> None:
        if not _SITE_NAME.match(self.name):
            raise ValueError(
                f"site name {self.name!r} must be 1-128 letters, digits, '_', '.' or '-'"
            )
        if not self.collection_path.startswith("/"):
            raise ValueError(
                f"site {self.name}: collection_path {self.collection_path!r} must be absolute "
                "on the collection (start with '/', e.g. '/~/fxstream')"
            )

    def collection_file(self, name: str) -> str:
        """The path of file ``name`` in this site's directory, on the collection."""
        return str(PurePosixPath(self.collection_path) / name)

    def local_file(self, name: str) -> Path:
        """The path of file ``name`` in this site's directory, locally."""
        return Path(self.local_path) / name

    def to_dict(self) -> dict[str, str]:
        """Plain fields, for a connector's ``config()``."""
        return dict(vars(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GlobusSite:
        """Inverse of `to_dict`."""
        return cls(**{str(name): str(value) for name, value in data.items()})


class GlobusKey(NamedTuple):
    """Key of an object in a `GlobusConnector`: its id, the site that wrote it, and the
    SHA-256 of its bytes (checked by :meth:`GlobusConnector.get` before they are used, so a
    copy altered on any collection on the way is refused)."""

    object_id: str
    site: str
    sha256: str = ""


@dataclass(frozen=True)
class GlobusObjectLocation:
    """Where an object lives, for the ``data-locations`` topic (the caller publishes it)."""

    key: str
    """The object key as one string, ``globus:<site>:<object id>``."""
    size_bytes: int
    tier: StorageTier
    site: str
    collection_id: str
    path: str
    """The object's path on the collection."""


class GlobusConnector:
    """ProxyStore connector that moves objects between sites with Globus transfers.

    Objects are files on a collection's storage, which survives restarts and
    is reachable from the whole site: the connector's ``tier`` is durable.

    ``put`` writes the object as a file in the local site's directory (no
    transfer). ``get`` of an object written at another site stats it on the
    writer's collection, transfers it into the local site's collection
    (verified by checksum) and reads the local copy, which later gets reuse.
    ``evict`` removes the local copy and, for another site's object, submits
    a Globus delete on the writer's collection and waits for it.

    The local site is ``local_site`` if given, else the environment variable
    named by ``site_env_var`` (default ``FXSTREAM_GLOBUS_SITE``), else
    ``default_site``. ``config()`` records the writer's site as
    ``default_site``, so a proxy resolved elsewhere rebuilds the connector for
    the site its process declares in that variable.

    Args:
        sites: Every site's collection and directory (`GlobusSite` or its dict).
        local_site: Name of the site this process runs at.
        auth: Credentials source (`GlobusAuthConfig` or its dict); read only
            when a transfer is needed, so writing locally needs no token.
        transfer_base_url: Transfer API root (``None``: production Globus).
        environment: globus-sdk environment name.
        timeout_s: Longest wait for one transfer or delete task.
        poll_initial_s: First poll interval of a wait (see `GlobusTransferHelper`).
        poll_max_s: Longest poll interval.
        max_faults: Faults tolerated per task before it is cancelled.
        verify_checksum: Ask Globus to verify checksums of every transfer.
        default_site: Site used when neither ``local_site`` nor the variable is set.
        site_env_var: Name of the variable that declares the local site.
    """

    tier = StorageTier.DURABLE
    """Collections are shared, persistent storage (see `fxstream.topics.StorageTier`)."""

    def __init__(
        self,
        sites: Sequence[GlobusSite | Mapping[str, Any]],
        local_site: str | None = None,
        *,
        auth: GlobusAuthConfig | Mapping[str, Any],
        transfer_base_url: str | None = None,
        environment: str | None = None,
        timeout_s: float = 3600.0,
        poll_initial_s: float = 1.0,
        poll_max_s: float = 30.0,
        max_faults: int | None = 5,
        verify_checksum: bool = True,
        default_site: str | None = None,
        site_env_var: str = DEFAULT_SITE_ENV_VAR,
    ) -> None:
        parsed = [s if isinstance(s, GlobusSite) else GlobusSite.from_dict(s) for s in sites]
        self.sites: dict[str, GlobusSite] = {}
        for site in parsed:
            if site.name in self.sites:
                raise ValueError(f"site {site.name!r} is listed twice")
            self.sites[site.name] = site
        chosen = local_site or os.environ.get(site_env_var) or default_site
        if chosen is None:
            raise ValueError(
                "GlobusConnector does not know which site it runs at: pass local_site, or set "
                f"the environment variable {site_env_var} to one of {sorted(self.sites)}"
            )
        if chosen not in self.sites:
            raise ValueError(
                f"local site {chosen!r} is not among the configured sites {sorted(self.sites)}: "
                "add it to sites or fix local_site / " + site_env_var
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.local = self.sites[chosen]
        self.auth = auth if isinstance(auth, GlobusAuthConfig) else GlobusAuthConfig.from_dict(auth)
        self.transfer_base_url = transfer_base_url
        self.environment = environment
        self.timeout_s = timeout_s
        self.poll_initial_s = poll_initial_s
        self.poll_max_s = poll_max_s
        self.max_faults = max_faults
        self.verify_checksum = verify_checksum
        self.site_env_var = site_env_var
        self._helper: GlobusTransferHelper | None = None
        Path(self.local.local_path).mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"GlobusConnector(local_site={self.local.name!r}, sites={sorted(self.sites)})"

    @property
    def helper(self) -> GlobusTransferHelper:
        """The transfer helper, built on first use (that is when the credentials are read)."""
        if self._helper is None:
            self._helper = GlobusTransferHelper(
                self.auth.authorizer(),
                base_url=self.transfer_base_url,
                environment=self.environment,
                poll_initial_s=self.poll_initial_s,
                poll_max_s=self.poll_max_s,
                max_faults=self.max_faults,
            )
        return self._helper

    # -- ProxyStore Connector protocol --

    def close(self) -> None:
        """Close the HTTP session. Objects stay: their lifetime is managed by ``evict``."""
        if self._helper is not None:
            self._helper.close()
            self._helper = None

    def config(self) -> dict[str, Any]:
        """Constructor arguments that rebuild this connector; secrets are referenced, not copied."""
        return {
            "sites": [site.to_dict() for site in self.sites.values()],
            "auth": self.auth.to_dict(),
            "transfer_base_url": self.transfer_base_url,
            "environment": self.environment,
            "timeout_s": self.timeout_s,
            "poll_initial_s": self.poll_initial_s,
            "poll_max_s": self.poll_max_s,
            "max_faults": self.max_faults,
            "verify_checksum": self.verify_checksum,
            "default_site": self.local.name,
            "site_env_var": self.site_env_var,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GlobusConnector:
        """Rebuild from `config`; the local site comes from the site variable if set."""
        return cls(**config)

    def put(self, obj: BytesLike) -> GlobusKey:
        """Write ``obj`` into the local site's directory."""
        key = GlobusKey(object_id=uuid.uuid4().hex, site=self.local.name, sha256=sha256_of(obj))
        self._write_local(key.object_id, obj)
        return key

    def put_batch(self, objs: Sequence[BytesLike]) -> list[GlobusKey]:
        """Write each object into the local site's directory."""
        return [self.put(obj) for obj in objs]

    def get(self, key: GlobusKey) -> BytesLike | None:
        """The object's bytes, transferring it from its site first if it is elsewhere."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[GlobusKey]) -> list[BytesLike | None]:
        """The objects' bytes; missing local copies are fetched with one transfer per site.

        Raises :class:`~fxstream.connectors.integrity.StoreIntegrityError` for an
        object whose bytes are not those written (or whose key has no digest).
        """
        by_site: dict[str, list[GlobusKey]] = {}
        for key in keys:
            self._check_key(key)
            if key.site != self.local.name and not self._local_file(key).exists():
                by_site.setdefault(key.site, []).append(key)
        for site_name, missing in by_site.items():
            self._fetch(self.sites[site_name], missing)
        results: list[BytesLike | None] = []
        for key in keys:
            path = self._local_file(key)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                results.append(None)
                continue
            verify_digest(sha256_of(data), key.sha256, key=str(path), store=repr(self))
            results.append(data)
        return results

    def exists(self, key: GlobusKey) -> bool:
        """Whether the object exists here or on its site's collection."""
        self._check_key(key)
        if self._local_file(key).exists():
            return True
        if key.site == self.local.name:
            return False
        site = self.sites[key.site]
        return self.helper.stat(site.collection_id, site.collection_file(key.object_id)) is not None

    def evict(self, key: GlobusKey) -> None:
        """Delete the object here and, if another site wrote it, on that site's collection."""
        self._check_key(key)
        with contextlib.suppress(FileNotFoundError):
            self._local_file(key).unlink()
        if key.site != self.local.name:
            site = self.sites[key.site]
            task_id = self.helper.delete(
                site.collection_id,
                [site.collection_file(key.object_id)],
                label=f"fxstream evict {key.object_id}",
            )
            self.helper.wait(task_id, timeout_s=self.timeout_s)

    # -- data locations --

    def object_key(self, key: GlobusKey) -> str:
        """The key as data-locations names it: ``globus:<site>:<object id>``."""
        return f"globus:{key.site}:{key.object_id}"

    def size_of(self, key: GlobusKey) -> int:
        """The size in bytes of the object's copy at this site (``FileNotFoundError`` if none)."""
        self._check_key(key)
        return self._local_file(key).stat().st_size

    def describe(self, key: GlobusKey) -> GlobusObjectLocation:
        """Where the object is and its size, for the ``data-locations`` publisher.

        Describes the local copy (the object's own file at its site, or the
        copy fetched here). Raises ``FileNotFoundError`` if there is none.
        """
        return GlobusObjectLocation(
            key=self.object_key(key),
            size_bytes=self.size_of(key),
            tier=self.tier,
            site=self.local.name,
            collection_id=self.local.collection_id,
            path=self.local.collection_file(key.object_id),
        )

    # -- internals --

    def _check_key(self, key: GlobusKey) -> None:
        if not _OBJECT_ID.match(key.object_id):
            raise ValueError(f"{key!r} is not a GlobusConnector key (object_id is 32 hex digits)")
        if key.site not in self.sites:
            raise ValueError(
                f"object {key.object_id} was written at site {key.site!r}, which this "
                f"connector does not know (sites: {sorted(self.sites)}): add that site's "
                "collection to sites"
            )

    def _local_file(self, key: GlobusKey) -> Path:
        return self.local.local_file(key.object_id)

    def _write_local(self, name: str, obj: BytesLike) -> None:
        # Written under a temporary name and renamed, so a reader (or a Globus
        # transfer out of this directory) never sees half an object.
        final = self.local.local_file(name)
        partial = final.with_name(f".{name}.{uuid.uuid4().hex[:8]}.partial")
        with open(partial, "wb") as handle:
            handle.write(obj)
        os.replace(partial, final)

    def _fetch(self, source: GlobusSite, keys: Sequence[GlobusKey]) -> None:
        """Transfer ``keys`` from ``source`` into the local directory, one task for all."""
        present: list[GlobusKey] = []
        for key in keys:
            if self.helper.stat(source.collection_id, source.collection_file(key.object_id)):
                present.append(key)
        if not present:
            return
        # Land under temporary names, then rename: two readers at this site
        # fetching the same object never read each other's partial file.
        suffix = uuid.uuid4().hex[:8]
        items = [
            TransferItem(
                source.collection_file(key.object_id),
                self.local.collection_file(f".{key.object_id}.{suffix}.incoming"),
            )
            for key in present
        ]
        incoming = [self.local.local_file(f".{key.object_id}.{suffix}.incoming") for key in present]
        try:
            self.helper.transfer(
                source.collection_id,
                self.local.collection_id,
                items,
                timeout_s=self.timeout_s,
                label=f"fxstream {source.name} to {self.local.name}",
                verify_checksum=self.verify_checksum,
            )
        except BaseException:
            for path in incoming:  # a failed or cancelled task may leave partial files
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            raise
        for key, path in zip(present, incoming, strict=True):
            os.replace(path, self._local_file(key))
