"""The node-local tier's own checks: its directory, its node key, and room (no broker)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fxstream.connectors import ByReference, FileConnector, find_node_local, load_payload
from fxstream.connectors import node_local as node_local_module
from fxstream.connectors.node_local import (
    NODE_STORE_DIR_ENV,
    NODE_STORE_ENV,
    check_node_directory,
)
from fxstream.connectors.stores import open_store
from fxstream.topics import StorageTier


def _env(directory: Path) -> dict[str, str]:
    return {NODE_STORE_ENV: "on", NODE_STORE_DIR_ENV: str(directory)}


def test_the_tier_makes_its_directory_private_and_keys_this_node(tmp_path: Path) -> None:
    directory = tmp_path / "node"
    node = find_node_local(_env(directory))
    assert node is not None
    assert directory.is_dir() and (directory.stat().st_mode & 0o777) == 0o700
    assert len(node.key) == 32 and node.key == find_node_local(_env(directory)).key  # type: ignore[union-attr]
    # Another directory is another tier: its processes could not read each other's objects.
    other = find_node_local(_env(tmp_path / "other"))
    assert other is not None and other.key != node.key


@pytest.mark.parametrize("setting", ["off", "0", "false", "NO"])
def test_it_can_be_turned_off(tmp_path: Path, setting: str) -> None:
    assert (
        find_node_local({NODE_STORE_ENV: setting, NODE_STORE_DIR_ENV: str(tmp_path / "n")}) is None
    )


def test_a_directory_open_to_others_is_refused_with_the_remedy(tmp_path: Path) -> None:
    directory = tmp_path / "open"
    directory.mkdir(mode=0o700)
    directory.chmod(0o755)
    assert find_node_local(_env(directory)) is None
    problem = check_node_directory(directory)
    assert problem is not None and f"chmod 700 {directory}" in problem
    directory.chmod(0o700)  # the remedy the message gives works
    assert find_node_local(_env(directory)) is not None


def test_a_symlink_or_another_users_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    assert find_node_local(_env(link)) is None
    # A directory of this user, judged for another uid: what another user's directory is
    # to this one (no root needed to make it).
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    other_uid = os.geteuid() + 1
    problem = check_node_directory(theirs, other_uid)
    assert problem is not None and f"not this user ({other_uid})" in problem


def test_a_relative_directory_is_refused(tmp_path: Path) -> None:
    assert find_node_local({NODE_STORE_ENV: "on", NODE_STORE_DIR_ENV: "relative/dir"}) is None


def test_a_value_without_room_goes_to_the_fallback_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = find_node_local(_env(tmp_path / "node"))
    assert node is not None
    fallback = open_store(f"file://{tmp_path / 'fallback'}")
    packer = ByReference(
        node.store(), threshold_bytes=1_000, fallback=fallback, has_room=node.has_room
    )
    data = os.urandom(50_000)
    roomy = packer.pack_arguments((data,))
    assert [s.reference.tier for s in roomy.stored] == [StorageTier.EPHEMERAL]
    assert roomy.stored[0].reference.object_key.startswith(str(node.directory))
    # A file system that must stay entirely free has room for nothing.
    monkeypatch.setattr(node_local_module, "RESERVE_FRACTION", 1.0)
    full = packer.pack_arguments((data,))
    assert [s.store for s in full.stored] == [fallback]
    assert isinstance(fallback.connector, FileConnector)
    key = full.stored[0].key
    assert load_payload(fallback.connector.get(key)) == data
