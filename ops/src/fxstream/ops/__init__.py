"""fxstream.ops: the local platform launcher, the operator CLI and the benchmarks.

ops/ may import every other fxstream package to launch and measure it; nothing
imports ops/ except the tests.
"""

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
