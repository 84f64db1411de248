"""fxstream.ops: the local platform launcher, the operator CLI and the benchmarks.

ops/ may import every other fxstream package to launch and measure it; nothing
imports ops/ except the tests.

The names below are imported from their modules on first use: the supervisor
(``python -m fxstream.ops.supervisor``) imports this package first, and must not pay
for the platform, the service and the SDK (about 2 s) before it starts a child.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fxstream.ops.config import ConfigError, PlatformConfig
    from fxstream.ops.install import InstallError, ensure_requirements
    from fxstream.ops.platform import (
        ComponentStatus,
        ConnectionInfo,
        Platform,
        PlatformError,
        PlatformStatus,
    )
    from fxstream.ops.process import ManagedProcess, ProcessStartError

_MODULES = {
    "ComponentStatus": "fxstream.ops.platform",
    "ConfigError": "fxstream.ops.config",
    "ConnectionInfo": "fxstream.ops.platform",
    "InstallError": "fxstream.ops.install",
    "ManagedProcess": "fxstream.ops.process",
    "Platform": "fxstream.ops.platform",
    "PlatformConfig": "fxstream.ops.config",
    "PlatformError": "fxstream.ops.platform",
    "PlatformStatus": "fxstream.ops.platform",
    "ProcessStartError": "fxstream.ops.process",
    "ensure_requirements": "fxstream.ops.install",
}

__all__ = [
    "ComponentStatus",
    "ConfigError",
    "ConnectionInfo",
    "InstallError",
    "ManagedProcess",
    "Platform",
    "PlatformConfig",
    "PlatformError",
    "PlatformStatus",
    "ProcessStartError",
    "ensure_requirements",
]


def __getattr__(name: str) -> Any:
    """Import one of the package's names from its module on first use."""
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
