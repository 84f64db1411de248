"""Trigger rules as records: the filter, the arguments, and what validation refuses."""

from __future__ import annotations

import msgspec
import pytest

from fxstream.topics import (
    Catalogue,
    Event,
    EventPredicate,
    RecordDecodeError,
    TaskSubmission,
    TriggerFiring,
    TriggerRule,
    decode,
    encode,
)
from fxstream.topics.acls import Operation, Resource, Role, grants_for, is_allowed

SHA = "a" * 64


def rule(**fields: object) -> TriggerRule:
    base: dict[str, object] = {
        "kind": "trigger-rule",
        "rule_id": "r1",
        "owner_id": "u1",
        "name": "frames",
        "source": "detector",
        "function_id": "f1",
        "function_sha256": SHA,
        "endpoint_id": "e1",
        "created_at": 100.0,
        "updated_at": 100.0,
    }
    return msgspec.convert({**base, **fields}, TriggerRule)


def event(key: str = "run1/frame-0001.h5", **attributes: object) -> Event:
    return Event(
        source="detector",
        event_key=key,
        event_type="file-complete",
        occurred_at=123.0,
        attributes={"path": "/data/" + key, "size": 2048, "run": "run1", **attributes},  # type: ignore[dict-item]
    )


def test_the_filter_matches_source_type_key_pattern_and_every_predicate() -> None:
    r = rule(
        event_type="file-complete",
        key_pattern="run1/*.h5",
        predicates=[
            {"attribute": "size", "op": "gt", "value": 1024},
            {"attribute": "path", "op": "prefix", "value": "/data/"},
            {"attribute": "run", "op": "eq", "value": "run1"},
        ],
    )
    assert r.matches(event())
    assert not r.matches(event("run1/frame-0001.txt"))  # key pattern
    assert not r.matches(event(size=100))  # size > 1024 fails
    assert not r.matches(event(run="run2"))  # eq fails
    assert not r.matches(msgspec.structs.replace(event(), source="other"))
    assert not r.matches(msgspec.structs.replace(event(), event_type="adios2-step"))


@pytest.mark.parametrize(
    ("op", "value", "attributes", "holds"),
    [
        ("eq", 3, {"n": 3}, True),
        ("eq", 1, {"n": True}, False),  # a flag is not a count
        ("ne", "a", {"n": "b"}, True),
        ("ne", "a", {}, False),  # a missing attribute fails every op
        ("suffix", ".h5", {"n": "x.h5"}, True),
        ("glob", "frame-*[0-9]", {"n": "frame-12"}, True),
        ("glob", "frame-*", {"n": 12}, False),  # a text op on a number
        ("lt", 2.5, {"n": 2}, True),
        ("le", 2, {"n": 2}, True),
        ("ge", 3, {"n": 2}, False),
        ("gt", 1, {"n": "5"}, False),  # a number op on text
        ("exists", None, {"n": None}, True),
        ("exists", None, {}, False),
    ],
)
def test_each_predicate_op(
    op: str, value: object, attributes: dict[str, object], holds: bool
) -> None:
    predicate = msgspec.convert({"attribute": "n", "op": op, "value": value}, EventPredicate)
    assert predicate.holds(attributes) is holds  # type: ignore[arg-type]


def test_the_event_becomes_keyword_arguments_as_the_rule_says() -> None:
    e = event()
    assert rule(constants={"threshold": 3}).kwargs_for(e) == {
        "threshold": 3,
        "event": {
            "event_key": e.event_key,
            "source": "detector",
            "event_type": "file-complete",
            "occurred_at": 123.0,
            "attributes": dict(e.attributes),
        },
    }
    assert rule(arguments="attributes").kwargs_for(e) == dict(e.attributes)
    templated = rule(
        arguments="template",
        template={"path": "attributes.path", "key": "event_key", "missing": "attributes.nope"},
    )
    assert templated.kwargs_for(e) == {
        "path": e.attributes["path"],
        "key": e.event_key,
        "missing": None,
    }


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"predicates": [{"attribute": "size", "op": "gt", "value": "big"}]}, "needs a number"),
        ({"predicates": [{"attribute": "p", "op": "prefix", "value": 3}]}, "needs a text"),
        ({"predicates": [{"attribute": "p", "op": "contains", "value": "x"}]}, "op"),
        ({"arguments": "template"}, "needs a template"),
        ({"template": {"a": "event_key"}}, "only with arguments 'template'"),
        ({"arguments": "template", "template": {"a": "__import__('os')"}}, "template"),
        ({"limits": {"max_in_flight": 0}}, "max_in_flight"),
        ({"source": "events.x"}, "source"),
    ],
)
def test_invalid_rules_are_refused_saying_why(fields: dict[str, object], says: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=says):
        rule(**fields)


def test_a_rule_round_trips_and_a_bad_one_does_not_decode() -> None:
    r = rule(
        predicates=[{"attribute": "size", "op": "ge", "value": 1}], limits={"max_in_flight": 2}
    )
    assert decode(encode(r), TriggerRule) == r
    bad = msgspec.msgpack.encode(
        {**msgspec.to_builtins(r), "predicates": [{"attribute": "size", "op": "ge", "value": "x"}]}
    )
    with pytest.raises(RecordDecodeError, match="needs a number"):
        decode(bad, TriggerRule)


def test_a_submission_carries_its_firing_and_reads_without_one() -> None:
    firing = TriggerFiring(
        rule_id="r1",
        source="detector",
        event_key="k",
        event_topic="fx.events.detector",
        event_partition=2,
        event_offset=7,
    )
    fields = {
        "task_id": "t1",
        "function_id": "f1",
        "endpoint_id": "e1",
        "user_id": "u1",
        "function_sha256": SHA,
        "payload": b"x",
        "client": {"python_version": "3.11.0", "fxstream_version": "0"},
        "submitted_at": 1.0,
    }
    plain = msgspec.convert({"kind": "submission", **fields}, TaskSubmission)
    fired = msgspec.structs.replace(plain, trigger=firing)
    assert decode(encode(fired), TaskSubmission).trigger == firing
    assert decode(encode(plain), TaskSubmission).trigger is None


def test_the_service_reads_and_writes_rules_and_submits_as_a_rule_owner() -> None:
    catalogue = Catalogue(prefix="t1.")
    grants = grants_for(Role.SERVICE, catalogue)
    assert catalogue.triggers == "t1.triggers"
    for operation in (Operation.READ, Operation.WRITE):
        assert is_allowed(grants, Resource.TOPIC, "t1.triggers", operation)
    assert is_allowed(grants, Resource.TOPIC, "t1.from.user.u1", Operation.WRITE)
    assert is_allowed(grants, Resource.TOPIC, "t1.events.detector", Operation.READ)
    user = grants_for(Role.USER, catalogue, "u1")
    assert not is_allowed(user, Resource.TOPIC, "t1.triggers", Operation.WRITE)
    assert not is_allowed(user, Resource.TOPIC, "t1.triggers", Operation.READ)
    assert catalogue.source_of("t1.events.detector") == "detector"
