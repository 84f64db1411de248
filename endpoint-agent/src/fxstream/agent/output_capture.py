"""What a task prints, kept for its result: the tail of ``sys.stdout`` and ``sys.stderr``.

A worker runs one task at a time. While the function runs, :func:`captured` replaces
``sys.stdout`` and ``sys.stderr`` with :class:`TailBuffer` s, which keep only the last
``limit`` characters (and count what they dropped), so a function that prints a
gigabyte costs the worker ``limit`` characters, not a gigabyte. The texts travel in the
task's result (``TaskResult.stdout`` / ``stderr``), where the byte budget bounds them
again (:data:`fxstream.topics.budget.OUTPUT_MAX_BYTES`).

What is captured: writes through Python's ``sys.stdout`` / ``sys.stderr`` (``print``,
``logging`` to a stream handler made during the call, ``sys.stdout.write``), from any
thread, while the function runs. What is not: writes to the file descriptors 1 and 2
themselves (a C extension's ``printf``, a subprocess that inherits them), which go to
the worker's log as before; a ``ShellFunction`` returns its command's output in its
``ShellResult``.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from typing import Final

__all__ = ["DEFAULT_LIMIT_CHARS", "CapturedOutput", "TailBuffer", "captured"]

DEFAULT_LIMIT_CHARS: Final = 16_384
"""Characters kept per stream (the result's budget then bounds them in bytes)."""


class TailBuffer(io.TextIOBase):
    """A text stream keeping only the last ``limit`` characters written to it."""

    def __init__(self, limit: int = DEFAULT_LIMIT_CHARS) -> None:
        super().__init__()
        self.limit = limit
        self.dropped = 0
        self._parts: list[str] = []
        self._size = 0

    def writable(self) -> bool:
        """True."""
        return True

    def write(self, text: str) -> int:
        """Keep ``text`` (its tail, past ``limit``); returns its length, as a stream does."""
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._parts.append(text)
        self._size += len(text)
        if self._size > 2 * self.limit:
            self._trim()
        return len(text)

    def _trim(self) -> None:
        whole = "".join(self._parts)
        keep = whole[-self.limit :] if self.limit > 0 else ""
        self.dropped += len(whole) - len(keep)
        self._parts = [keep] if keep else []
        self._size = len(keep)

    def text(self) -> str:
        """What is kept, after a line saying how many characters went before it."""
        if self._size > self.limit:
            self._trim()
        kept = "".join(self._parts)
        if self.dropped:
            return f"[... {self.dropped:,} characters of output dropped ...]\n{kept}"
        return kept


class CapturedOutput:
    """The two buffers of one call: read :attr:`stdout` and :attr:`stderr` after it."""

    def __init__(self, limit: int) -> None:
        self.out = TailBuffer(limit)
        self.err = TailBuffer(limit)

    @property
    def stdout(self) -> str:
        """The tail of what the call printed to ``sys.stdout``."""
        return self.out.text()

    @property
    def stderr(self) -> str:
        """The tail of what the call printed to ``sys.stderr``."""
        return self.err.text()


@contextlib.contextmanager
def captured(limit: int = DEFAULT_LIMIT_CHARS) -> Iterator[CapturedOutput]:
    """Send ``sys.stdout`` and ``sys.stderr`` to fresh tail buffers for the block."""
    output = CapturedOutput(limit)
    previous = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = output.out, output.err
    try:
        yield output
    finally:
        sys.stdout, sys.stderr = previous
