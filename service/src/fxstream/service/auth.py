"""Who may do what: API tokens and the sharing rules for functions and endpoints.

This is the seam broker-enforced security (SASL/ACLs) will replace: today a
user is whoever presents a token whose SHA-256 the ``users`` topic holds.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

from fxstream.topics import EndpointRecord, FunctionRecord, TaskCancel, TaskSubmission, UserRecord

__all__ = [
    "cancel_refusal_reason",
    "may_use",
    "new_token",
    "refusal_reason",
    "token_matches",
    "token_sha256",
]


def new_token() -> str:
    """A fresh API token (256 random bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def token_sha256(token: str) -> str:
    """The hex SHA-256 the service stores instead of the token."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(token: str, user: UserRecord) -> bool:
    """True when ``token`` is ``user``'s (compared in constant time)."""
    return hmac.compare_digest(token_sha256(token), user.token_sha256)


def may_use(user_id: str, *, owner_id: str, public: bool, allowed_users: Sequence[str]) -> bool:
    """The sharing rule for functions and endpoints: owner, public, or allowed."""
    return user_id == owner_id or public or user_id in allowed_users


def _shared_with(user: UserRecord, record: FunctionRecord | EndpointRecord | None) -> bool:
    return record is not None and may_use(
        user.user_id,
        owner_id=record.owner_id,
        public=record.public,
        allowed_users=record.allowed_users,
    )


def refusal_reason(
    submission: TaskSubmission,
    user: UserRecord | None,
    function: FunctionRecord | None,
    endpoint: EndpointRecord | None,
) -> str | None:
    """Why the router must refuse ``submission``, or None when it may run.

    The reasons are written for the submitter: they say what is wrong and what
    to do, and never reveal whether another user's private object exists.
    """
    # Who submitted is the broker's answer (the user whose from.user topic carries the
    # record; the router dead-letters a record naming anyone else), never a token in it.
    if user is None:
        return (
            f"user {submission.user_id!r} is not registered (or was deleted): ask the "
            "platform admin to create your account (fxstream user add)"
        )
    if not _shared_with(user, function):
        return (
            f"function {submission.function_id!r} does not exist or is not shared with you: "
            "register it with Client.register_function, or ask its owner to share it"
        )
    if not _shared_with(user, endpoint):
        return (
            f"endpoint {submission.endpoint_id!r} does not exist or is not shared with you: "
            "list the endpoints you may use with Client.list_endpoints"
        )
    return None


def cancel_refusal_reason(
    cancel: TaskCancel, user: UserRecord | None, endpoint: EndpointRecord | None
) -> str | None:
    """Why the router must not forward ``cancel``, or None when it may.

    The router checks who asks (the user of the topic the broker let write it) and
    that the user may use the endpoint; whether the task is the user's own is checked by the agent
    that holds the task, the only place that knows its submitter without a join.
    """
    if user is None:
        return (
            f"cancel of task {cancel.task_id}: user {cancel.user_id!r} is not registered (or "
            "was deleted): cancel as the user who submitted the task"
        )
    if not _shared_with(user, endpoint):
        return (
            f"cancel of task {cancel.task_id}: endpoint {cancel.endpoint_id!r} does not exist or "
            "is not shared with you: name the endpoint the task was submitted to"
        )
    return None
