"""Task status in Globus Compute's words, beside fxstream's own states.

A task's dict from :meth:`~fxstream.sdk.Client.get_task` (and ``get_batch_result``,
``get_tasks``) carries both: ``state``, fxstream's lifecycle state
(:class:`fxstream.topics.TaskStateName`, docs/lifecycle.md), and ``status``, the same in
Globus Compute's vocabulary, so a script written for Globus Compute reads what it
expects (``"success"`` where fxstream says ``succeeded``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = ["GLOBUS_STATUS", "completion_time", "globus_status"]

GLOBUS_STATUS: Final[Mapping[str, str]] = {
    "submitted": "waiting-for-ep",
    "routed": "waiting-for-ep",
    "waiting-for-endpoint": "waiting-for-ep",
    "retrying": "waiting-for-ep",
    # No Globus Compute counterpart (it has no task dependencies): kept as it is.
    "waiting-for-parents": "waiting-for-parents",
    "running": "running",
    "succeeded": "success",
    "failed": "failed",
    "rejected": "failed",
    "cancelled": "cancelled",
}
"""fxstream state -> Globus Compute status."""


def globus_status(state: str) -> str:
    """Globus Compute's status for fxstream's ``state`` (an unknown state as it is)."""
    return GLOBUS_STATUS.get(state, state)


def completion_time(timings: Mapping[str, Any]) -> str | None:
    """Globus Compute's ``completion_t``: when the task finished, epoch seconds as a
    string (the worker's finish, else when its result was published or delivered)."""
    for key in ("finished", "result_published", "delivered"):
        moment = timings.get(key)
        if isinstance(moment, int | float):
            return f"{float(moment):.6f}"
    return None
