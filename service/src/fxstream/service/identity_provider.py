"""The identity-provider seam: who a token of an outside identity provider belongs to.

A provider turns a bearer token issued by someone else (e.g. Globus Auth) into
an :class:`ExternalIdentity`, or refuses it with :class:`IdentityRejected`
(whose message says what to do). The REST API maps the identity to an
fxstream user (``UserRecord.external_identity`` is ``"<provider>:<subject>"``),
creating the user at its first login, and answers with an fxstream token: the
provider's token itself is never stored. Adapters: :mod:`fxstream.service.globus_auth`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "ExternalIdentity",
    "IdentityProvider",
    "IdentityProviderUnavailable",
    "IdentityRejected",
]


@dataclass(frozen=True)
class ExternalIdentity:
    """An identity a provider vouches for: ``subject`` is its stable id there."""

    provider: str
    subject: str
    username: str
    name: str

    @property
    def key(self) -> str:
        """``"<provider>:<subject>"``, the value of ``UserRecord.external_identity``."""
        return f"{self.provider}:{self.subject}"


class IdentityRejected(Exception):
    """The provider does not vouch for this token (inactive, wrong audience, not allowed)."""


class IdentityProviderUnavailable(Exception):
    """The provider could not be asked (network, or it answered with an error)."""


class IdentityProvider(Protocol):
    """Checks a provider's bearer token and says whose it is."""

    name: str

    def identify(self, token: str) -> ExternalIdentity:
        """The identity ``token`` authenticates now.

        Raises :class:`IdentityRejected` or :class:`IdentityProviderUnavailable`.
        """
        ...
