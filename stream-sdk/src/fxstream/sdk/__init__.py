"""fxstream: the user SDK (Client, Executor, streams).

Nothing is exported yet: this package exists so the workspace layout and the
namespace are in place; see docs/architecture.md for what is built.
"""

__all__: list[str] = []
