"""The files the accounts side of the service reads at start (all 0600 JSON, never argv).

- The platform admin's API token: ``<platform home>/credentials/api-admin.json``,
  ``{"token": ...}``, written by the platform at bootstrap
  (:func:`ensure_admin_token_file`). The service keeps only its SHA-256.
- Globus Auth client credentials (optional):
  ``{"client_id", "client_secret", "allowed_domains": [...], "base_url": null}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

from fxstream.service.auth import DEFAULT_TOKEN_LIFETIME_S, new_token, token_sha256
from fxstream.service.globus_auth import GlobusAuthProvider
from fxstream.service.identity_provider import IdentityProvider
from fxstream.topics import CredentialFileError, read_secret_json, write_secret_file

__all__ = [
    "ADMIN_TOKEN_ENV",
    "ADMIN_TOKEN_FILE_NAME",
    "DEFAULT_LIFETIME_DAYS",
    "GLOBUS_CREDENTIALS_ENV",
    "admin_token_sha256",
    "ensure_admin_token_file",
    "globus_provider",
    "read_admin_token",
]

ADMIN_TOKEN_FILE_NAME: Final = "api-admin.json"
ADMIN_TOKEN_ENV: Final = "FXSTREAM_ADMIN_TOKEN_FILE"
GLOBUS_CREDENTIALS_ENV: Final = "FXSTREAM_GLOBUS_CREDENTIALS"
DEFAULT_LIFETIME_DAYS: Final = DEFAULT_TOKEN_LIFETIME_S / 86400


def ensure_admin_token_file(path: Path) -> str:
    """The admin token in ``path``, creating the file (0600, atomically) with a new one."""
    if not path.exists():
        write_secret_file(path, json.dumps({"token": new_token()}).encode())
    return read_admin_token(path)


def read_admin_token(path: Path) -> str:
    """The admin token of a file :func:`ensure_admin_token_file` wrote (0600 or refused)."""
    token = read_secret_json(path).get("token")
    if not isinstance(token, str) or len(token) < 32:
        raise CredentialFileError(f"{path} has no admin token: delete it and restart the platform")
    return token


def admin_token_sha256(path: Path) -> str:
    """The SHA-256 of the admin token in ``path``: all the service keeps of it."""
    return token_sha256(read_admin_token(path))


def globus_provider(path: Path) -> IdentityProvider:
    """A Globus Auth adapter from a 0600 client-credentials file."""
    fields = read_secret_json(path)
    client_id, secret = fields.get("client_id"), fields.get("client_secret")
    domains = fields.get("allowed_domains")
    base_url = fields.get("base_url")
    if not isinstance(client_id, str) or not isinstance(secret, str):
        raise CredentialFileError(f"{path} needs string fields client_id and client_secret")
    if not isinstance(domains, list) or not all(isinstance(d, str) for d in domains):
        raise CredentialFileError(
            f"{path} needs allowed_domains: a list of username domains that may log in, "
            'or ["*"] for every Globus identity'
        )
    if base_url is not None and not isinstance(base_url, str):
        raise CredentialFileError(f"{path}: base_url must be a string or null")
    return GlobusAuthProvider(client_id, secret, allowed_domains=domains, base_url=base_url)
