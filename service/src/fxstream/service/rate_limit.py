"""Rate limits on registration: a token bucket per (caller, kind of registration).

Registering a user or an endpoint creates Kafka topics (and principals); a
function is a record of up to the topic's size limit. One caller looping on
those routes could fill the broker (about 110,000 partitions an hour from one
client before issue 13). Each caller therefore has a bucket per kind: ``burst``
registrations at once, refilled at ``per_hour`` an hour. A refused call gets
``429`` with ``Retry-After`` (whole seconds until the next token).

The buckets live in the API process's memory: a restart refills them, and
several API processes each limit on their own (the platform runs one).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

__all__ = ["DEFAULT_LIMITS", "RateLimit", "RateLimiter", "RegistrationLimits"]

_MAX_BUCKETS: Final = 100_000


@dataclass(frozen=True)
class RateLimit:
    """``burst`` calls at once, refilled at ``per_hour`` calls an hour."""

    burst: int
    per_hour: float

    def __post_init__(self) -> None:
        if self.burst < 1 or self.per_hour <= 0:
            raise ValueError("a rate limit needs burst >= 1 and per_hour > 0")


@dataclass(frozen=True)
class RegistrationLimits:
    """The limit of each kind of registration, per caller."""

    users: RateLimit = field(default_factory=lambda: RateLimit(burst=100, per_hour=1_000))
    endpoints: RateLimit = field(default_factory=lambda: RateLimit(burst=20, per_hour=100))
    functions: RateLimit = field(default_factory=lambda: RateLimit(burst=200, per_hour=2_000))
    logins: RateLimit = field(default_factory=lambda: RateLimit(burst=20, per_hour=200))
    triggers: RateLimit = field(default_factory=lambda: RateLimit(burst=200, per_hour=2_000))


DEFAULT_LIMITS: Final = RegistrationLimits()


class RateLimiter:
    """Token buckets keyed by ``(kind, caller)``; thread-safe."""

    def __init__(
        self, limits: RegistrationLimits, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # tokens, at

    def take(self, kind: str, caller: str) -> float | None:
        """Spend one call of ``kind`` for ``caller``: None if allowed, else seconds to wait."""
        limit: RateLimit = getattr(self._limits, kind)
        rate_s = limit.per_hour / 3600.0
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.get((kind, caller), (float(limit.burst), now))
            tokens = min(float(limit.burst), tokens + (now - at) * rate_s)
            if tokens < 1.0:
                self._buckets[(kind, caller)] = (tokens, now)
                return max(1.0, math.ceil((1.0 - tokens) / rate_s))
            self._buckets[(kind, caller)] = (tokens - 1.0, now)
            if len(self._buckets) > _MAX_BUCKETS:
                self._forget_full(now)
            return None

    def _forget_full(self, now: float) -> None:
        # A bucket refilled to its burst is the same as no bucket: drop those.
        for key, (tokens, at) in list(self._buckets.items()):
            limit: RateLimit = getattr(self._limits, key[0])
            if tokens + (now - at) * limit.per_hour / 3600.0 >= limit.burst:
                del self._buckets[key]
