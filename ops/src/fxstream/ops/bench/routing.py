"""Warm routing and group placement compared (issue 14's ``bench routing``).

funcX's container-routing experiment scaled to this machine, and Balsam's
shortest-backlog versus round-robin comparison, each policy on a private platform of its
own (the router's placement policy is a process setting, ``FXSTREAM_PLACEMENT``, read
when the platform's router starts), all in one run:

- **Warm routing** (policies ``warm`` and ``random``): ``endpoints`` endpoints, each
  allowing ``images`` images (``img0``, ``img1``, ...: the ``process`` runtime, so a
  worker per image is a process of its own, started cold at its image's first task)
  with one worker per image pool and at most ``pool_slots`` pools at a time (the
  endpoint's ``max_workers``: a task of another image evicts the least recently used
  idle pool, and its next task starts it cold again). One sleep function per image
  (registered with that image as its container), ``tasks`` tasks of mixed durations
  (seeded, the same for both policies) submitted at once to the group of all the
  endpoints. Figures: completion time (first submission to last result) and cold
  starts (the distinct workers, ``host:pid`` per endpoint, that ran a task: each
  started cold once), split by source (:func:`cold_start_sources`: placement sending
  an image to more endpoints, or the agents starting an image's pool again where it
  ran), with the tasks routed and pool starts per endpoint and image.
- **Group placement** (policies ``backlog`` and ``round-robin``): endpoints of unequal
  size (1, 2, 3, ... workers), one sleep function without a container, ``group_tasks``
  tasks of mixed durations to the group. Figure: completion time.

``improvement_pct`` is ``(random - warm) / random`` in percent, ``group_improvement_pct``
``(round-robin - backlog) / round-robin``. The durations are sleeps: the figures measure
placement (queueing and cold starts), not CPU. Each phase starts and stops its own
platform (the supervisor and processors started with ``FXSTREAM_PLACEMENT`` set), so
the run takes a few minutes beyond the tasks themselves.

Its runs are recorded in docs/benchmarks.md (``./fx bench routing``).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

from rich.console import Console
from rich.table import Table

from fxstream.ops.bench.stack import (
    BenchError,
    Meter,
    PrivatePlatform,
    private_platform,
    progress,
    wait_all,
)
from fxstream.sdk import Executor, TaskFuture

__all__ = [
    "DURATIONS_S",
    "RoutingSettings",
    "cold_start_sources",
    "draw_workload",
    "run_routing_bench",
    "sleep_for",
]

PLACEMENT_ENV: Final = "FXSTREAM_PLACEMENT"
DURATIONS_S: Final = (0.01, 0.05, 0.2)
"""The sleep durations tasks draw from (weights below): short, medium and long tasks."""
DURATION_WEIGHTS: Final = (5, 3, 1)
HEARTBEAT_S: Final = 1.0

Figures = dict[str, Any]


def sleep_for(seconds: float) -> float:
    """The task: sleep ``seconds`` and return them."""
    time.sleep(seconds)
    return seconds


@dataclass(frozen=True)
class RoutingSettings:
    """What ``./fx bench routing`` runs (see the module notes)."""

    tasks: int = 3_000
    endpoints: int = 4
    images: int = 10
    pool_slots: int = 3
    group_tasks: int = 1_000
    group_endpoints: int = 3
    seed: int = 7

    def validate(self) -> None:
        """``ValueError`` naming the first setting out of range."""
        if self.tasks < 1 or self.group_tasks < 1:
            raise ValueError("--tasks and --group-tasks must be at least 1")
        if not 2 <= self.endpoints <= 16 or not 2 <= self.group_endpoints <= 16:
            raise ValueError("--endpoints and --group-endpoints must be between 2 and 16")
        if not 1 <= self.images <= 100:
            raise ValueError("--images must be between 1 and 100")
        if self.pool_slots < 1:
            raise ValueError("--pool-slots must be at least 1")


@contextmanager
def _placement(policy: str) -> Iterator[None]:
    """``FXSTREAM_PLACEMENT`` set for the block: the platform's processes inherit it."""
    previous = os.environ.get(PLACEMENT_ENV)
    os.environ[PLACEMENT_ENV] = policy
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(PLACEMENT_ENV, None)
        else:
            os.environ[PLACEMENT_ENV] = previous


def draw_workload(count: int, kinds: int, seed: int) -> list[tuple[int, float]]:
    """``count`` (kind, duration) pairs, the same for a given seed."""
    rng = random.Random(seed)
    return [
        (rng.randrange(kinds), rng.choices(DURATIONS_S, DURATION_WEIGHTS)[0]) for _ in range(count)
    ]


def _run(
    console: Console,
    platform: PrivatePlatform,
    group: Sequence[str],
    function_ids: Sequence[str],
    workload: Sequence[tuple[int, float]],
    label: str,
) -> tuple[float, list[TaskFuture]]:
    """Submit ``workload`` to ``group`` at once; the completion time and the futures."""
    client = platform.client()
    executor = Executor(endpoint_group=list(group), client=client, batch_size=500)
    try:
        with progress(console) as display:
            meter = Meter(display, label, len(workload))
            began = time.monotonic()
            futures = [
                executor.submit_to_registered_function(function_ids[kind], (duration,))
                for kind, duration in workload
            ]
            wait_all(futures, meter)
            return time.monotonic() - began, futures
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        client.close()


def _warm_phase(console: Console, settings: RoutingSettings, policy: str) -> Figures:
    images = {f"img{i}": "process:" for i in range(settings.images)}
    workload = draw_workload(settings.tasks, settings.images, settings.seed)
    with _placement(policy), private_platform(console, services=True) as platform:
        endpoints = [
            platform.add_endpoint(
                f"route-{i}",
                workers=1,
                heartbeat_period_s=HEARTBEAT_S,
                images=images,
                max_workers=settings.pool_slots,
            ).endpoint_id
            for i in range(settings.endpoints)
        ]
        with platform.client() as client:
            function_ids = [
                client.register_function(sleep_for, name=f"sleep-{image}", container=image)
                for image in images
            ]
        completion, futures = _run(
            console, platform, endpoints, function_ids, workload, f"{policy}: {len(workload)} tasks"
        )
    image_of = dict(zip(function_ids, images, strict=True))
    return {
        "completion_s": round(completion, 2),
        **cold_start_sources(
            [(f.endpoint_id, image_of[f.function_id], f.worker) for f in futures], endpoints
        ),
    }


def cold_start_sources(
    ran: Sequence[tuple[str, str, str | None]], endpoints: Sequence[str]
) -> Figures:
    """Where the cold starts of a warm phase came from, from what each task ran on:
    ``(endpoint id, image, worker)`` per task, ``endpoints`` in their order.

    A cold start is a distinct worker (``host:pid``) per endpoint that ran a task (each
    was started cold once; the pools have one worker each). Split two ways:

    - ``placement_spread``: the (endpoint, image) pairs the router sent tasks to beyond
      one per image: each is a pool started because placement sent an image to another
      endpoint;
    - ``restarts``: workers beyond one per (endpoint, image) pair: an image's pool
      started again where it had run (the agent released it for another image: its pool
      budget, ``max_image_wait_s``), or a worker replaced.

    ``per_endpoint`` lists, per endpoint in order, the tasks the router sent there per
    image and the pool starts per image there.
    """
    tasks: Counter[tuple[str, str]] = Counter()
    workers: dict[tuple[str, str], set[str | None]] = {}
    for endpoint_id, image, worker in ran:
        tasks[(endpoint_id, image)] += 1
        workers.setdefault((endpoint_id, image), set()).add(worker)
    starts = sum(len(w) for w in workers.values())
    images = {image for _, image in tasks}
    return {
        "cold_starts": starts,
        "placement_spread": len(tasks) - len(images),
        "restarts": starts - len(tasks),
        "tasks_per_endpoint": sorted(Counter(e for e, _, _ in ran).values()),
        "per_endpoint": [
            {
                "endpoint": index,
                "tasks": {i: n for (e, i), n in sorted(tasks.items()) if e == endpoint_id},
                "pool_starts": {
                    i: len(w) for (e, i), w in sorted(workers.items()) if e == endpoint_id
                },
            }
            for index, endpoint_id in enumerate(endpoints)
        ],
    }


def _group_phase(console: Console, settings: RoutingSettings, policy: str) -> Figures:
    workload = draw_workload(settings.group_tasks, 1, settings.seed + 1)
    with _placement(policy), private_platform(console, services=True) as platform:
        endpoints = [
            platform.add_endpoint(
                f"group-{i}", workers=i + 1, heartbeat_period_s=HEARTBEAT_S
            ).endpoint_id
            for i in range(settings.group_endpoints)
        ]
        with platform.client() as client:
            function_ids = [client.register_function(sleep_for, name="sleep")]
        completion, futures = _run(
            console, platform, endpoints, function_ids, workload, f"{policy}: {len(workload)} tasks"
        )
    counts = Counter(f.endpoint_id for f in futures)
    return {
        "completion_s": round(completion, 2),
        # By endpoint size (1, 2, 3, ... workers).
        "tasks_per_endpoint": [counts[e] for e in endpoints],
    }


def _improvement(better: float, worse: float) -> float | None:
    return round(100 * (worse - better) / worse, 1) if worse > 0 else None


def run_routing_bench(console: Console, settings: RoutingSettings) -> Figures:
    """Run every phase, print the table and, last, one JSON line; returns the figures."""
    settings.validate()
    phases: dict[str, Figures] = {}
    for policy in ("warm", "random"):
        phases[policy] = _warm_phase(console, settings, policy)
    for policy in ("backlog", "round-robin"):
        phases[policy] = _group_phase(console, settings, policy)
    if any(not p.get("completion_s") for p in phases.values()):
        raise BenchError(f"a phase measured nothing: {phases}")
    figures: Figures = {
        "bench": "routing",
        "tasks": settings.tasks,
        "endpoints": settings.endpoints,
        "images": settings.images,
        "pool_slots": settings.pool_slots,
        "completion_s_warm": phases["warm"]["completion_s"],
        "completion_s_random": phases["random"]["completion_s"],
        "improvement_pct": _improvement(
            phases["warm"]["completion_s"], phases["random"]["completion_s"]
        ),
        "cold_starts_warm": phases["warm"]["cold_starts"],
        "cold_starts_random": phases["random"]["cold_starts"],
        # Where the cold starts came from: placement (an image sent to another endpoint)
        # or the agents (an image's pool started again where it ran).
        "cold_start_sources": {
            p: {k: phases[p][k] for k in ("placement_spread", "restarts", "per_endpoint")}
            for p in ("warm", "random")
        },
        "group_tasks": settings.group_tasks,
        "group_endpoint_workers": list(range(1, settings.group_endpoints + 1)),
        "completion_s_backlog": phases["backlog"]["completion_s"],
        "completion_s_round_robin": phases["round-robin"]["completion_s"],
        "group_improvement_pct": _improvement(
            phases["backlog"]["completion_s"], phases["round-robin"]["completion_s"]
        ),
        "tasks_per_endpoint": {p: f["tasks_per_endpoint"] for p, f in phases.items()},
    }
    table = Table(title="fxstream routing: placement policies on one machine")
    for column in ("policy", "workload", "completion s", "cold starts", "tasks per endpoint"):
        table.add_column(column, justify="left" if column in ("policy", "workload") else "right")
    for policy, what in (
        ("warm", "images"),
        ("random", "images"),
        ("backlog", "unequal"),
        ("round-robin", "unequal"),
    ):
        phase = phases[policy]
        table.add_row(
            policy,
            what,
            f"{phase['completion_s']:.2f}",
            str(phase.get("cold_starts", "-")),
            ", ".join(str(n) for n in phase["tasks_per_endpoint"]),
        )
    console.print(table)
    sources = Table(title="warm-routing phases: where the cold starts came from")
    for column in ("policy", "cold starts", "placement spread", "restarts", "per endpoint"):
        sources.add_column(
            column, justify="left" if column in ("policy", "per endpoint") else "right"
        )
    for policy in ("warm", "random"):
        phase = phases[policy]
        sources.add_row(
            policy,
            str(phase["cold_starts"]),
            str(phase["placement_spread"]),
            str(phase["restarts"]),
            "; ".join(
                f"{e['endpoint']}: "
                + " ".join(f"{i}={n}/{e['pool_starts'][i]}" for i, n in e["tasks"].items())
                for e in phase["per_endpoint"]
            ),
        )
    console.print(sources)
    console.print("per endpoint: image=tasks routed there/pool starts there")
    console.print(
        f"warm vs random: {figures['improvement_pct']} % shorter; "
        f"backlog vs round robin: {figures['group_improvement_pct']} % shorter"
    )
    print(json.dumps(figures), flush=True)
    return figures
