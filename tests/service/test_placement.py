"""The placement policy and the warm table, over the real broker.

Heartbeats and warm adverts are written to this module's own ``heartbeats`` and
``warm`` topics; a :class:`RegistryView` follows them as the router's does, and
:class:`Placement` chooses from what the view folded (real records, decoded by the
view). The router around it, the agents' adverts and the SDK's groups are tested end
to end in tests/e2e/test_routing.py.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence

import pytest

from fxstream.service.placement import Placement, PlacementPolicy, tie_break
from fxstream.service.registry import RegistryView
from fxstream.service.warm_table import WarmTable, warm_key
from fxstream.topics import (
    Catalogue,
    ClientInfo,
    FunctionRecord,
    Heartbeat,
    KafkaConnection,
    ObjectReference,
    TaskSubmission,
    WarmAdvert,
    WarmWorker,
    code_sha256,
    wrap_references,
)
from tests.service.conftest import Produce

CODE = b"fxdc\nnot really dill, placement never loads it"
PERIOD_S = 60.0  # long: a heartbeat written by a test stays current for the whole test


@pytest.fixture
def view(module_kafka: KafkaConnection, catalogue: Catalogue) -> Iterator[RegistryView]:
    """A view of heartbeats and warm adverts, as the router's (current when returned)."""
    view = RegistryView(module_kafka, catalogue, follow=("heartbeats", "warm"))
    view.start()
    assert view.wait_until_current(timeout_s=30)
    yield view
    view.close()


def new_id() -> str:
    return str(uuid.uuid4())


def beat(
    endpoint_id: str,
    *,
    idle: int = 2,
    busy: int = 0,
    queued: int = 0,
    sent_at: float | None = None,
    period_s: float = PERIOD_S,
    pool_slots: int = 0,
) -> Heartbeat:
    return Heartbeat(
        endpoint_id=endpoint_id,
        agent_id="agent-1",
        sent_at=time.time() if sent_at is None else sent_at,
        sequence=1,
        period_s=period_s,
        hostname="node",
        pid=1,
        workers_total=idle + busy,
        workers_idle=idle,
        workers_busy=busy,
        queue_depth=queued,
        pool_slots=pool_slots,
    )


def advert(
    endpoint_id: str, *functions: str, container: str | None = None, manager: str = "node"
) -> WarmAdvert:
    return WarmAdvert(
        endpoint_id=endpoint_id,
        manager_id=manager,
        advertised_at=time.time(),
        workers=[
            WarmWorker(
                worker_id="node:1", container=container, function_ids=list(functions), idle=True
            )
        ],
    )


def function(function_id: str, container: str | None = None) -> FunctionRecord:
    return FunctionRecord(
        function_id=function_id,
        name="f",
        owner_id="owner-1",
        code=CODE,
        code_sha256=code_sha256(CODE),
        created_at=time.time(),
        container=container,
    )


def submission(function_id: str, group: list[str], payload: bytes = b"args") -> TaskSubmission:
    return TaskSubmission(
        task_id=new_id(),
        function_id=function_id,
        endpoint_id=group[0],
        endpoint_group=group[1:],
        user_id="alice",
        function_sha256="c" * 64,
        payload=payload,
        client=ClientInfo(python_version="3.11.2", fxstream_version="0.1.0"),
        submitted_at=time.time(),
    )


def publish(
    view: RegistryView,
    catalogue: Catalogue,
    produce: Produce,
    beats: Sequence[Heartbeat] = (),
    adverts: Sequence[WarmAdvert] = (),
) -> None:
    """Write the records and wait until the view has folded them."""
    for b in beats:
        partition, offset = produce(catalogue.heartbeats, b.endpoint_id, b)
        assert view.wait_for_offset(catalogue.heartbeats, partition, offset, timeout_s=10)
    for a in adverts:
        key = warm_key(a.endpoint_id, a.manager_id)
        partition, offset = produce(catalogue.warm, key, a)
        assert view.wait_for_offset(catalogue.warm, partition, offset, timeout_s=10)


def test_the_endpoint_with_the_function_warm_is_chosen(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    warm, cold, fn = new_id(), new_id(), new_id()
    publish(view, catalogue, produce, [beat(warm), beat(cold)], [advert(warm, fn)])
    placement = Placement(view)
    chosen = [
        placement.choose(s, function(fn), s.candidates()).endpoint_id
        for s in (submission(fn, [cold, warm]) for _ in range(20))
    ]
    # Each choice adds one to the warm endpoint's backlog estimate until its next
    # heartbeat; warmth counts while that is less than its two workers above the
    # shortest (-2 and -1 against the cold one's -2; at 0 the cold one's idle workers win).
    assert chosen[:3] == [warm, warm, cold]
    assert placement.stats.warm >= 2


def test_a_burst_follows_its_first_task_before_any_advert_says_so(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    a, b, fn, other = new_id(), new_id(), new_id(), new_id()
    publish(view, catalogue, produce, [beat(a, idle=4), beat(b, idle=4)])
    placement = Placement(view)
    chosen = [
        placement.choose(s, function(fn), s.candidates()).endpoint_id
        for s in (submission(fn, [a, b]) for _ in range(5))
    ]
    # The first goes by the tie-break; the next three follow it (routed there: warm soon)
    # while its backlog is within its four workers of the other's; the fifth spills.
    assert chosen[1:4] == [chosen[0]] * 3
    assert chosen[4] != chosen[0]
    # Without warm routing the same burst alternates.
    backlog = Placement(view, PlacementPolicy.BACKLOG)
    spread = [
        backlog.choose(s, function(other), s.candidates()).endpoint_id
        for s in (submission(other, [a, b]) for _ in range(4))
    ]
    assert spread[0] != spread[1] and spread[2] != spread[3]


def test_a_warm_container_counts_for_a_function_that_names_it(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    warm, cold, fn = new_id(), new_id(), new_id()
    publish(
        view,
        catalogue,
        produce,
        [beat(warm), beat(cold)],
        [advert(warm, "another-function", container="bwrap-img"), advert(cold)],
    )
    task = submission(fn, [cold, warm])
    assert (
        Placement(view).choose(task, function(fn, "bwrap-img"), task.candidates()).endpoint_id
        == warm
    )
    warmth = view.warm.warmth(warm, fn, "bwrap-img")
    assert (warmth.function_warm, warmth.container_warm, warmth.rank) == (False, True, 1)
    # The same function without a container: no warmth (every process pool has None).
    assert view.warm.warmth(warm, fn, None).rank == 0


def test_a_dead_endpoint_is_never_chosen_even_when_warm(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    dead, live, never_seen, fn = new_id(), new_id(), new_id(), new_id()
    lost_at = time.time() - 10 * 3
    publish(
        view,
        catalogue,
        produce,
        [beat(dead, sent_at=lost_at, period_s=3.0), beat(live, busy=2, idle=0, queued=50)],
        [advert(dead, fn)],
    )
    placement = Placement(view)
    for _ in range(30):
        task = submission(fn, [dead, live, never_seen])
        assert placement.choose(task, function(fn), task.candidates()).endpoint_id == live
    assert placement.stats.dead_dropped == 60


def test_with_no_live_candidate_the_choice_is_still_stable(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    a, b, fn = new_id(), new_id(), new_id()
    task = submission(fn, [a, b])
    first = Placement(view).choose(task, function(fn), task.candidates())
    again = Placement(view).choose(task, function(fn), task.candidates())
    assert first.endpoint_id == again.endpoint_id == tie_break(task.task_id, [a, b])
    assert "no candidate is live" in first.reason


def test_the_shortest_backlog_wins_among_cold_endpoints(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    short, long_, fn = new_id(), new_id(), new_id()
    publish(
        view,
        catalogue,
        produce,
        [beat(short, idle=1, busy=1, queued=0), beat(long_, idle=0, busy=2, queued=3)],
    )
    for policy in (PlacementPolicy.WARM, PlacementPolicy.BACKLOG):
        placement = Placement(view, policy)
        task = submission(fn, [long_, short])
        assert placement.choose(task, function(fn), task.candidates()).endpoint_id == short


def test_the_backlog_policy_ignores_warmth(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    warm, idle, fn = new_id(), new_id(), new_id()
    publish(
        view,
        catalogue,
        produce,
        [beat(warm, idle=2, busy=1), beat(idle, idle=2)],
        [advert(warm, fn)],
    )
    task = submission(fn, [warm, idle])
    assert Placement(view).choose(task, function(fn), task.candidates()).endpoint_id == warm
    backlog = Placement(view, PlacementPolicy.BACKLOG)
    assert backlog.choose(task, function(fn), task.candidates()).endpoint_id == idle


def test_routed_tasks_count_until_the_next_heartbeat(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    a, b, fn = new_id(), new_id(), new_id()
    publish(view, catalogue, produce, [beat(a), beat(b)])
    placement = Placement(view, PlacementPolicy.BACKLOG)
    counts = Counter(
        placement.choose(s, function(fn), s.candidates()).endpoint_id
        for s in (submission(fn, [a, b]) for _ in range(40))
    )
    # A burst between heartbeats is spread, not sent whole to the "shortest" endpoint.
    assert counts[a] == counts[b] == 20
    # A newer heartbeat replaces the estimate: b now reports a long queue.
    publish(view, catalogue, produce, [beat(a), beat(b, idle=0, busy=2, queued=100)])
    task = submission(fn, [a, b])
    assert placement.choose(task, function(fn), task.candidates()).endpoint_id == a


def test_load_is_per_worker_so_a_larger_endpoint_takes_more(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    small, large, fn = new_id(), new_id(), new_id()
    publish(view, catalogue, produce, [beat(small, idle=1), beat(large, idle=3)])
    placement = Placement(view, PlacementPolicy.BACKLOG)
    counts = Counter(
        placement.choose(s, function(fn), s.candidates()).endpoint_id
        for s in (submission(fn, [small, large]) for _ in range(40))
    )
    # Rounds of work ahead stay within one of each other: 1:3, where a task count
    # (the estimate before) split the burst 20/20, a wait three times longer on the small.
    assert 9 <= counts[small] <= 11, counts
    assert counts[small] + counts[large] == 40


def test_a_task_goes_where_a_pool_slot_is_free_before_evicting_another_image(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    full, spare = new_id(), new_id()
    publish(
        view,
        catalogue,
        produce,
        # full runs 2 of its 2 pool slots, idle; spare 1 of 2, half busy.
        [beat(full, idle=2, pool_slots=2), beat(spare, idle=1, busy=1, pool_slots=2)],
        [
            advert(full, container="img1", manager="m1"),
            advert(full, container="img2", manager="m2"),
            advert(spare, container="img3"),
        ],
    )
    placement = Placement(view)
    task = submission("f4", [full, spare])
    # Less loaded, full would win by load alone; its pools are all other images'.
    choice = placement.choose(task, function("f4", "img4"), task.candidates())
    assert choice.endpoint_id == spare, choice
    assert placement.stats.evictions_avoided == 1
    # Now both are full (spare just got img4): load decides, the penalty is moot.
    task = submission("f5", [full, spare])
    assert placement.choose(task, function("f5", "img5"), task.candidates()).endpoint_id == full
    assert placement.stats.evictions_avoided == 1
    # The backlog policy knows no pool budget: the least loaded.
    task = submission("f6", [full, spare])
    backlog = Placement(view, PlacementPolicy.BACKLOG)
    assert backlog.choose(task, function("f6", "img6"), task.candidates()).endpoint_id == full


@pytest.mark.parametrize("queued", [0, 500])
def test_an_image_never_releases_another_image_s_pool_while_it_runs_somewhere(
    view: RegistryView, catalogue: Catalogue, produce: Produce, queued: int
) -> None:
    holder, full = new_id(), new_id()
    publish(
        view,
        catalogue,
        produce,
        [
            beat(holder, idle=0, busy=1, queued=queued, pool_slots=3),
            beat(full, idle=1, pool_slots=1),
        ],
        [advert(holder, container="img1"), advert(full, container="img2")],
    )
    placement = Placement(view)
    task = submission("f1", [holder, full])
    choice = placement.choose(task, function("f1", "img1"), task.candidates())
    # full is idle, but its only slot runs img2: sending img1 there releases img2's pool
    # (a cold start now, another when img2's tasks come back). However long the queue
    # where img1 runs, it waits there (the agents' own bound, max_image_wait_s, never
    # comes into play: no endpoint gets more images than slots).
    assert choice.endpoint_id == holder, choice
    assert placement.stats.evictions_avoided == 1
    assert placement.stats.forced_evictions == 0


@pytest.mark.parametrize(("queued", "expected"), [(10, "holder"), (100, "spare")])
def test_an_image_spills_to_a_free_slot_only_when_its_wait_exceeds_a_cold_start(
    view: RegistryView, catalogue: Catalogue, produce: Produce, queued: int, expected: str
) -> None:
    holder, spare = new_id(), new_id()
    publish(
        view,
        catalogue,
        produce,
        [
            beat(holder, idle=0, busy=1, queued=queued, pool_slots=3),
            beat(spare, idle=1, pool_slots=3),
        ],
        [advert(holder, container="img1"), advert(spare, container="img2")],
    )
    # No drain rate measured yet: a round (one task per worker) is taken to last 0.05 s.
    placement = Placement(view, cold_start_s=2.0, round_s=0.05)
    task = submission("f1", [holder, spare])
    choice = placement.choose(task, function("f1", "img1"), task.candidates())
    # 11 tasks ahead on holder's one worker: ~0.55 s, less than a cold start on spare;
    # 101: ~5 s, more.
    assert choice.endpoint_id == {"holder": holder, "spare": spare}[expected], choice
    assert placement.stats.spills == (expected == "spare")
    if expected == "spare":
        assert "spill" in choice.reason


@pytest.mark.parametrize(("queued_after", "expected"), [(50, "holder"), (98, "spare")])
def test_the_wait_is_measured_from_how_fast_heartbeats_show_the_queue_drain(
    view: RegistryView,
    catalogue: Catalogue,
    produce: Produce,
    queued_after: int,
    expected: str,
) -> None:
    holder, spare = new_id(), new_id()
    start = time.time() - 10
    publish(
        view,
        catalogue,
        produce,
        [
            beat(holder, idle=0, busy=1, queued=100, pool_slots=3, sent_at=start),
            beat(spare, idle=1, pool_slots=3),
        ],
        [advert(holder, container="img1"), advert(spare, container="img2")],
    )
    placement = Placement(view, cold_start_s=2.0, round_s=0.05)
    first = submission("f1", [holder, spare])
    # 101 tasks ahead at 0.05 s a round: ~5 s, so the first spills to spare...
    assert placement.choose(first, function("f1", "img1"), first.candidates()).endpoint_id == spare
    # ...the next heartbeat, a second later, shows how fast holder really drains.
    publish(
        view,
        catalogue,
        produce,
        [beat(holder, idle=0, busy=1, queued=queued_after, pool_slots=3, sent_at=start + 1)],
    )
    third = new_id()  # spare now runs img1 too: a third endpoint, free, to spill to
    publish(view, catalogue, produce, [beat(third, idle=1, pool_slots=3)])
    task = submission("f1", [holder, third])
    choice = placement.choose(task, function("f1", "img1"), task.candidates())
    # 101 -> 51 in a second: 50 tasks/s, so the 51 ahead are ~1 s (less than a cold
    # start; in rounds of 0.05 s it would be 2.55 s, a spill); 101 -> 99: 2 tasks/s, ~50 s.
    assert choice.endpoint_id == {"holder": holder, "spare": third}[expected], choice


def test_a_burst_of_ten_images_fills_twelve_slots_without_evicting(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    endpoints = [new_id() for _ in range(4)]
    # funcX's experiment as ./fx bench routing runs it: 4 endpoints of 3 image-pool slots
    # (one worker each, only the default pool running), 10 images, 3,000 tasks at once:
    # routed between two heartbeats, so placement sees only what it routed.
    publish(view, catalogue, produce, [beat(e, idle=1, pool_slots=3) for e in endpoints])
    rng = random.Random(7)
    kinds = [rng.randrange(10) for _ in range(3_000)]
    functions = [function(f"f{i}", f"img{i}") for i in range(10)]

    def route(policy: PlacementPolicy) -> tuple[Placement, Counter[tuple[str, int]]]:
        placement = Placement(view, policy)
        pairs: Counter[tuple[str, int]] = Counter()
        for kind in kinds:
            task = submission(f"f{kind}", endpoints)
            choice = placement.choose(task, functions[kind], task.candidates())
            pairs[(choice.endpoint_id, kind)] += 1
        return placement, pairs

    placement, pairs = route(PlacementPolicy.WARM)
    images_on = Counter(endpoint for endpoint, _ in pairs)
    # Every image gets a home, the two spare slots at most a spill each: no endpoint
    # gets more images than its 3 slots, so no agent ever releases a pool.
    assert {kind for _, kind in pairs} == set(range(10))
    assert max(images_on.values()) <= 3, pairs
    assert len(pairs) <= 12, pairs
    assert placement.stats.homes == 10
    assert placement.stats.forced_evictions == 0
    assert placement.stats.spills <= 2
    # Its share of the load: no endpoint takes more than a third of the burst.
    per_endpoint = Counter({e: 0 for e in endpoints})
    for (endpoint, _), n in pairs.items():
        per_endpoint[endpoint] += n
    assert max(per_endpoint.values()) <= 1_000, per_endpoint
    # The negative control: shortest backlog alone sends every image everywhere.
    _, spread = route(PlacementPolicy.BACKLOG)
    assert len(spread) > 30, spread


def test_data_locality_breaks_a_tie(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    a, b, fn = new_id(), new_id(), new_id()
    publish(view, catalogue, produce, [beat(a), beat(b)])
    references = [
        ObjectReference(object_key="k1", store="file", size_bytes=1_000, site=a),
        ObjectReference(object_key="k2", store="file", size_bytes=5_000, site=b),
        ObjectReference(object_key="k3", store="redis", size_bytes=9_000, site=""),
    ]
    payload = wrap_references(
        b"fxpk\nnot arguments: the router never reads past the references", references
    )
    for _ in range(10):
        placement = Placement(view)  # fresh: no routed-since-heartbeat counts
        task = submission(fn, [a, b], payload)
        choice = placement.choose(task, function(fn), task.candidates())
        assert choice.endpoint_id == b, choice
        assert "5,000 argument bytes" in choice.reason


def test_the_tie_break_is_a_stable_hash_of_the_task_id() -> None:
    endpoints = [new_id() for _ in range(3)]
    picks = Counter(tie_break(new_id(), endpoints) for _ in range(300))
    assert set(picks) == set(endpoints)
    task_id = new_id()
    assert tie_break(task_id, endpoints) == tie_break(task_id, list(reversed(endpoints)))


def test_round_robin_and_random_choose_among_live_endpoints_only(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    a, b, dead, fn = new_id(), new_id(), new_id(), new_id()
    publish(
        view,
        catalogue,
        produce,
        [
            beat(a),
            beat(b, idle=0, busy=2, queued=9),
            beat(dead, sent_at=time.time() - 100, period_s=1),
        ],
        [advert(a, fn)],
    )
    rr = Placement(view, PlacementPolicy.ROUND_ROBIN)
    chosen = [
        rr.choose(s, function(fn), s.candidates()).endpoint_id
        for s in (submission(fn, [a, b, dead]) for _ in range(10))
    ]
    assert chosen == [sorted([a, b])[i % 2] for i in range(10)]
    rand = Placement(view, PlacementPolicy.RANDOM, seed=7)
    counts = Counter(
        rand.choose(s, function(fn), s.candidates()).endpoint_id
        for s in (submission(fn, [a, b, dead]) for _ in range(200))
    )
    assert set(counts) == {a, b}
    assert min(counts.values()) > 60


def test_a_tombstone_forgets_a_manager_s_advert(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    endpoint, fn = new_id(), new_id()
    publish(view, catalogue, produce, adverts=[advert(endpoint, fn, manager="m1")])
    assert view.warm.warmth(endpoint, fn, None).function_warm
    partition, offset = produce(catalogue.warm, warm_key(endpoint, "m1"), None)
    assert view.wait_for_offset(catalogue.warm, partition, offset, timeout_s=10)
    assert not view.warm.warmth(endpoint, fn, None).function_warm
    assert view.warm.managers(endpoint) == []


def test_an_advert_under_another_key_is_ignored(
    view: RegistryView, catalogue: Catalogue, produce: Produce
) -> None:
    endpoint, fn = new_id(), new_id()
    partition, offset = produce(catalogue.warm, f"{endpoint}/not-its-manager", advert(endpoint, fn))
    assert view.wait_for_offset(catalogue.warm, partition, offset, timeout_s=10)
    assert not view.warm.warmth(endpoint, fn, None).function_warm


def test_the_warm_table_is_bounded() -> None:
    table = WarmTable(max_entries=3)
    endpoints = [new_id() for _ in range(5)]
    for endpoint in endpoints:
        assert table.fold(warm_key(endpoint, "node"), advert(endpoint, "fn"))
    assert len(table) == 3
    assert table.evicted == 2
    # The least recently advertised went first.
    assert [bool(table.managers(e)) for e in endpoints] == [False, False, True, True, True]
    # An advert older than the entry it would replace changes nothing.
    late = advert(endpoints[4], "other")
    stale = WarmAdvert(
        endpoint_id=late.endpoint_id,
        manager_id=late.manager_id,
        advertised_at=late.advertised_at - 100,
        workers=late.workers,
    )
    assert table.fold(warm_key(endpoints[4], "node"), late)
    assert not table.fold(warm_key(endpoints[4], "node"), stale)
    assert table.warmth(endpoints[4], "other", None).function_warm
