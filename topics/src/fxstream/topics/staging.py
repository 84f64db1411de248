"""Data staging: the files a task declares to be staged in before it runs and out after.

A task may name input files to copy into its working directory before the function runs
(``TaskSubmission.stage_in``) and output files to copy out of it once the function has
succeeded (``TaskSubmission.stage_out``), as Balsam's transfer slots do. Each is a
:class:`StageItem`: a URL and a path relative to the task's working directory. The agent
stages them (``fxstream.agent.staging``); this module is the wire contract: which URLs
are accepted, and their bounds.

URLs (:func:`parse_stage_url`; every other scheme is refused):

``file:///ABSOLUTE/PATH``
    A file on the endpoint's host (or its shared file system). The endpoint's config
    declares the staging roots such a path must resolve into (symbolic links followed);
    anything outside them is refused there.
``store://NAME``
    A named object in the platform's Redis store (the endpoint's ``store_url``), in the
    submitting user's own namespace: ``NAME`` is 1-256 characters of letters, digits,
    ``.``, ``_``, ``-`` and ``/`` (no empty, ``.`` or ``..`` segment). The SDK writes and
    reads them (``Client.put_object``, ``Client.get_object``).
``globus://COLLECTION/ABSOLUTE/PATH``
    A file on a Globus collection (its UUID), moved with one Globus transfer per
    collection and direction (the endpoint's config names its own collection).

Everything here is hostile input, checked before anything is read or written: at most
:data:`MAX_STAGE_ITEMS` items each way; URLs of at most :data:`MAX_STAGE_URL_CHARS`
characters with no control character, ``%``, ``\\``, ``?`` or ``#`` (nothing is
percent-decoded, so what is checked is what is used), and no empty, ``.`` or ``..``
path segment; local paths relative, of at most :data:`MAX_STAGE_PATH_CHARS` characters
and :data:`MAX_STAGE_PATH_DEPTH` segments of letters, digits and ``._+,=@-`` (never
``.`` or ``..``), so a local path can never leave the task's directory.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, NamedTuple

import msgspec
from msgspec import Meta

__all__ = [
    "MAX_STAGE_ITEMS",
    "MAX_STAGE_PATH_CHARS",
    "MAX_STAGE_PATH_DEPTH",
    "MAX_STAGE_URL_CHARS",
    "MAX_STORE_NAME_CHARS",
    "STAGE_SCHEMES",
    "StageItem",
    "StageURL",
    "check_local_path",
    "parse_stage_url",
]

MAX_STAGE_ITEMS: Final = 32
"""The most files one task may stage in (and, separately, out)."""
MAX_STAGE_URL_CHARS: Final = 1024
"""The longest URL of a staged file."""
MAX_STAGE_PATH_CHARS: Final = 512
"""The longest local path (relative to the task's working directory) of a staged file."""
MAX_STAGE_PATH_DEPTH: Final = 16
"""The most segments of such a local path."""
MAX_STORE_NAME_CHARS: Final = 256
"""The longest name of a ``store://`` object."""
STAGE_SCHEMES: Final = ("file", "store", "globus")
"""The URL schemes a staged file may use."""

_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f%\\?#]")
_LOCAL_SEGMENT = re.compile(r"[A-Za-z0-9._+,=@-]{1,255}")
_STORE_SEGMENT = re.compile(r"[A-Za-z0-9._-]{1,128}")
_COLLECTION = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class StageURL(NamedTuple):
    """A checked staging URL: its scheme, its authority (a Globus collection's UUID, else
    ``""``) and its path (absolute for ``file`` and ``globus``; the name for ``store``)."""

    scheme: str
    authority: str
    path: str


def _segments_ok(segments: list[str]) -> bool:
    return all(s not in ("", ".", "..") for s in segments)


def parse_stage_url(url: str) -> StageURL:
    """Check a staging URL and split it; ``ValueError`` says what is wrong and what is
    accepted (see the module notes)."""
    if not isinstance(url, str) or not url:
        raise ValueError("a staging URL must be a non-empty string")
    shown = url[:120] + ("..." if len(url) > 120 else "")
    if len(url) > MAX_STAGE_URL_CHARS:
        raise ValueError(
            f"staging URL {shown!r} is {len(url)} characters; at most {MAX_STAGE_URL_CHARS}"
        )
    if _FORBIDDEN.search(url):
        raise ValueError(
            f"staging URL {shown!r} holds a control character, '%', '\\', '?' or '#': write "
            "the path as it is (nothing is percent-decoded), without a query or fragment"
        )
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in STAGE_SCHEMES:
        raise ValueError(
            f"staging URL {shown!r}: the scheme must be one of {', '.join(STAGE_SCHEMES)} "
            "(file:///ABSOLUTE/PATH, store://NAME, globus://COLLECTION-UUID/ABSOLUTE/PATH)"
        )
    if scheme == "store":
        segments = rest.split("/")
        if (
            not rest
            or len(rest) > MAX_STORE_NAME_CHARS
            or not _segments_ok(segments)
            or not all(_STORE_SEGMENT.fullmatch(s) for s in segments)
        ):
            raise ValueError(
                f"staging URL {shown!r}: a store object's name is 1-{MAX_STORE_NAME_CHARS} "
                "letters, digits, '.', '_', '-' and '/' with no empty, '.' or '..' segment, "
                "e.g. store://run-42/input.dat"
            )
        return StageURL("store", "", rest)
    authority, slash, path = rest.partition("/")
    path = slash + path
    if scheme == "file" and authority:
        raise ValueError(
            f"staging URL {shown!r}: a file URL names no host: file:///ABSOLUTE/PATH "
            "(three slashes; the file is on the endpoint's host)"
        )
    if scheme == "globus" and not _COLLECTION.fullmatch(authority):
        raise ValueError(
            f"staging URL {shown!r}: a Globus URL is globus://COLLECTION/ABSOLUTE/PATH with "
            "the collection's UUID in lower case"
        )
    segments = path.split("/")[1:]
    if not path or not segments or not _segments_ok(segments):
        raise ValueError(
            f"staging URL {shown!r}: the path must be absolute, name a file, and have no "
            "empty, '.' or '..' segment (no traversal)"
        )
    return StageURL(scheme, authority, path)


def check_local_path(path: str) -> str:
    """Check a staged file's path in the task's working directory; returns it, or raises
    ``ValueError`` saying what is accepted (see the module notes)."""
    if not isinstance(path, str):
        raise ValueError("a staged file's local path must be a string")
    segments = path.split("/")
    if (
        not path
        or len(path) > MAX_STAGE_PATH_CHARS
        or len(segments) > MAX_STAGE_PATH_DEPTH
        or not _segments_ok(segments)
        or not all(_LOCAL_SEGMENT.fullmatch(s) for s in segments)
    ):
        shown = path[:120]
        raise ValueError(
            f"local path {shown!r}: a staged file's path in the task's directory is relative, "
            f"at most {MAX_STAGE_PATH_CHARS} characters and {MAX_STAGE_PATH_DEPTH} segments "
            "of letters, digits and '._+,=@-' (no empty, '.' or '..' segment), e.g. "
            "inputs/a.dat"
        )
    return path


class StageItem(msgspec.Struct, kw_only=True, frozen=True):
    """One staged file: its ``url`` (where it comes from, or goes to) and its ``path`` in
    the task's working directory. Both are checked when the record is built or decoded
    (:func:`parse_stage_url`, :func:`check_local_path`)."""

    url: Annotated[
        str,
        Meta(
            min_length=1,
            max_length=MAX_STAGE_URL_CHARS,
            description="file:///PATH (inside the endpoint's staging roots), store://NAME "
            "(the submitter's object in the platform's store) or "
            "globus://COLLECTION-UUID/PATH",
        ),
    ]
    path: Annotated[
        str,
        Meta(
            min_length=1,
            max_length=MAX_STAGE_PATH_CHARS,
            description="the file's path relative to the task's working directory",
        ),
    ]

    def __post_init__(self) -> None:
        parse_stage_url(self.url)
        check_local_path(self.path)

    @property
    def parsed(self) -> StageURL:
        """The URL, split (:func:`parse_stage_url`)."""
        return parse_stage_url(self.url)
