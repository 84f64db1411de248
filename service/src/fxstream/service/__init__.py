"""fxstream.service: the management service (REST API and stream processors).

- :func:`create_app`: the REST API (docs/api.md) as a FastAPI app.
- :class:`RegistryView`: the live in-memory view of the registry topics.
- :mod:`~fxstream.service.auth`: API tokens and the sharing rule.
- ``fxstream-service`` (:mod:`~fxstream.service.cli`): runs the API or the processors.
"""

from fxstream.service.api import AccountSettings, ApiError, create_app
from fxstream.service.auth import may_use, new_token, refusal_reason, token_matches, token_sha256
from fxstream.service.rate_limit import RateLimit, RegistrationLimits
from fxstream.service.registry import LIVENESS_PERIODS, EndpointStatus, RegistryView

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
