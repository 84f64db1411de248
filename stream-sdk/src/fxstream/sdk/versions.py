"""Versions: what a function is registered with, and whether this SDK suits the service.

:func:`registration_metadata` is what :meth:`~fxstream.sdk.Client.register_function`
adds to a function's ``metadata`` (as Globus Compute records the Python and SDK versions a
function was serialized with); :func:`check_versions` is
:meth:`~fxstream.sdk.Client.version_check`'s test of the service's ``GET /v1/version``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from fxstream.sdk.errors import VersionMismatch
from fxstream.topics import client_info

__all__ = ["check_versions", "registration_metadata", "version_tuple"]


def registration_metadata() -> dict[str, str]:
    """``python_version`` and ``sdk_version`` of this process."""
    info = client_info()
    return {"python_version": info.python_version, "sdk_version": info.fxstream_version}


def version_tuple(version: str) -> tuple[int, ...]:
    """``"1.2.3rc1"`` -> ``(1, 2, 3)``: the leading numbers, for ordering releases.

    ``ValueError`` for a version with no leading number (``"unknown"``: a source tree
    without installed metadata)."""
    numbers = re.match(r"\d+(?:\.\d+)*", version.strip())
    if numbers is None:
        raise ValueError(f"{version!r} is not a version number")
    return tuple(int(part) for part in numbers.group().split("."))


def check_versions(service: Mapping[str, Any], endpoint_version: str | None = None) -> None:
    """Raise :class:`VersionMismatch` when this SDK (or ``endpoint_version``) is older than
    the service's ``min_sdk_version`` (``min_ep_version``), naming both versions."""
    checks = [("fxstream SDK", client_info().fxstream_version, "min_sdk_version")]
    if endpoint_version is not None:
        checks.append(("fxstream endpoint", endpoint_version, "min_ep_version"))
    for what, have, key in checks:
        need = str(service.get(key, ""))
        try:
            older = version_tuple(have) < version_tuple(need)
        except ValueError as exc:
            raise VersionMismatch(
                f"cannot compare the {what} version {have!r} with the service's {key} "
                f"{need!r} ({exc}): install fxstream from a release, or update it"
            ) from None
        if older:
            raise VersionMismatch(
                f"the {what} is {have}, older than the service's {key} {need}: update it "
                f"(the service runs {service.get('version')})"
            )
