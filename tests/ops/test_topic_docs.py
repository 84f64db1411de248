"""docs/topics.md is rendered from the code; the committed file must match it."""

from __future__ import annotations

from fxstream.ops.config import repo_root
from fxstream.ops.topic_docs import render_topics_md
from fxstream.topics import SCHEMA_VERSIONS, Catalogue


def test_committed_topics_md_is_current() -> None:
    committed = (repo_root() / "docs" / "topics.md").read_text()
    assert committed == render_topics_md(), "docs/topics.md is stale: run ./fx docs"


def test_topics_md_documents_every_topic_and_record_kind() -> None:
    text = render_topics_md()
    for spec in Catalogue().specs:
        assert f"`fx.{spec.name}`" in text
    for kind in SCHEMA_VERSIONS:
        assert f"### `{kind}`" in text
