"""Staged files on the wire (issue 16): which URLs and local paths a submission may carry.

Pure unit tests (no broker, no Redis): every URL and local path is hostile input, checked
when the record is built and again when it is decoded, so a hand-made record cannot slip
a traversal past the SDK's checks.
"""

from __future__ import annotations

import time

import msgspec
import pytest

from fxstream.topics import (
    MAX_STAGE_ITEMS,
    ClientInfo,
    RecordDecodeError,
    StageItem,
    StageURL,
    TaskSubmission,
    check_local_path,
    decode,
    encode,
    parse_stage_url,
)
from fxstream.topics.staging import (
    MAX_STAGE_PATH_CHARS,
    MAX_STAGE_PATH_DEPTH,
    MAX_STAGE_URL_CHARS,
)

COLLECTION = "6c54cade-bde5-45c1-bdea-f4bd71dba2cc"


def submission(**fields: object) -> TaskSubmission:
    """A valid submission with ``fields`` on top."""
    return TaskSubmission(
        task_id="0b9c6a36-2f52-4c1e-9a0e-3f2c1d4e5f60",
        function_id="fn-1",
        endpoint_id="ep-1",
        user_id="alice",
        function_sha256="c" * 64,
        payload=b"p",
        client=ClientInfo(python_version="3.11.7", fxstream_version="0.1.0"),
        submitted_at=time.time(),
        **fields,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        ("file:///data/in/a.dat", StageURL("file", "", "/data/in/a.dat")),
        ("store://run-42/input.dat", StageURL("store", "", "run-42/input.dat")),
        (f"globus://{COLLECTION}/~/runs/a.h5", StageURL("globus", COLLECTION, "/~/runs/a.h5")),
    ],
)
def test_accepted_urls_split_into_scheme_authority_and_path(url: str, parsed: StageURL) -> None:
    assert parse_stage_url(url) == parsed
    assert StageItem(url=url, path="a.dat").parsed == parsed


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://example.org/a", "scheme must be one of"),
        ("s3://bucket/a", "scheme must be one of"),
        ("/data/in/a.dat", "scheme must be one of"),
        ("file://host/data/a", "names no host"),
        ("file:///data/../etc/passwd", "no traversal"),
        ("file:///data/./a", "no traversal"),
        ("file:///data//a", "no traversal"),
        ("file:///data/in/", "no traversal"),
        ("file:///", "no traversal"),
        ("file://", "no traversal"),
        ("file:///data/%2e%2e/etc/passwd", "nothing is percent-decoded"),
        ("file:///data/a?x=1", "without a query"),
        ("file:///data/a#frag", "without a query"),
        ("file:///data/a\x00.dat", "control character"),
        ("file:///data/a\nb", "control character"),
        ("file:///data\\..\\a", "'\\'"),
        ("store://", "store object's name"),
        ("store://../other-user/x", "store object's name"),
        ("store://a//b", "store object's name"),
        ("store://a/b c", "store object's name"),
        ("store://" + "a" * 257, "store object's name"),
        ("globus://not-a-uuid/a", "collection's UUID"),
        (f"globus://{COLLECTION.upper()}/a", "collection's UUID"),
        (f"globus://{COLLECTION}", "no traversal"),
        (f"globus://{COLLECTION}/a/../../b", "no traversal"),
        ("", "non-empty"),
    ],
)
def test_refused_urls_say_what_is_wrong(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        parse_stage_url(url)
    assert why in str(caught.value)


def test_a_url_is_bounded_in_length() -> None:
    long = "file:///" + "/".join(["d" * 100] * 11)
    assert len(long) > MAX_STAGE_URL_CHARS
    with pytest.raises(ValueError, match=f"at most {MAX_STAGE_URL_CHARS}"):
        parse_stage_url(long)


@pytest.mark.parametrize("path", ["a.dat", "inputs/a.dat", "x/y/z_1-2+3,=@.h5"])
def test_accepted_local_paths(path: str) -> None:
    assert check_local_path(path) == path


@pytest.mark.parametrize(
    "path",
    [
        "",
        "/etc/passwd",
        "../a",
        "a/../../b",
        "a/./b",
        ".",
        "a//b",
        "a/",
        "a b",
        "a\x00b",
        "a\\b",
        "~/a",
        "$HOME/a",
        "/".join(["d"] * (MAX_STAGE_PATH_DEPTH + 1)),
        "a" * (MAX_STAGE_PATH_CHARS + 1),
    ],
)
def test_refused_local_paths_never_leave_the_task_directory(path: str) -> None:
    with pytest.raises(ValueError, match="relative"):
        check_local_path(path)


def test_a_submission_with_staged_files_round_trips() -> None:
    record = submission(
        stage_in=[StageItem(url="file:///data/in/a.dat", path="a.dat")],
        stage_out=[StageItem(url=f"globus://{COLLECTION}/out/b.dat", path="b.dat")],
    )
    again = decode(encode(record), TaskSubmission)
    assert again.stage_in == record.stage_in and again.stage_out == record.stage_out
    assert again.v == 5


def test_a_decoded_record_is_checked_too() -> None:
    # A hand-made record (not built by the SDK) with a traversal: refused on decode.
    raw = msgspec.msgpack.decode(encode(submission()))
    raw["stage_in"] = [{"url": "file:///data/../etc/shadow", "path": "a"}]
    with pytest.raises(RecordDecodeError, match="no traversal"):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)
    raw["stage_in"] = [{"url": "file:///data/a", "path": "../../a"}]
    with pytest.raises(RecordDecodeError, match="relative"):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)
    raw["stage_in"] = [{"url": "file:///data/a", "path": "a"}] * (MAX_STAGE_ITEMS + 1)
    with pytest.raises(RecordDecodeError, match="stage_in"):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)


def test_a_local_path_is_staged_in_once_and_a_url_is_staged_out_once() -> None:
    with pytest.raises(ValueError, match="stage_in names a local path more than once"):
        submission(
            stage_in=[
                StageItem(url="file:///data/a", path="x"),
                StageItem(url="file:///data/b", path="x"),
            ]
        )
    with pytest.raises(ValueError, match="stage_out names a destination URL more than once"):
        submission(
            stage_out=[
                StageItem(url="file:///data/a", path="x"),
                StageItem(url="file:///data/a", path="y"),
            ]
        )
