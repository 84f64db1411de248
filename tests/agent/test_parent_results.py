"""The worker's side of task DAGs, in this process (no broker, no worker pool): a dependent
task's ParentResult placeholders receive its parents' results, inline or fetched by
reference from a store (a file store here) with the store's digest check; a result that
cannot be read fails the task with ParentResultUnavailable naming the parent."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from fxstream.agent.runner import load_function
from fxstream.connectors import ByReference, open_store
from fxstream.topics import (
    IntegrityError,
    ParentResult,
    ParentResultUnavailable,
    Serializer,
    TaskSubmission,
    client_info,
    encode,
)

SERIALIZER = Serializer()


def joined(a: Any, b: Any, *, c: Any) -> Any:
    return [a, b, c]


def _call(
    payload_args: tuple[Any, ...],
    payload_kwargs: dict[str, Any],
    parents: dict[str, bytes],
    *,
    store_url: str | None = None,
) -> Any:
    submission = TaskSubmission(
        task_id="child-1",
        function_id="fn-1",
        endpoint_id="ep-1",
        user_id="u-1",
        function_sha256="0" * 64,
        payload=SERIALIZER.pack_arguments(payload_args, payload_kwargs),
        client=client_info(),
        submitted_at=time.time(),
        depends_on=sorted(
            {
                p.task_id
                for p in (*payload_args, *payload_kwargs.values())
                if isinstance(p, ParentResult)
            }
        ),
        parent_results=parents,
    )
    call = load_function(SERIALIZER.serialize_function(joined), store_url=store_url)
    return SERIALIZER.deserialize(call(encode(submission)))


def test_inline_results_take_their_placeholders_places() -> None:
    parents = {"p-a": SERIALIZER.serialize_value({"x": 1}), "p-b": SERIALIZER.serialize_value(2)}
    value = _call((ParentResult("p-a"), 5), {"c": ParentResult("p-b")}, parents)
    assert value == [{"x": 1}, 5, 2]


def test_a_result_by_reference_is_fetched_from_the_store(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    big = list(range(50_000))
    packed = ByReference(open_store(url), threshold_bytes=1_000).pack_value(big)
    assert len(packed.payload) < 2_000  # only the reference
    value = _call(
        (ParentResult("p-a"), ParentResult("p-a")),
        {"c": 0},
        {"p-a": packed.payload},
        store_url=url,
    )
    assert value == [big, big, 0]


def test_an_evicted_result_is_unavailable_naming_the_parent(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    store = open_store(url)
    packed = ByReference(store, threshold_bytes=1_000).pack_value(list(range(50_000)))
    store.evict(packed.stored[0].key)
    with pytest.raises(ParentResultUnavailable, match="result of parent task p-a cannot be read"):
        _call((ParentResult("p-a"), 1), {"c": 2}, {"p-a": packed.payload}, store_url=url)


def test_a_substituted_result_is_an_integrity_error(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    packed = ByReference(open_store(url), threshold_bytes=1_000).pack_value(list(range(50_000)))
    (stored,) = (tmp_path / "store").iterdir()
    stored.write_bytes(SERIALIZER.serialize_value("forged") + b" " * 100)
    with pytest.raises(IntegrityError):
        _call((ParentResult("p-a"), 1), {"c": 2}, {"p-a": packed.payload}, store_url=url)


def test_a_parent_without_its_result_is_unavailable() -> None:
    with pytest.raises(ParentResultUnavailable, match="parent task p-b did not come"):
        _call(
            (ParentResult("p-a"), ParentResult("p-b")),
            {"c": 1},
            {"p-a": SERIALIZER.serialize_value(1)},
        )
