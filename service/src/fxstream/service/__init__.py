"""fxstream.service: the management service (REST API and stream processors).

- :func:`create_app`: the REST API (docs/api.md) as a FastAPI app.
- :class:`RegistryView`: the live in-memory view of the registry topics.
- :mod:`~fxstream.service.auth`: API tokens and the sharing rule.
- ``fxstream-service`` (:mod:`~fxstream.service.cli`): runs the API or the processors.

The names below are imported from their modules on first use: a stream processor
(which imports this package first) must not pay for FastAPI (about 1 s) at every start.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fxstream.service.api import AccountSettings, ApiError, create_app
    from fxstream.service.auth import (
        may_use,
        new_token,
        refusal_reason,
        token_matches,
        token_sha256,
    )
    from fxstream.service.rate_limit import RateLimit, RegistrationLimits
    from fxstream.service.registry import LIVENESS_PERIODS, EndpointStatus, RegistryView

_MODULES = {
    "LIVENESS_PERIODS": "fxstream.service.registry",
    "AccountSettings": "fxstream.service.api",
    "ApiError": "fxstream.service.api",
    "EndpointStatus": "fxstream.service.registry",
    "RateLimit": "fxstream.service.rate_limit",
    "RegistrationLimits": "fxstream.service.rate_limit",
    "RegistryView": "fxstream.service.registry",
    "create_app": "fxstream.service.api",
    "may_use": "fxstream.service.auth",
    "new_token": "fxstream.service.auth",
    "refusal_reason": "fxstream.service.auth",
    "token_matches": "fxstream.service.auth",
    "token_sha256": "fxstream.service.auth",
}

__all__ = [
    "LIVENESS_PERIODS",
    "AccountSettings",
    "ApiError",
    "EndpointStatus",
    "RateLimit",
    "RegistrationLimits",
    "RegistryView",
    "create_app",
    "may_use",
    "new_token",
    "refusal_reason",
    "token_matches",
    "token_sha256",
]


def __getattr__(name: str) -> Any:
    """Import one of the package's names from its module on first use."""
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
