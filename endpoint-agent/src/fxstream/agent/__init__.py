"""fxstream: the endpoint agent (pulls its queue, runs tasks in warm workers).

Nothing is exported yet: this package exists so the workspace layout and the
namespace are in place; see docs/architecture.md for what is built.
"""

__all__: list[str] = []
