"""The client's memory of ``run`` futures is bounded; unfinished ones are never dropped."""

from __future__ import annotations

import pytest

from fxstream.sdk import client as client_module
from tests.sdk.conftest import SdkTopics
from tests.sdk.streams import ResultWriter, success

ENDPOINT = "ep-bounded"
FUNCTION = "f-bounded"


def test_run_futures_beyond_the_bound_drop_the_oldest_finished_first(
    sdk_topics: SdkTopics, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "_RETAINED", 3)
    writer = ResultWriter(sdk_topics.kafka)
    with sdk_topics.client() as client:
        tasks = [client.prepare_task(ENDPOINT, FUNCTION, (i,)) for i in range(6)]
        waiting = client.track(tasks[0], retain=True)  # never answered
        for task in tasks[1:]:
            future = client.track(task, retain=True)
            writer.result(sdk_topics.results, success(task.task_id, sdk_topics.user_id, 1))
            assert future.result(timeout=20) == 1
        assert client.future(tasks[0].task_id) is waiting, "an unfinished future was dropped"
        for dropped in tasks[1:3]:
            with pytest.raises(KeyError):
                client.future(dropped.task_id)
        for kept in tasks[3:]:
            assert client.future(kept.task_id).done()
        assert not waiting.done()
