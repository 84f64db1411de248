"""What the dashboard shows, rendered as HTML fragments, with bounded work per snapshot.

:func:`snapshot` reads the API's registry view, its task-state table, its analytics view
and the dashboard's feeds (:mod:`fxstream.service.dashboard_feeds`) and renders one
fragment per section of the page: the same fragments make the page's first paint and
every live update (:mod:`fxstream.service.dashboard`), so there is one renderer, here,
and every value in them is HTML-escaped.

What a viewer sees: a user, the endpoints it may use, and its own tasks, errors and
trigger rules; the platform admin, everyone's, and the dead-letter topic's newest
entries (descriptions only: never a record's original bytes).

Each snapshot's work is bounded, whatever the platform holds: at most
:data:`MAX_ENDPOINTS` endpoints and :data:`MAX_TRIGGERS` rules rendered, task states
counted over at most :data:`TASK_SCAN` task summaries (newest first), errors looked for
among at most :data:`ERROR_SCAN` summaries per user, the admin's task figures over at most
:data:`ADMIN_USERS` users (the most recently registered), :data:`RECENT_TASKS` tasks and
:data:`RECENT_ERRORS` errors decoded, and analytics windows of the last
:data:`RATE_HORIZON_S` only.
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from fxstream.service.analytics_view import summarize
from fxstream.service.auth import may_use
from fxstream.service.dashboard_feeds import DashboardFeeds
from fxstream.service.registry import RegistryView
from fxstream.service.task_table import TaskQuery
from fxstream.topics import EndpointRecord, TaskState, TaskStateName, TriggerRule, UserRecord

if TYPE_CHECKING:
    from fxstream.service.analytics_view import AnalyticsView

__all__ = [
    "ADMIN_USERS",
    "ERROR_SCAN",
    "MAX_ENDPOINTS",
    "MAX_TRIGGERS",
    "RATE_HORIZON_S",
    "RECENT_ERRORS",
    "RECENT_TASKS",
    "SECTIONS",
    "TASK_SCAN",
    "Viewer",
    "snapshot",
]

MAX_ENDPOINTS: Final = 200
MAX_TRIGGERS: Final = 100
TASK_SCAN: Final = 10_000
"""Task summaries counted per snapshot (the same bound as a ``GET /v1/tasks`` page)."""
ERROR_SCAN: Final = 2_000
ADMIN_USERS: Final = 50
RECENT_TASKS: Final = 10
RECENT_ERRORS: Final = 10
RECENT_DEAD_LETTERS: Final = 20
RATE_HORIZON_S: Final = 600.0
MESSAGE_CHARS: Final = 300
SECTIONS: Final = ("summary", "endpoints", "tasks", "rates", "errors", "triggers", "dead-letters")
"""The page's sections, in order (``dead-letters`` for the admin only)."""

_TERMINAL: Final = frozenset({"succeeded", "failed", "rejected", "cancelled"})
_ERROR_STATES: Final = frozenset({"failed", "rejected"})
_STATE_ORDER: Final = tuple(str(s) for s in TaskStateName)


@dataclass(frozen=True)
class Viewer:
    """Who looks: a user, or the platform admin (everyone's, and the dead letters)."""

    kind: Literal["user", "admin"]
    user: UserRecord | None = None

    @property
    def is_admin(self) -> bool:
        """True for the platform admin."""
        return self.kind == "admin"

    @property
    def label(self) -> str:
        """How the page names the viewer."""
        if self.user is None:
            return "the platform admin"
        return f"{self.user.name} ({self.user.user_id})"


# --- HTML helpers --------------------------------------------------------------------------


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _clock(at: float | None) -> str:
    if at is None:
        return "-"
    return time.strftime("%H:%M:%S", time.gmtime(at))


def _age(at: float | None, now: float) -> str:
    if at is None:
        return "never"
    seconds = max(0.0, now - at)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _cut(text: str, limit: int = MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], empty: str) -> str:
    """A table of already-escaped cells; ``empty`` (plain text) when there is no row."""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    if not body:
        return f'<p class="empty">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _badge(state: str) -> str:
    return f'<span class="state state-{_e(state)}">{_e(state)}</span>'


def _ident(value: str | None) -> str:
    return "-" if value is None else f'<code class="id">{_e(value)}</code>'


# --- what the viewer may see ---------------------------------------------------------------


def _endpoints(view: RegistryView, viewer: Viewer) -> list[EndpointRecord]:
    every = view.endpoints()
    if viewer.user is None:
        return every
    user_id = viewer.user.user_id
    return [
        e
        for e in every
        if may_use(user_id, owner_id=e.owner_id, public=e.public, allowed_users=e.allowed_users)
    ]


def _users(view: RegistryView, viewer: Viewer) -> tuple[list[UserRecord], int]:
    """The users whose tasks the viewer sees (at most ADMIN_USERS), and how many exist."""
    if viewer.user is not None:
        return [viewer.user], 1
    every = sorted(view.users(), key=lambda u: u.created_at, reverse=True)
    return every[:ADMIN_USERS], len(every)


def _triggers(view: RegistryView, viewer: Viewer) -> list[TriggerRule]:
    rules = view.triggers()
    if viewer.user is not None:
        rules = [r for r in rules if r.owner_id == viewer.user.user_id]
    return sorted(rules, key=lambda r: r.created_at)


def _newest_tasks(
    view: RegistryView, users: Sequence[UserRecord], states: frozenset[str] | None, scan: int
) -> list[TaskState]:
    found: list[TaskState] = []
    limit = RECENT_ERRORS if states is not None else RECENT_TASKS
    for user in users:
        query = TaskQuery(user_id=user.user_id, states=states, descending=True)
        page = view.query_tasks(query, limit=limit, max_scan=scan)
        for task_id, _ in page.matches:
            task = view.task(task_id)
            if task is not None and task.user_id == user.user_id:
                found.append(task)
    found.sort(key=lambda t: t.timings.submitted_at or t.updated_at, reverse=True)
    return found[:limit]


def _function_name(view: RegistryView, function_id: str) -> str:
    function = view.function(function_id)
    return _e(function.name) if function is not None else _ident(function_id)


def _endpoint_name(view: RegistryView, endpoint_id: str) -> str:
    endpoint = view.endpoint(endpoint_id)
    return _e(endpoint.name) if endpoint is not None else _ident(endpoint_id)


def _user_name(view: RegistryView, user_id: str) -> str:
    user = view.user(user_id)
    return _e(user.name) if user is not None else _ident(user_id)


# --- sections ------------------------------------------------------------------------------


def _endpoints_section(
    view: RegistryView, viewer: Viewer, feeds: DashboardFeeds | None, now: float
) -> tuple[str, int, int]:
    endpoints = _endpoints(view, viewer)
    statuses = {e.endpoint_id: view.endpoint_status(e.endpoint_id, now) for e in endpoints}
    rank = {"online": 0, "lost": 1, "never-seen": 2}
    endpoints.sort(key=lambda e: (rank[statuses[e.endpoint_id].state], e.name, e.endpoint_id))
    online = sum(1 for s in statuses.values() if s.state == "online")
    warm = feeds.warm_by_endpoint() if feeds is not None else {}
    rows: list[list[str]] = []
    for endpoint in endpoints[:MAX_ENDPOINTS]:
        status = statuses[endpoint.endpoint_id]
        managers = warm.get(endpoint.endpoint_id, [])
        containers = sorted({c for m in managers for c in m.containers})
        warm_text = (
            f"{len(managers)} manager(s), {sum(m.functions for m in managers)} function(s) "
            f"loaded, {sum(m.idle for m in managers)} idle"
            if managers
            else "-"
        )
        if containers:
            warm_text += "; containers: " + ", ".join(_e(c) for c in containers[:8])
        blocks = (
            f"{status.blocks_pending} pending / {status.blocks_running} running"
            if status.blocks_pending or status.blocks_running
            else "-"
        )
        row = [
            f"{_e(endpoint.name)}<br>{_ident(endpoint.endpoint_id)}",
            _badge(status.state),
            _e(_age(status.last_seen, now)),
            f"{status.workers_total} ({status.workers_busy} busy, {status.workers_idle} idle)",
            str(status.queue_depth),
            blocks,
            warm_text,
        ]
        if viewer.is_admin:
            row.insert(1, _user_name(view, endpoint.owner_id))
        rows.append(row)
    headers = ["endpoint", "state", "last heartbeat", "workers", "queue", "blocks", "warm"]
    if viewer.is_admin:
        headers.insert(1, "owner")
    more = len(endpoints) - MAX_ENDPOINTS
    extra = f'<p class="note">and {more} more not shown</p>' if more > 0 else ""
    body = _table(headers, rows, "no endpoint you may use") + extra
    return body, online, len(endpoints)


def _tasks_section(
    view: RegistryView, viewer: Viewer, users: Sequence[UserRecord], user_total: int
) -> tuple[str, int]:
    counts: dict[str, int] = {}
    complete = True
    scanned = 0
    budget = max(200, TASK_SCAN // max(1, len(users)))
    for user in users:
        found = view.count_task_states(user.user_id, max_scan=budget)
        scanned += found.scanned
        complete = complete and found.complete
        for state, n in found.by_state.items():
            counts[state] = counts.get(state, 0) + n
    total = sum(counts.values())
    in_flight = sum(n for state, n in counts.items() if state not in _TERMINAL)
    scope = "your tasks" if viewer.user is not None else "every user's tasks"
    if not complete:
        scope += f" (the newest {scanned:,} counted)"
    if viewer.is_admin and user_total > len(users):
        scope += f" (the {len(users)} newest of {user_total} users)"
    states = "".join(
        f'<li>{_badge(state)} <span class="count" id="task-state-{_e(state)}">{counts[state]}'
        "</span></li>"
        for state in _STATE_ORDER
        if counts.get(state)
    )
    head = (
        f'<p class="figures">Tasks: <strong id="task-total">{total}</strong> '
        f'<span class="note">{_e(scope)}</span>; in flight: '
        f'<strong id="task-in-flight">{in_flight}</strong></p>'
        f'<ul class="states">{states}</ul>'
    )
    recent = _newest_tasks(view, users, None, budget)
    rows = []
    for task in recent:
        timings = task.timings
        took = (
            timings.finished_at - timings.submitted_at
            if timings.finished_at is not None and timings.submitted_at is not None
            else None
        )
        row = [
            _ident(task.task_id),
            _function_name(view, task.function_id),
            _endpoint_name(view, task.endpoint_id),
            _badge(str(task.state)),
            _e(_clock(timings.submitted_at)),
            _e(_seconds(took)),
        ]
        if viewer.is_admin:
            row.insert(1, _user_name(view, task.user_id))
        rows.append(row)
    headers = ["task", "function", "endpoint", "state", "submitted (UTC)", "took"]
    if viewer.is_admin:
        headers.insert(1, "user")
    return head + "<h3>Newest tasks</h3>" + _table(headers, rows, "no task yet"), in_flight


def _rates_section(analytics: AnalyticsView | None, viewer: Viewer, now: float) -> tuple[str, int]:
    if analytics is None:
        return '<p class="empty">the analytics view is not running</p>', 0
    found = analytics.query(
        user_id=None if viewer.user is None else viewer.user.user_id,
        window="tumbling",
        dimension="user",
        since=now - RATE_HORIZON_S,
        combine_users=viewer.user is None,
    )
    windows = sorted((summarize(a) for a in found), key=lambda w: w["start"], reverse=True)
    finished = sum(int(w["finished"]) for w in windows)
    errors = sum(int(w["errors"]) for w in windows)
    span = max((w["end"] for w in windows), default=now) - min(
        (w["start"] for w in windows), default=now
    )
    rate = finished / span if span > 0 else 0.0
    head = (
        f'<p class="figures">Last {RATE_HORIZON_S / 60:.0f} min: '
        f'<strong id="rate-finished">{finished}</strong> finished, '
        f'<strong id="rate-per-s">{rate:.2f}</strong>/s, '
        f'<strong id="rate-errors">{errors}</strong> failed or rejected</p>'
    )
    rows = [
        [
            _e(f"{_clock(w['start'])}-{_clock(w['end'])}"),
            str(w["finished"]),
            str(w["succeeded"]),
            str(w["errors"]),
            _e(f"{w['finished_per_s']:.2f}"),
            _e(_seconds(w["latency_s"]["p50"])),
            _e(_seconds(w["latency_s"]["p99"])),
        ]
        for w in windows
    ]
    headers = ["window (UTC)", "finished", "succeeded", "errors", "per s", "p50", "p99"]
    return head + _table(headers, rows, "no task finished in this time"), errors


def _errors_section(view: RegistryView, viewer: Viewer, users: Sequence[UserRecord]) -> str:
    failed = _newest_tasks(view, users, _ERROR_STATES, ERROR_SCAN)
    rows = []
    for task in failed:
        error = task.error
        row = [
            _e(_clock(task.timings.finished_at or task.updated_at)),
            _ident(task.task_id),
            _function_name(view, task.function_id),
            _endpoint_name(view, task.endpoint_id),
            _badge(str(task.state)),
            f'<code class="error-type">{_e(error.type if error else "")}</code>',
            _e(_cut(error.message) if error else ""),
        ]
        if viewer.is_admin:
            row.insert(2, _user_name(view, task.user_id))
        rows.append(row)
    headers = ["at (UTC)", "task", "function", "endpoint", "state", "error", "message"]
    if viewer.is_admin:
        headers.insert(2, "user")
    return _table(headers, rows, "no failed or rejected task among the newest")


def _triggers_section(
    view: RegistryView, analytics: AnalyticsView | None, viewer: Viewer, now: float
) -> str:
    rules = _triggers(view, viewer)
    finished: dict[str, int] = {}
    if analytics is not None and rules:
        for aggregate in analytics.query(
            user_id=None if viewer.user is None else viewer.user.user_id,
            window="tumbling",
            dimension="rule",
            since=now - RATE_HORIZON_S,
        ):
            finished[aggregate.key] = finished.get(aggregate.key, 0) + aggregate.finished
    rows = []
    for rule in rules[:MAX_TRIGGERS]:
        limits = []
        if rule.limits.max_in_flight is not None:
            limits.append(f"{rule.limits.max_in_flight} in flight")
        if rule.limits.max_per_second is not None:
            limits.append(f"{rule.limits.max_per_second:g}/s")
        row = [
            f"{_e(rule.name)}<br>{_ident(rule.rule_id)}",
            _e(rule.source),
            _e(rule.event_type or "any"),
            _e(rule.key_pattern),
            _function_name(view, rule.function_id),
            _endpoint_name(view, rule.endpoint_id),
            _badge("paused" if rule.paused else "active"),
            _e(", ".join(limits) or "-"),
            str(finished.get(rule.rule_id, 0)),
        ]
        if viewer.is_admin:
            row.insert(1, _user_name(view, rule.owner_id))
        rows.append(row)
    headers = [
        "rule",
        "source",
        "event type",
        "key pattern",
        "function",
        "endpoint",
        "state",
        "limits",
        f"finished (last {RATE_HORIZON_S / 60:.0f} min)",
    ]
    if viewer.is_admin:
        headers.insert(1, "owner")
    more = len(rules) - MAX_TRIGGERS
    extra = f'<p class="note">and {more} more not shown</p>' if more > 0 else ""
    return _table(headers, rows, "no trigger rule") + extra


def _dead_letters_section(feeds: DashboardFeeds | None) -> str:
    if feeds is None:
        return '<p class="empty">not read yet</p>'
    rows = [
        [
            _e(_clock(note.failed_at)),
            _e(note.component),
            f'<code class="error-type">{_e(note.error_type)}</code>',
            _e(note.reason),
            _e(f"{note.original_topic} [{note.original_partition}] @ {note.original_offset}"),
            _ident(note.task_id),
        ]
        for note in feeds.dead_letters(RECENT_DEAD_LETTERS)
    ]
    headers = ["at (UTC)", "component", "error type", "reason", "original record", "task"]
    return _table(headers, rows, "no dead letter among the newest read")


def _summary_section(
    viewer: Viewer, online: int, endpoints: int, in_flight: int, errors: int, now: float
) -> str:
    return (
        f'<p class="figures">Signed in as <strong id="viewer">{_e(viewer.label)}</strong>. '
        f'Endpoints online: <strong id="endpoints-online">{online}</strong> of '
        f"<strong>{endpoints}</strong>; tasks in flight: <strong>{in_flight}</strong>; "
        f"errors in the last {RATE_HORIZON_S / 60:.0f} min: <strong>{errors}</strong>. "
        f'<span class="note">As of {_e(_clock(now))} UTC.</span></p>'
    )


def snapshot(
    view: RegistryView,
    analytics: AnalyticsView | None,
    feeds: DashboardFeeds | None,
    viewer: Viewer,
    now: float | None = None,
) -> dict[str, Any]:
    """``{"at": now, "sections": {section: html}}`` for ``viewer`` (see the module)."""
    now = time.time() if now is None else now
    users, user_total = _users(view, viewer)
    endpoints, online, endpoint_count = _endpoints_section(view, viewer, feeds, now)
    tasks, in_flight = _tasks_section(view, viewer, users, user_total)
    rates, errors = _rates_section(analytics, viewer, now)
    sections = {
        "summary": _summary_section(viewer, online, endpoint_count, in_flight, errors, now),
        "endpoints": endpoints,
        "tasks": tasks,
        "rates": rates,
        "errors": _errors_section(view, viewer, users),
        "triggers": _triggers_section(view, analytics, viewer, now),
    }
    if viewer.is_admin:
        sections["dead-letters"] = _dead_letters_section(feeds)
    return {"at": now, "sections": sections}
