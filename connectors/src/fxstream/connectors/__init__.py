"""fxstream: bulk-data connectors, event sources and sinks.

Nothing is exported yet: this package exists so the workspace layout and the
namespace are in place; see docs/architecture.md for what is built.
"""

__all__: list[str] = []
