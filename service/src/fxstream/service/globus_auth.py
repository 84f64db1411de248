"""The Globus Auth adapter of the identity-provider seam (token introspection).

The service is registered with Globus Auth as a confidential client (its
client id and secret, from a 0600 file, never argv). A user presents a Globus
access token issued for this client; the adapter asks Globus Auth about it with
``ConfidentialAppAuthClient.oauth2_token_introspect`` (globus-sdk) and accepts
it only when it is ``active``, its audience names this client, and the
identity's username is in an allowed domain (or the allow-list is ``*``).

Tests run it against a local stand-in introspection server (``base_url``): the
Globus cloud cannot be reached from the test machines.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import globus_sdk

from fxstream.service.identity_provider import (
    ExternalIdentity,
    IdentityProviderUnavailable,
    IdentityRejected,
)

__all__ = ["GlobusAuthProvider"]


class GlobusAuthProvider:
    """Introspects Globus access tokens (``POST /v2/oauth2/token/introspect``)."""

    name = "globus"

    def __init__(
        self,
        client_id: str,
        client_secret: str,
        *,
        allowed_domains: Iterable[str],
        base_url: str | None = None,
    ) -> None:
        """``allowed_domains``: username domains (``alice@<domain>``) that may log in;
        ``["*"]`` allows every Globus identity. ``base_url``: a non-production Auth."""
        self.client_id = client_id
        self.allowed_domains = frozenset(d.lower() for d in allowed_domains)
        if not self.allowed_domains:
            raise ValueError("allowed_domains is empty: name the domains that may log in, or '*'")
        self._client = globus_sdk.ConfidentialAppAuthClient(
            client_id, client_secret, base_url=base_url, app_name="fxstream"
        )

    def __repr__(self) -> str:
        return f"GlobusAuthProvider(client_id={self.client_id!r})"

    def identify(self, token: str) -> ExternalIdentity:
        """The Globus identity of an active token issued for this client."""
        try:
            data: dict[str, Any] = dict(self._client.oauth2_token_introspect(token).data)
        except globus_sdk.GlobusAPIError as exc:
            raise IdentityProviderUnavailable(
                f"Globus Auth refused to introspect the token ({exc.http_status} {exc.code}): "
                "check the service's Globus client id and secret"
            ) from exc
        except globus_sdk.NetworkError as exc:
            raise IdentityProviderUnavailable(
                f"cannot reach Globus Auth ({type(exc).__name__}); retry later"
            ) from exc
        if data.get("active") is not True:
            raise IdentityRejected(
                "Globus Auth says the token is not active (expired or revoked): log in to "
                "Globus again and send the new access token"
            )
        audience = data.get("aud") or []
        audiences = [audience] if isinstance(audience, str) else list(audience)
        if self.client_id not in audiences:
            raise IdentityRejected(
                "the Globus token was not issued for this fxstream service: request a token "
                f"with a scope of client {self.client_id}"
            )
        exp = data.get("exp")
        if isinstance(exp, int | float) and exp <= time.time():
            raise IdentityRejected("the Globus token has expired: log in to Globus again")
        subject, username = data.get("sub"), data.get("username")
        if not isinstance(subject, str) or not subject or not isinstance(username, str):
            raise IdentityRejected("Globus Auth returned no identity for the token")
        domain = username.rpartition("@")[2].lower()
        if "*" not in self.allowed_domains and domain not in self.allowed_domains:
            raise IdentityRejected(
                f"identities of {domain!r} may not use this fxstream service: ask its admin "
                "to allow the domain, or to create your user (fxstream user add)"
            )
        name = data.get("name")
        return ExternalIdentity(
            provider=self.name,
            subject=subject,
            username=username,
            name=name if isinstance(name, str) and name else username,
        )
