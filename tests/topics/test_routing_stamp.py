"""Routing stamps: what verifies, what does not, key rotation, and the key file."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxstream.topics import (
    ROUTING_STAMP_MAX_CHARS,
    CredentialFileError,
    RoutingKey,
    RoutingKeys,
    RoutingStampError,
    ensure_routing_keys,
    read_routing_keys,
    routing_stamp,
    write_routing_keys,
)
from fxstream.topics.routing_stamp import MAX_KEY_ID_CHARS

ids = st.text(
    alphabet=st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-"),
    min_size=1,
    max_size=128,
)
key_ids = st.text(
    alphabet=st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789_-"),
    min_size=1,
    max_size=MAX_KEY_ID_CHARS,
)
FIELDS = ("task_id", "endpoint_id", "user_id", "function_id")
KEYS = RoutingKeys.generate()


def _routing(
    task: str = "t-1", endpoint: str = "e-1", user: str = "u-1", function: str = "f-1"
) -> dict[str, str]:
    """A routing's fields, as the stamp functions take them."""
    return {"task_id": task, "endpoint_id": endpoint, "user_id": user, "function_id": function}


@given(task=ids, endpoint=ids, user=ids, function=ids, key_id=key_ids)
def test_a_stamp_verifies_for_its_own_routing_and_is_bounded(
    task: str, endpoint: str, user: str, function: str, key_id: str
) -> None:
    keys = RoutingKeys(RoutingKey(key_id, b"k" * 32))
    routing = _routing(task, endpoint, user, function)
    stamp = keys.stamp(**routing)
    assert stamp.isascii()
    assert len(stamp) <= ROUTING_STAMP_MAX_CHARS
    assert stamp.startswith(f"v1.{key_id}.")
    assert stamp == routing_stamp(keys.signing, **routing)  # deterministic
    keys.verify(stamp, **routing)


@given(
    routing=st.fixed_dictionaries({name: ids for name in FIELDS}),
    field=st.sampled_from(FIELDS),
    other=ids,
)
def test_a_stamp_for_another_task_endpoint_user_or_function_does_not_verify(
    routing: dict[str, str], field: str, other: str
) -> None:
    stamp = KEYS.stamp(**routing)
    changed = {**routing, field: other}
    if changed == routing:
        return
    with pytest.raises(RoutingStampError, match="does not match"):
        KEYS.verify(stamp, **changed)


def test_the_encoding_is_unambiguous_where_a_plain_join_is_not() -> None:
    # "ab" + "c" and "a" + "bc" join to the same text; their stamps differ.
    one = KEYS.stamp(task_id="ab", endpoint_id="c", user_id="u", function_id="f")
    two = KEYS.stamp(task_id="a", endpoint_id="bc", user_id="u", function_id="f")
    assert one != two
    # And the fields are not interchangeable.
    swapped = KEYS.stamp(task_id="c", endpoint_id="ab", user_id="u", function_id="f")
    assert swapped != one


@pytest.mark.parametrize(
    ("stamp", "words"),
    [
        ("", "carries no routing stamp"),
        ("garbage", "not a v1 stamp"),
        ("v2.k.mac", "not a v1 stamp"),
        ("v1.k.mac.more", "not a v1 stamp"),
        ("v1.nokey.AAAA", "with key 'nokey', which this ingress does not hold"),
        (None, "does not match"),  # the right key id, a forged MAC
        ("v1.{kid}.\u00e9\ud800", "does not match"),  # not even ASCII
    ],
)
def test_what_does_not_verify_says_why(stamp: str | None, words: str) -> None:
    kid = KEYS.signing.key_id
    if stamp is None:
        stamp = f"v1.{kid}.{base64.urlsafe_b64encode(b'x' * 32).rstrip(b'=').decode()}"
    with pytest.raises(RoutingStampError, match=words):
        KEYS.verify(stamp.format(kid=kid), **_routing())


def test_a_stamp_under_an_unknown_key_does_not_verify() -> None:
    stranger = RoutingKeys.generate()  # another platform's key (or a guess)
    with pytest.raises(RoutingStampError, match="does not hold"):
        KEYS.verify(stranger.stamp(**_routing()), **_routing())
    # The same key id with another secret: the MAC gives it away.
    impostor = RoutingKeys(RoutingKey(KEYS.signing.key_id, os.urandom(32)))
    with pytest.raises(RoutingStampError, match="does not match"):
        KEYS.verify(impostor.stamp(**_routing()), **_routing())


def test_rotation_keeps_the_old_stamps_verifying_until_the_old_key_is_removed() -> None:
    old = RoutingKeys.generate()
    before = old.stamp(**_routing())
    new = old.rotated()
    assert new.signing != old.signing
    assert new.key_ids == (new.signing.key_id, old.signing.key_id)
    after = new.stamp(**_routing())
    assert after.split(".")[1] == new.signing.key_id
    new.verify(before, **_routing())  # a task routed before the rotation
    new.verify(after, **_routing())
    with pytest.raises(RoutingStampError, match="does not hold"):
        old.verify(after, **_routing())  # an ingress not yet given the new key
    retired = RoutingKeys(new.signing)  # the old key removed
    with pytest.raises(RoutingStampError, match="does not hold"):
        retired.verify(before, **_routing())


def test_keys_are_validated_and_never_shown() -> None:
    key = RoutingKey.generate()
    assert key.secret.hex() not in repr(key)
    assert key.secret.hex() not in repr(RoutingKeys(key))
    with pytest.raises(ValueError, match="at least 32"):
        RoutingKey("k", b"short")
    with pytest.raises(ValueError, match="not valid"):
        RoutingKey("a.b", b"k" * 32)  # '.' separates a stamp's parts
    with pytest.raises(ValueError, match="appears twice"):
        RoutingKeys(key, (RoutingKey(key.key_id, os.urandom(32)),))


def test_the_key_file_is_made_once_owner_only_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "credentials" / "routing-keys.json"
    made = ensure_routing_keys(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_routing_keys(path) == made  # kept, not replaced
    assert read_routing_keys(path) == made
    assert len(made.signing.secret) == 32
    rotated = made.rotated()
    write_routing_keys(path, rotated)
    assert read_routing_keys(path) == rotated
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_bad_key_file_is_refused_saying_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "routing-keys.json"
    with pytest.raises(CredentialFileError, match="no credentials file"):
        read_routing_keys(path)
    ensure_routing_keys(path)
    path.chmod(0o644)
    with pytest.raises(CredentialFileError, match="chmod 600"):
        read_routing_keys(path)
    path.chmod(0o600)
    fields = json.loads(path.read_text())
    for broken, words in [
        ({}, "not a routing keys file"),
        ({**fields, "signing": "other"}, "signing key 'other' is not among its keys"),
        ({**fields, "keys": {fields["signing"]: "c2hvcnQ"}}, "needs at least 32"),
        ({**fields, "keys": {"bad.id": fields["keys"][fields["signing"]]}}, "not valid"),
    ]:
        path.write_text(json.dumps(broken))
        with pytest.raises(CredentialFileError, match=words):
            read_routing_keys(path)
