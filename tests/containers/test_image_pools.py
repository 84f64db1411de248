"""An endpoint that allows several images runs each task in the image its function names,
each image in its own pool of warm workers (real bubblewrap sandboxes)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from fxstream.agent.containers import Image
from fxstream.agent.image_pools import ImagePools
from tests.containers import tasks
from tests.containers.test_runtimes import item

pytestmark = pytest.mark.usefixtures("leaves_no_process")

TIMEOUT = 60.0


def where(pools: ImagePools, image: str | None) -> dict[str, object]:
    done = pools.submit(item(tasks.namespaces, image=image)).result(TIMEOUT)
    assert done.ok, f"{done.error_type}: {done.error_message}\n{done.traceback}"
    assert done.value is not None
    seen: dict[str, object] = pickle.loads(done.value)
    return seen


def test_each_task_runs_in_the_image_its_function_names(
    runtimes: dict[str, str], rootfs: Path
) -> None:
    host = Image("host", "bubblewrap", "/")
    built = Image("worker", "bubblewrap", str(rootfs))
    pools = ImagePools(
        1, "fxstream.agent.worker_process:load_pickled", default=None, images=[host, built]
    )
    try:
        assert pools.wait_ready(TIMEOUT)
        assert list(pools.pools()) == [None]  # only the default pool until an image is named
        plain = where(pools, None)
        assert plain["mnt"] == os.readlink("/proc/self/ns/mnt")  # no container
        in_host = where(pools, "host")
        in_built = where(pools, "worker")
        assert in_host["mnt"] != plain["mnt"] and in_built["mnt"] != plain["mnt"]
        assert in_host["mnt"] != in_built["mnt"]
        assert set(pools.pools()) == {None, "host", "worker"}
        assert pools.counts().workers_total == 3
        containers = sorted(str(w.container) for w in pools.warm())
        assert containers == ["None", "host", "worker"]
        # Warm: the image's pool serves its next task in the same sandbox.
        assert where(pools, "worker") == in_built
        with pytest.raises(ValueError, match="'gpu' is not one this endpoint runs"):
            where(pools, "gpu")
    finally:
        pools.close()
