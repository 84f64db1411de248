"""Who may do what: API tokens and the sharing rules for functions and endpoints.

Three kinds of bearer token reach the REST API, and the service stores none of
them, only their SHA-256:

- a user's token (``UserRecord.token_sha256``): it expires
  (``token_expires_at``), can be rotated (the token rotated away stays valid
  until ``previous_token_valid_until``, or not at all) and revoked
  (``token_revoked_at``);
- an endpoint's own token (``EndpointRecord.token_sha256``), issued when the
  endpoint is registered: the agent's credential, never its owner's token;
- the platform admin's token, whose hash the service is given at start (from
  a 0600 file the platform writes at bootstrap), never from a record: the only
  token that creates users and issues replacement tokens.

Every comparison of a presented token's hash with a stored one is constant-time
(:func:`hmac.compare_digest`); lookups are by the SHA-256 of the token, so their
timing says nothing usable about a token nobody has.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import time
from collections.abc import Sequence
from typing import Final

from fxstream.topics import EndpointRecord, FunctionRecord, TaskCancel, TaskSubmission, UserRecord

__all__ = [
    "DEFAULT_ROTATION_GRACE_S",
    "DEFAULT_TOKEN_LIFETIME_S",
    "MAX_ROTATION_GRACE_S",
    "TokenCheck",
    "cancel_refusal_reason",
    "check_user_token",
    "digest_matches",
    "endpoint_token_matches",
    "may_use",
    "new_token",
    "refusal_reason",
    "token_expires_at",
    "token_matches",
    "token_sha256",
]

DEFAULT_TOKEN_LIFETIME_S: Final = 30 * 24 * 3600.0
"""How long a user token lives unless the service is told otherwise (30 days)."""
DEFAULT_ROTATION_GRACE_S: Final = 0.0
"""A rotation revokes the old token at once unless the caller asks for a grace."""
MAX_ROTATION_GRACE_S: Final = 24 * 3600.0
"""The longest grace a rotated-away token may keep (one day)."""


class TokenCheck(enum.StrEnum):
    """What a presented token is to the user record its hash points at."""

    VALID = "valid"
    GRACE = "grace"  # rotated away, still inside its grace
    EXPIRED = "expired"
    REVOKED = "revoked"
    ROTATED_AWAY = "rotated-away"  # rotated away, grace over (or none)
    UNKNOWN = "unknown"

    @property
    def accepted(self) -> bool:
        """True for a token that authenticates its user now."""
        return self in (TokenCheck.VALID, TokenCheck.GRACE)


def new_token() -> str:
    """A fresh API token (256 random bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def token_sha256(token: str) -> str:
    """The hex SHA-256 the service stores instead of the token."""
    return hashlib.sha256(token.encode()).hexdigest()


def digest_matches(presented_sha256: str, stored_sha256: str | None) -> bool:
    """True when two token hashes are equal (constant time); never for a missing one."""
    if stored_sha256 is None:
        return False
    return hmac.compare_digest(presented_sha256.encode(), stored_sha256.encode())


def token_expires_at(user: UserRecord, lifetime_s: float = DEFAULT_TOKEN_LIFETIME_S) -> float:
    """When ``user``'s current token expires (a record without the field: created + lifetime)."""
    if user.token_expires_at is not None:
        return user.token_expires_at
    return user.created_at + lifetime_s


def check_user_token(
    presented_sha256: str,
    user: UserRecord,
    *,
    now: float | None = None,
    lifetime_s: float = DEFAULT_TOKEN_LIFETIME_S,
) -> TokenCheck:
    """Whether the token hashing to ``presented_sha256`` authenticates ``user`` at ``now``."""
    now = time.time() if now is None else now
    if digest_matches(presented_sha256, user.token_sha256):
        if user.token_revoked_at is not None:
            return TokenCheck.REVOKED
        if now >= token_expires_at(user, lifetime_s):
            return TokenCheck.EXPIRED
        return TokenCheck.VALID
    if digest_matches(presented_sha256, user.previous_token_sha256):
        # A revocation revokes the grace token too; a rotation never extends expiry.
        valid_until = user.previous_token_valid_until or 0.0
        if user.token_revoked_at is None and now < valid_until:
            return TokenCheck.GRACE
        return TokenCheck.ROTATED_AWAY
    return TokenCheck.UNKNOWN


def token_matches(token: str, user: UserRecord) -> bool:
    """True when ``token`` authenticates ``user`` now (constant-time comparison).

    A token that expired, was revoked, or was rotated away past its grace does not.
    """
    return check_user_token(token_sha256(token), user).accepted


def endpoint_token_matches(presented_sha256: str, endpoint: EndpointRecord) -> bool:
    """True when the token hashing to ``presented_sha256`` is ``endpoint``'s own."""
    return digest_matches(presented_sha256, endpoint.token_sha256)


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
    *,
    endpoint_id: str | None = None,
) -> str | None:
    """Why the router must refuse ``submission``, or None when it may run.

    ``endpoint`` is the record of ``endpoint_id`` (default: the submission's
    ``endpoint_id``); for a submission with an endpoint group the router asks once
    per candidate and refuses the task if any one is refused (a group is never a way
    to reach an endpoint the user may not use).

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
        named = submission.endpoint_id if endpoint_id is None else endpoint_id
        if len(submission.candidates()) > 1:
            return (
                f"endpoint {named!r} of the task's endpoint group "
                f"{list(submission.candidates())} does not exist or is not shared with you: "
                "remove it from the group (list the endpoints you may use with "
                "Client.list_endpoints)"
            )
        return (
            f"endpoint {named!r} does not exist or is not shared with you: "
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
