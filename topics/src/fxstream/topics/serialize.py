"""Payload serialization: how code, arguments and results travel inside records.

Three record fields are opaque ``bytes`` to Kafka and to the router:
``FunctionRecord.code`` (a function), ``TaskSubmission.payload`` (its
arguments) and ``TaskResult.value`` (its return value). This module decides
what those bytes hold.

Byte layout
-----------
Every payload starts with a fixed 5-byte ASCII header naming the strategy that
wrote the rest, so any reader can tell what it holds before loading it::

    offset  size  content
    0       2     b"fx" (0x66 0x78), the magic
    2       2     strategy id, two ASCII characters [a-z0-9]
    4       1     b"\\n" (0x0a)
    5       ...   the body, in the strategy's format

The built-in strategies:

====  =====  =====================================================================
id    kind   body
====  =====  =====================================================================
dc    code   a dill pickle (protocol 5) of the function, serialized by value
pk    data   a Python pickle, protocol 5
dl    data   a pickle, protocol 5, loaded with dill (the default data strategy): written
             by the C pickler when the value needs nothing dill adds, else by dill, so
             classes and functions of ``__main__``, lambdas and closures travel by value
js    data   UTF-8 JSON text (RFC 8259), written by msgspec; readable in any language
====  =====  =====================================================================

A worker writes a task's result with the data strategy of the task's arguments
(the client's), so the client's choice governs both directions.

Arguments are one data payload holding the pair ``(args, kwargs)``; in JSON
that is ``[[arg, ...], {"name": value, ...}]``. A result is one data payload
holding the value. A code payload holds one function.

The strategy id is the format version: a new body format gets a new id, and a
reader that does not know an id says so instead of guessing.

Trust: the pickle-based strategies (``dc``, ``pk``, ``dl``) run code while
loading, like the function they carry, so load them only from authenticated
submitters. Corrupt bytes raise :class:`DeserializationError` and nothing else,
but CPython's C unpickler (3.11 included) may first allocate memory in
proportion to a bogus memo index in them (CPython gh-115952).
"""

from __future__ import annotations

import abc
import concurrent.futures
import dis
import functools
import hashlib
import importlib.metadata
import io
import math
import operator
import pickle
import platform
import re
import traceback
import types
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, Protocol, cast

import dill  # type: ignore[import-untyped]
import msgspec

from fxstream.topics import budget
from fxstream.topics.records import ClientInfo, ObjectReference, TaskError

__all__ = [
    "PAYLOAD_HEADER_LENGTH",
    "PAYLOAD_MAGIC",
    "DeserializationError",
    "DillCode",
    "DillData",
    "IntegrityError",
    "JsonData",
    "PayloadError",
    "PayloadSink",
    "PayloadSource",
    "PickleData",
    "SerializationError",
    "Serializer",
    "Strategy",
    "StrategyKind",
    "Substitute",
    "client_info",
    "code_sha256",
    "describe_exception",
    "explain_load_failure",
    "get_strategy",
    "payload_references",
    "register_strategy",
    "registered_strategies",
    "strategy_of",
    "wrap_references",
]

PAYLOAD_MAGIC: Final = b"fx"
"""The first two bytes of every payload."""

PAYLOAD_HEADER_LENGTH: Final = 5
"""Bytes before the body: magic (2), strategy id (2), newline (1)."""

REFERENCES_ID: Final = "rf"
"""The header id of a by-reference envelope (see :func:`wrap_references`)."""

# Pinned rather than pickle.DEFAULT_PROTOCOL so the bytes do not change when a
# newer Python raises its default; every Python fxstream supports reads 5.
_PICKLE_PROTOCOL: Final = 5

StrategyKind = Literal["code", "data"]
"""What a strategy is for: functions (``"code"``) or arguments and results (``"data"``)."""

Substitute = Callable[[Any], Any]
"""Called with objects met while serializing a value; returns what to write in the
object's place, or ``NotImplemented`` to write the object itself (pickle's
``reducer_override`` convention). It sees each object before pickle looks at it:
test ``type(obj)``, never ``isinstance``, which would resolve a lazy proxy."""

_ID_PATTERN: Final = re.compile(r"[a-z0-9]{2}")

# TaskError's type limit (records.py); message and traceback are cut in UTF-8 bytes
# to the budget's limits (fxstream.topics.budget).
_ERROR_TYPE_MAX: Final = 256

# Quoted exception texts inside our own messages are capped: a loader's error
# can echo a large part of the payload, and the message ends up in a record.
_QUOTE_MAX: Final = 1_000

# JSON values nested deeper than this are refused up front; it also stops a
# value that contains itself.
_JSON_MAX_DEPTH: Final = 256


class PayloadSink(Protocol):
    """Where :meth:`Strategy.dump` writes a payload: a binary file that can start over.

    The pickle-based strategies hand a large buffer (a ``bytes`` value, an array's
    memory) to :meth:`write` as it is, never copied into the payload first.
    """

    def write(self, data: Any, /) -> int:
        """Append ``data`` (any buffer); returns how many bytes were written."""
        ...

    def restart(self) -> None:
        """Discard everything written so far (a strategy that retries with another
        pickler writes the payload again from its first byte)."""
        ...


class PayloadSource(Protocol):
    """What :meth:`Strategy.load` reads a payload from: a binary file (``read``,
    ``readline``; ``readinto`` lets the unpickler fill a large value in place)."""

    def read(self, size: int = -1, /) -> bytes:
        """Up to ``size`` bytes (all that is left when ``size`` is negative)."""
        ...

    def readline(self, size: int = -1, /) -> bytes:
        """The next line, up to ``size`` bytes."""
        ...


# --- errors --------------------------------------------------------------------------------


class PayloadError(ValueError):
    """Base of the payload errors. ``strategy`` is the strategy id involved, when known."""

    def __init__(self, message: str, *, strategy: str | None = None) -> None:
        super().__init__(message)
        self.strategy = strategy


class SerializationError(PayloadError):
    """A value (or function) that the chosen strategy cannot serialize.

    The message names the strategy and, where there is one, the strategy to use instead.
    """


class IntegrityError(Exception):
    """Bytes that are not those their writer produced (a digest mismatch), found while a
    payload was loading: e.g. a by-reference object substituted in its store
    (``fxstream.connectors.StoreIntegrityError``). Loading raises it as it is, never
    wrapped in :class:`DeserializationError`, so a task fails with the integrity error.
    """


class DeserializationError(PayloadError):
    """Bytes that cannot be loaded: not a payload, an unknown strategy, corrupt, or
    a payload that needs something this process lacks (a module, a version).

    ``submitted_by`` is the submitter's :class:`ClientInfo` once
    :func:`explain_load_failure` has compared it with this process.
    """

    def __init__(
        self,
        message: str,
        *,
        strategy: str | None = None,
        submitted_by: ClientInfo | None = None,
    ) -> None:
        super().__init__(message, strategy=strategy)
        self.submitted_by = submitted_by


def _safe_str(obj: object) -> str:
    # Loading corrupt bytes can produce exception objects whose __str__ fails,
    # and an error path must not raise a second, unrelated error.
    try:
        return str(obj)
    except Exception:
        return f"<unprintable {type(obj).__name__}>"


def _quote_exception(exc: BaseException) -> str:
    text = _safe_str(exc)
    if len(text) > _QUOTE_MAX:
        text = text[:_QUOTE_MAX] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _type_name(obj: object) -> str:
    cls = type(obj)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


# --- strategies ----------------------------------------------------------------------------


class Strategy(abc.ABC):
    """One way of turning objects into payload bytes and back.

    A subclass sets the class attributes and implements :meth:`encode_body` and
    :meth:`decode_body`; :meth:`dumps` and :meth:`loads` add and check the
    header and turn every failure into :class:`SerializationError` or
    :class:`DeserializationError`. Register it with :func:`register_strategy`
    on every side that must load it.
    """

    id: str
    """Two characters ``[a-z0-9]``, written in the header."""
    kind: StrategyKind
    """``"code"`` for functions, ``"data"`` for arguments and results."""
    name: str
    """What messages call it, e.g. ``"pickle"``."""
    library: str
    """The library whose version matters for loading (a key of ``ClientInfo.serializers``)."""
    instead: str = ""
    """Advice appended when serialization fails, e.g. which strategy to use instead."""

    @property
    def header(self) -> bytes:
        """The 5 header bytes this strategy writes."""
        return PAYLOAD_MAGIC + self.id.encode("ascii") + b"\n"

    @abc.abstractmethod
    def encode_body(self, obj: Any) -> bytes:
        """Serialize ``obj`` to the body (the bytes after the header)."""

    @abc.abstractmethod
    def decode_body(self, body: memoryview) -> Any:
        """Load the body written by :meth:`encode_body` (``bytes(body)`` if bytes are needed)."""

    def encode_body_substituting(self, obj: Any, substitute: Substitute) -> bytes:
        """:meth:`encode_body`, writing ``substitute(o)`` in place of each object ``o`` for
        which it does not return ``NotImplemented``.

        The pickle-based strategies implement it; by default (a strategy that cannot
        substitute) the object is written as :meth:`encode_body` writes it.
        """
        return self.encode_body(obj)

    def dumps(self, obj: Any, *, substitute: Substitute | None = None) -> bytes:
        """Serialize ``obj`` to a complete payload; raises :class:`SerializationError`.

        ``substitute`` (see :data:`Substitute`) replaces objects inside ``obj``
        as they are written, e.g. a proxy by the value it stands for.
        """
        try:
            payload = self.encode_payload(obj, substitute)
        except SerializationError:
            raise
        except Exception as exc:
            raise self._dump_refusal(obj, exc) from exc
        return payload

    def dump(self, obj: Any, sink: PayloadSink, *, substitute: Substitute | None = None) -> None:
        """Write the payload :meth:`dumps` returns to ``sink``; raises
        :class:`SerializationError` (what was written is then incomplete).

        The pickle-based strategies write as they pickle, so a large value is never
        copied into the payload; the others write what :meth:`dumps` returns.
        """
        try:
            self.encode_into(obj, sink, substitute)
        except SerializationError:
            raise
        except Exception as exc:
            raise self._dump_refusal(obj, exc) from exc

    def encode_into(self, obj: Any, sink: PayloadSink, substitute: Substitute | None) -> None:
        """Write the header and the body of ``obj`` to ``sink`` (by default, what
        :meth:`encode_payload` returns)."""
        sink.write(self.encode_payload(obj, substitute))

    def load(self, source: PayloadSource) -> Any:
        """Load the body of a payload of this strategy from ``source``, read past the
        header; raises :class:`DeserializationError`.

        The pickle-based strategies read a large value straight into its own buffer;
        the others read the whole body first.
        """
        return self._decoding(self.decode_from, source)

    def decode_from(self, source: PayloadSource) -> Any:
        """Load the body from ``source`` (by default, all of it read, then decoded)."""
        return self.decode_body(memoryview(source.read()))

    def _dump_refusal(self, obj: Any, exc: Exception) -> SerializationError:
        if isinstance(exc, RecursionError):
            return self._refusal(
                f"{self.name} cannot serialize {_type_name(obj)}: it is nested too deeply "
                "or contains itself",
            )
        return self._refusal(
            f"{self.name} cannot serialize {_type_name(obj)} ({_quote_exception(exc)})"
        )

    def encode_payload(self, obj: Any, substitute: Substitute | None) -> bytes:
        """The header and the body of ``obj``; the pickle-based strategies write the body
        after the header in one buffer (no second copy of a large value)."""
        if substitute is None:
            return self.header + self.encode_body(obj)
        return self.header + self.encode_body_substituting(obj, substitute)

    def loads(self, payload: bytes) -> Any:
        """Load a payload written by this strategy; raises :class:`DeserializationError`."""
        strategy_id, body = _split(payload)
        if strategy_id != self.id:
            raise DeserializationError(
                f"the payload was written by the {strategy_id!r} strategy, not {self.id!r}",
                strategy=strategy_id,
            )
        return self._decoding(self.decode_body, body)

    def _decoding(self, decode: Callable[[Any], Any], data: Any) -> Any:
        """``decode(data)``, any failure but an integrity error as :class:`DeserializationError`."""
        try:
            return decode(data)
        except (DeserializationError, IntegrityError):
            raise
        except Exception as exc:
            raise DeserializationError(
                f"cannot load the {self.name} payload ({_quote_exception(exc)})", strategy=self.id
            ) from exc

    def _refusal(self, message: str) -> SerializationError:
        if self.instead:
            message = f"{message}; {self.instead}"
        return SerializationError(message, strategy=self.id)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id!r} ({self.kind})>"


class DillCode(Strategy):
    """Functions with dill, by value (the default code strategy).

    The function's code is always in the payload, never a reference to its
    module, so ``code_sha256`` changes when the code does. Functions of the same
    module that it reaches through its globals, closure or defaults are copied
    by value too, with just the globals they use; other modules, and classes of
    modules other than ``__main__``, travel by reference and must be importable
    where the function is loaded.
    """

    id = "dc"
    kind: StrategyKind = "code"
    name = "dill"
    library = "dill"
    instead = (
        "create objects such as open files, locks, sockets and generators inside the "
        "function rather than capturing them"
    )

    def encode_body(self, obj: Any) -> bytes:
        """Serialize a callable; plain functions are copied by value first."""
        if not callable(obj):
            raise SerializationError(
                f"a code payload holds a function, not {_type_name(obj)}", strategy=self.id
            )
        if isinstance(obj, types.FunctionType):
            obj = _ByValue(obj.__globals__).function(obj)
        # byref/recurse given explicitly so a change to dill.settings elsewhere
        # cannot change our bytes; _ByValue already trimmed the globals.
        body: bytes = dill.dumps(obj, protocol=_PICKLE_PROTOCOL, byref=False, recurse=False)
        return body

    def decode_body(self, body: memoryview) -> Any:
        """Load the callable."""
        return dill.loads(body)


class _NeedsDill(Exception):
    """Raised inside the C pickler: the value holds something only dill writes by value."""


def _future_refusal(obj: Any) -> SerializationError:
    return SerializationError(
        f"{_type_name(obj)} is a future, and a future cannot travel inside a value: no "
        "strategy serializes it. Pass a task's future as a top-level argument of submit "
        "(submit(fn, future) or submit(fn, x=future)): the task then depends on that task "
        "and receives its result, by reference, once it has succeeded; or pass its value, "
        "future.result() (it waits for that task)",
        strategy=None,
    )


def _by_value(obj: Any) -> bool:
    """Whether pickle would write ``obj`` (a class or function) as a name the loading side
    cannot import: one of ``__main__`` (the submitting script or notebook)."""
    return getattr(obj, "__module__", None) == "__main__"


class _Pickler(pickle.Pickler):
    """The C pickler with fxstream's checks: futures are refused with the remedy, objects
    may be substituted, and (for the dill strategy) what needs dill is detected."""

    def __init__(self, file: Any, *, substitute: Substitute | None, dill_needed: bool) -> None:
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self._substitute = substitute
        self._dill_needed = dill_needed

    def reducer_override(self, obj: Any) -> Any:
        """Refuse futures, substitute, or hand the value over to dill; else pickle as usual."""
        # type(obj), never isinstance: a lazy proxy would resolve on isinstance.
        cls = type(obj)
        if self._substitute is not None:
            replacement = self._substitute(obj)
            if replacement is not NotImplemented:
                # Loads as the replacement itself (operator.getitem of a 1-tuple).
                return operator.getitem, ((replacement,), 0)
        if issubclass(cls, concurrent.futures.Future):
            raise _future_refusal(obj)
        if (
            self._dill_needed
            and (issubclass(cls, type) or cls is types.FunctionType)
            and _by_value(obj)
        ):
            raise _NeedsDill
        return NotImplemented


def _c_pickle(
    obj: Any, *, substitute: Substitute | None, dill_needed: bool, prefix: bytes = b""
) -> bytes:
    # The prefix (a payload's header) is written first, so the payload is one buffer:
    # BytesIO hands its buffer over without a copy, where header + body would copy it.
    buffer = io.BytesIO()
    buffer.write(prefix)
    _Pickler(buffer, substitute=substitute, dill_needed=dill_needed).dump(obj)
    return buffer.getvalue()


_SHARED_READ_BYTES: Final = 1 << 20
"""Bodies above this are read in place by dill (``dill.loads`` copies its input first)."""


class _ViewReader:
    """A file over a memoryview for the unpickler: reads copy only what they return, and a
    large bytes value is read straight into its own buffer (``readinto``)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self._position = 0

    def read(self, size: int = -1) -> bytes:
        start = self._position
        end = len(self._view) if size is None or size < 0 else min(start + size, len(self._view))
        self._position = end
        return bytes(self._view[start:end])

    def readinto(self, target: Any) -> int:
        out = memoryview(target).cast("B")
        start = self._position
        count = min(len(out), len(self._view) - start)
        out[:count] = self._view[start : start + count]
        self._position = start + count
        return count

    def readline(self, size: int = -1) -> bytes:
        start = self._position
        limit = len(self._view) - start if size is None or size < 0 else size
        stop = min(start + limit, len(self._view))
        end = stop
        for chunk in range(start, stop, 4096):  # text opcodes' lines are short
            found = bytes(self._view[chunk : min(chunk + 4096, stop)]).find(b"\n")
            if found >= 0:
                end = chunk + found + 1
                break
        self._position = end
        return bytes(self._view[start:end])


def _dill_load(body: memoryview) -> Any:
    if body.nbytes <= _SHARED_READ_BYTES:
        return dill.loads(body)
    return dill.load(_ViewReader(body))


class _DillPickler(dill.Pickler):  # type: ignore[misc]
    """dill's pickler with the same future check and substitution as :class:`_Pickler`."""

    def __init__(self, file: Any, *, substitute: Substitute | None) -> None:
        # byref/recurse given explicitly so a change to dill.settings elsewhere cannot
        # change our bytes. recurse=True so a lambda from __main__ inside a value takes
        # the globals it uses, not a reference to a __main__ the endpoint does not have.
        super().__init__(file, protocol=_PICKLE_PROTOCOL, byref=False, recurse=True)
        self._substitute = substitute

    def reducer_override(self, obj: Any) -> Any:
        """Refuse futures and substitute; else dill pickles as usual."""
        if self._substitute is not None:
            replacement = self._substitute(obj)
            if replacement is not NotImplemented:
                return operator.getitem, ((replacement,), 0)
        if issubclass(type(obj), concurrent.futures.Future):
            raise _future_refusal(obj)
        return NotImplemented


class PickleData(Strategy):
    """Values with the standard library's pickle, protocol 5."""

    id = "pk"
    kind: StrategyKind = "data"
    name = "pickle"
    library = "pickle"
    instead = (
        "use the dill data strategy (Serializer(data='dl'), the default), which also "
        "handles lambdas, closures and classes defined in __main__"
    )

    def encode_body(self, obj: Any) -> bytes:
        """Pickle ``obj``."""
        return _c_pickle(obj, substitute=None, dill_needed=False)

    def encode_body_substituting(self, obj: Any, substitute: Substitute) -> bytes:
        """Pickle ``obj`` with ``substitute`` applied."""
        return _c_pickle(obj, substitute=substitute, dill_needed=False)

    def encode_payload(self, obj: Any, substitute: Substitute | None) -> bytes:
        """Header and pickle in one buffer."""
        return _c_pickle(obj, substitute=substitute, dill_needed=False, prefix=self.header)

    def encode_into(self, obj: Any, sink: PayloadSink, substitute: Substitute | None) -> None:
        """Header, then the pickle as the pickler writes it."""
        sink.write(self.header)
        _Pickler(sink, substitute=substitute, dill_needed=False).dump(obj)

    def decode_body(self, body: memoryview) -> Any:
        """Unpickle the body."""
        return pickle.loads(body)

    def decode_from(self, source: PayloadSource) -> Any:
        """Unpickle from ``source``."""
        return pickle.load(source)


class DillData(Strategy):
    """Values as Globus Compute's default sends them: pickle where it suffices, dill by
    value where the loading side could not import something (the default data strategy).

    The C pickler writes the value unless it holds a class or function of
    ``__main__``, a lambda, a closure or anything else pickle refuses; then dill
    writes all of it, with those by value. Either way the body is a pickle that
    ``dill.loads`` reads, so the header is ``dl`` and readers need not tell them apart.
    """

    id = "dl"
    kind: StrategyKind = "data"
    name = "dill"
    library = "dill"
    instead = (
        "dill cannot serialize open files, locks, sockets or generators: "
        "pass what is needed to recreate them instead"
    )

    def encode_body(self, obj: Any) -> bytes:
        """Serialize ``obj``: the C pickler if it suffices, else dill."""
        return self._encode(obj, None)

    def encode_body_substituting(self, obj: Any, substitute: Substitute) -> bytes:
        """Serialize ``obj`` with ``substitute`` applied."""
        return self._encode(obj, substitute)

    def encode_payload(self, obj: Any, substitute: Substitute | None) -> bytes:
        """Header and body in one buffer."""
        return self._encode(obj, substitute, prefix=self.header)

    def _encode(self, obj: Any, substitute: Substitute | None, prefix: bytes = b"") -> bytes:
        try:
            return _c_pickle(obj, substitute=substitute, dill_needed=True, prefix=prefix)
        except SerializationError:
            raise
        except Exception:  # _NeedsDill, or something pickle refuses that dill may write
            return self._dill(obj, substitute, prefix)

    @staticmethod
    def _dill(obj: Any, substitute: Substitute | None, prefix: bytes = b"") -> bytes:
        buffer = io.BytesIO()
        buffer.write(prefix)
        # dill finds a function's globals by disassembling, briefly redirecting sys.stdout.
        _DillPickler(buffer, substitute=substitute).dump(obj)
        return buffer.getvalue()

    def encode_into(self, obj: Any, sink: PayloadSink, substitute: Substitute | None) -> None:
        """Header and body as the pickler writes them; dill's from the start when the C
        pickler cannot write the value."""
        sink.write(self.header)
        try:
            _Pickler(sink, substitute=substitute, dill_needed=True).dump(obj)
            return
        except SerializationError:
            raise
        except Exception:  # _NeedsDill, or something pickle refuses that dill may write
            sink.restart()
        sink.write(self.header)
        _DillPickler(sink, substitute=substitute).dump(obj)

    def decode_body(self, body: memoryview) -> Any:
        """Load the body with dill (a large one read in place, never copied whole)."""
        return _dill_load(body)

    def decode_from(self, source: PayloadSource) -> Any:
        """Load the body from ``source`` with dill."""
        return dill.load(source)


class JsonData(Strategy):
    """Values as JSON, readable without Python.

    Only values that come back equal are accepted: ``None``, ``bool``, ``int``,
    finite ``float``, ``str``, ``list`` and ``dict`` with ``str`` keys, nested.
    Tuples are accepted and come back as lists. Anything else (sets, bytes,
    subclasses such as enums, other objects) raises :class:`SerializationError`.
    """

    id = "js"
    kind: StrategyKind = "data"
    name = "JSON"
    library = "msgspec"
    instead = (
        "use the default data strategy (Serializer(data='dl')), which writes sets, bytes "
        "and any other value pickle or dill can"
    )

    def encode_body(self, obj: Any) -> bytes:
        """Check ``obj`` is plain JSON, then encode it."""
        self._check(obj)
        return msgspec.json.encode(obj)

    def decode_body(self, body: memoryview) -> Any:
        """Decode JSON text."""
        return msgspec.json.decode(body)

    def _check(self, value: Any) -> None:
        # msgspec would happily encode sets, bytes, datetimes, enums ... as
        # something that loads back as another type; refuse them instead.
        # Iterative, so a deep value is refused with a message, not a RecursionError.
        stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
        while stack:
            obj, path = stack.pop()
            cls = type(obj)
            if obj is None or cls is str or cls is int or cls is bool:
                continue
            if cls is float:
                if not math.isfinite(obj):
                    raise self._refuse(f"the float {obj!r}", path, "JSON has no NaN or infinity")
                continue
            if cls is list or cls is tuple or cls is dict:
                if len(path) >= _JSON_MAX_DEPTH:
                    raise self._refuse(
                        f"a value nested more than {_JSON_MAX_DEPTH} levels deep (or containing "
                        "itself)",
                        path,
                    )
                if cls is dict:
                    for key, item in obj.items():
                        if type(key) is not str:
                            raise self._refuse(
                                f"a dict key of type {_type_name(key)}", path, "keys must be str"
                            )
                        stack.append((item, (*path, key)))
                else:
                    stack.extend((item, (*path, i)) for i, item in enumerate(obj))
                continue
            if issubclass(cls, concurrent.futures.Future):
                raise _future_refusal(obj)
            raise self._refuse(_type_name(obj), path)

    def _refuse(self, what: str, path: tuple[str | int, ...], why: str = "") -> SerializationError:
        where = " at " + "".join(f"[{p!r}]" for p in path) if path else ""
        because = f" ({why})" if why else ""
        return self._refusal(f"JSON cannot encode {what}{where}{because}")


class _ByValue:
    """Copies functions of one module into a fresh namespace holding only what they use.

    dill pickles a function by reference when its module can import it, and
    with its module's whole ``__dict__`` otherwise; both fail on an endpoint
    that lacks the module (a test file, a script run as ``__main__``). Copies
    are not importable, so dill pickles them by value, with this namespace as
    their globals. (dill's own ``recurse=True`` does the same trimming but loops
    forever on mutually recursive functions.)
    """

    def __init__(self, module_globals: dict[str, Any]) -> None:
        self._source = module_globals
        self._namespace: dict[str, Any] = {"__name__": module_globals.get("__name__", "__main__")}
        self._copies: dict[int, types.FunctionType] = {}
        self._cells: dict[int, types.CellType] = {}

    def function(self, fn: types.FunctionType) -> types.FunctionType:
        """The by-value copy of ``fn`` (one copy per function, so recursion terminates)."""
        done = self._copies.get(id(fn))
        if done is not None:
            return done
        cells = None
        if fn.__closure__ is not None:
            # New cells (shared between copies as the originals were), so a
            # closure can hold a copy, not the importable original.
            cells = tuple(self._cells.setdefault(id(c), types.CellType()) for c in fn.__closure__)
        copy = types.FunctionType(fn.__code__, self._namespace, fn.__name__, None, cells)
        self._copies[id(fn)] = copy  # before recursing, so a cycle finds it
        if fn.__closure__ is not None and cells is not None:
            for old, new in zip(fn.__closure__, cells, strict=True):
                try:
                    contents = old.cell_contents
                except ValueError:  # an empty cell: a variable not assigned yet
                    continue
                new.cell_contents = self._value(contents)
        if fn.__defaults__:
            copy.__defaults__ = tuple(self._value(d) for d in fn.__defaults__)
        if fn.__kwdefaults__:
            copy.__kwdefaults__ = {k: self._value(v) for k, v in fn.__kwdefaults__.items()}
        copy.__qualname__ = fn.__qualname__
        copy.__module__ = fn.__module__
        copy.__doc__ = fn.__doc__
        copy.__annotations__ = fn.__annotations__
        copy.__dict__.update({k: self._value(v) for k, v in fn.__dict__.items()})
        # Sorted so the same function gives the same bytes (and code_sha256).
        for name in sorted(_global_names(fn.__code__)):
            if name not in self._namespace and name in self._source:
                self._namespace[name] = self._value(self._source[name])
        return copy

    def _value(self, obj: Any) -> Any:
        if isinstance(obj, types.FunctionType) and obj.__globals__ is self._source:
            return self.function(obj)
        return obj


_GLOBAL_OPS: Final = frozenset(
    {"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME", "STORE_NAME", "DELETE_NAME"}
)


def _global_names(code: types.CodeType) -> set[str]:
    """Global names that ``code`` and the code nested in it (inner functions) use."""
    names: set[str] = set()
    pending = [code]
    while pending:
        current = pending.pop()
        names.update(
            ins.argval for ins in dis.get_instructions(current) if ins.opname in _GLOBAL_OPS
        )
        pending.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    return names


# --- registry ------------------------------------------------------------------------------

_REGISTRY: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy, *, replace: bool = False) -> Strategy:
    """Make ``strategy`` loadable by header everywhere in this process; returns it.

    Raises ``ValueError`` for a malformed id or kind, or an id already taken by
    another strategy (unless ``replace``).
    """
    strategy_id = getattr(strategy, "id", None)
    if not isinstance(strategy_id, str) or not _ID_PATTERN.fullmatch(strategy_id):
        raise ValueError(f"a strategy id is two characters [a-z0-9], not {strategy_id!r}")
    if getattr(strategy, "kind", None) not in ("code", "data"):
        raise ValueError(f"strategy {strategy_id!r}: kind must be 'code' or 'data'")
    current = _REGISTRY.get(strategy_id)
    if current is not None and current is not strategy and not replace:
        raise ValueError(f"strategy id {strategy_id!r} is taken by {current!r}")
    _REGISTRY[strategy_id] = strategy
    return strategy


def registered_strategies() -> tuple[Strategy, ...]:
    """Every registered strategy, by id."""
    return tuple(_REGISTRY[k] for k in sorted(_REGISTRY))


def _known() -> str:
    return ", ".join(f"{s.id} ({s.name} {s.kind})" for s in registered_strategies())


def get_strategy(strategy_id: str) -> Strategy:
    """The registered strategy with this id; ``ValueError`` listing the known ones otherwise."""
    try:
        return _REGISTRY[strategy_id]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown serialization strategy {strategy_id!r}; known: {_known()}"
        ) from None


def _split(payload: bytes) -> tuple[str, memoryview]:
    """The strategy id and the body of a payload; :class:`DeserializationError` if no header."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise DeserializationError(f"a payload is bytes, not {_type_name(payload)}")
    view = memoryview(payload)
    if len(view) < PAYLOAD_HEADER_LENGTH:
        size = "empty" if len(view) == 0 else f"{len(view)} bytes"
        raise DeserializationError(
            f"the payload is {size}, shorter than the {PAYLOAD_HEADER_LENGTH}-byte fxstream header"
        )
    head = bytes(view[:PAYLOAD_HEADER_LENGTH])
    if head[:2] != PAYLOAD_MAGIC or head[4:] != b"\n":
        hint = " (it looks like a bare pickle)" if head[:1] == b"\x80" else ""
        raise DeserializationError(
            f"not an fxstream payload: it starts with {head!r}{hint}, not "
            "b'fx' + a 2-character strategy id + b'\\n'"
        )
    strategy_id = head[2:4].decode("ascii", errors="replace")
    if not _ID_PATTERN.fullmatch(strategy_id):
        raise DeserializationError(
            f"not an fxstream payload: {head[2:4]!r} in header {head!r} is not a strategy id"
        )
    return strategy_id, view[PAYLOAD_HEADER_LENGTH:]


def _unknown_strategy(strategy_id: str) -> DeserializationError:
    return DeserializationError(
        f"unknown payload strategy {strategy_id!r}; this side knows {_known()} "
        "(was it written by a newer fxstream, or with a strategy not registered here?)",
        strategy=strategy_id,
    )


def strategy_of(payload: bytes) -> Strategy:
    """The registered strategy named by a payload's header, without loading the body.

    Raises :class:`DeserializationError` when there is no valid header or the
    strategy is unknown here.
    """
    strategy_id, _ = _split(payload)
    if strategy_id == REFERENCES_ID:
        strategy_id, _ = _split(payload_references(payload)[1])
    found = _REGISTRY.get(strategy_id)
    if found is None:
        raise _unknown_strategy(strategy_id)
    return found


class _ReferencedPayload(msgspec.Struct, frozen=True):
    references: list[ObjectReference]
    payload: bytes


_REFERENCED_DECODER: Final = msgspec.msgpack.Decoder(_ReferencedPayload)


def wrap_references(payload: bytes, references: list[ObjectReference]) -> bytes:
    """Wrap a payload that holds proxies with the list of objects they refer to.

    The envelope (header id ``rf``, body a msgpack map of ``references`` and the
    inner ``payload``) lets the agent publish data-locations and the SDK evict
    objects without loading the payload. With no references the payload is
    returned unchanged; every loader here unwraps the envelope transparently.
    """
    if not references:
        return payload
    body = msgspec.msgpack.encode(_ReferencedPayload(list(references), payload))
    return PAYLOAD_MAGIC + REFERENCES_ID.encode("ascii") + b"\n" + body


def payload_references(payload: bytes) -> tuple[list[ObjectReference], bytes]:
    """The objects a payload refers to and the payload inside its envelope.

    A payload without an envelope gives ``([], payload)``. Raises
    :class:`DeserializationError` for a malformed envelope.
    """
    strategy_id, body = _split(payload)
    if strategy_id != REFERENCES_ID:
        return [], payload
    try:
        envelope = _REFERENCED_DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DeserializationError(
            f"cannot load the by-reference envelope ({_quote_exception(exc)})",
            strategy=REFERENCES_ID,
        ) from exc
    if envelope.payload[:PAYLOAD_HEADER_LENGTH] == payload[:PAYLOAD_HEADER_LENGTH]:
        raise DeserializationError(
            "a by-reference envelope may not hold another envelope", strategy=REFERENCES_ID
        )
    return envelope.references, envelope.payload


for _builtin in (DillCode(), PickleData(), DillData(), JsonData()):
    register_strategy(_builtin)


# --- versions and failures -----------------------------------------------------------------


@functools.cache
def client_info() -> ClientInfo:
    """This process's Python, fxstream and serializer versions, sent with every submission.

    ``serializers["pickle"]`` is the highest pickle protocol this Python reads.
    """
    try:
        fxstream_version = importlib.metadata.version("fxstream-topics")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        fxstream_version = "unknown"
    return ClientInfo(
        python_version=platform.python_version(),
        fxstream_version=fxstream_version,
        serializers={
            "dill": str(dill.__version__),
            "msgspec": msgspec.__version__,
            "pickle": str(pickle.HIGHEST_PROTOCOL),
        },
    )


def code_sha256(code: bytes) -> str:
    """The hex SHA-256 of a code payload (header included), for ``FunctionRecord.code_sha256``."""
    return hashlib.sha256(code).hexdigest()


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _missing_module(exc: BaseException) -> str | None:
    # The import failure may be wrapped (dill, a user's __reduce__), so look
    # along the chain; bounded, since a chain can be a cycle.
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return None
        if isinstance(seen, ModuleNotFoundError) and seen.name:
            return seen.name.partition(".")[0]
        seen = seen.__cause__ or seen.__context__
    return None


def explain_load_failure(
    exc: BaseException, submitted_by: ClientInfo, *, local: ClientInfo | None = None
) -> DeserializationError:
    """Turn a failure to load a payload into an error naming both sides' versions.

    ``submitted_by`` is the :class:`ClientInfo` that came with the payload,
    ``local`` this process's (default :func:`client_info`). The message says
    what failed, which Python, fxstream and serializer versions wrote the
    payload and which are loading it, and what to do. Returns the error (to
    ``raise``); never raises.
    """
    if isinstance(exc, DeserializationError) and exc.submitted_by is not None:
        return exc  # already explained
    here = local if local is not None else client_info()
    strategy_id = exc.strategy if isinstance(exc, PayloadError) else None
    strategy = _REGISTRY.get(strategy_id) if strategy_id else None
    if isinstance(exc, DeserializationError):
        what = _safe_str(exc)
        root: BaseException = exc.__cause__ if exc.__cause__ is not None else exc
    else:
        what = f"cannot load the payload ({_quote_exception(exc)})"
        root = exc

    if strategy is not None:
        libraries = [strategy.library]
    else:
        libraries = sorted(set(submitted_by.serializers) | set(here.serializers))

    def side(info: ClientInfo) -> str:
        parts = [f"Python {info.python_version}", f"fxstream {info.fxstream_version}"]
        parts += [f"{lib} {info.serializers.get(lib, '(not reported)')}" for lib in libraries]
        return ", ".join(parts)

    # Patch releases of Python read each other's pickles and code objects.
    differ = []
    if _minor(submitted_by.python_version) != _minor(here.python_version):
        differ.append("Python")
    if submitted_by.fxstream_version != here.fxstream_version:
        differ.append("fxstream")
    differ += [
        lib for lib in libraries if submitted_by.serializers.get(lib) != here.serializers.get(lib)
    ]

    advice = []
    missing = _missing_module(root)
    if missing:
        advice.append(f"install {missing!r} where the payload is loaded")
    if differ:
        names = " and ".join([", ".join(differ[:-1]), differ[-1]] if len(differ) > 1 else differ)
        advice.append(f"install the same {names} versions on both sides")
    if (strategy is None or strategy.kind == "data") and strategy_id != JsonData.id:
        advice.append("use the JSON data strategy (Serializer(data='js'), for plain JSON values)")
    if not advice:
        advice.append("the versions match, so the payload may be corrupt")
    message = (
        f"{what}: it was serialized with {side(submitted_by)} and is being loaded with "
        f"{side(here)}; {', or '.join(advice)}"
    )
    error = DeserializationError(message, strategy=strategy_id, submitted_by=submitted_by)
    error.__cause__ = root
    return error


def _printable(text: str) -> str:
    # Lone surrogates (from bytes decoded with surrogateescape) cannot be
    # encoded as UTF-8, so a record holding them could not be written.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _keep_start(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    reserve = len(" [... 0 characters cut]") + len(str(len(text)))
    kept = limit - reserve
    return f"{text[:kept]} [... {len(text) - kept} characters cut]"


def describe_exception(exc: BaseException) -> TaskError:
    """The :class:`TaskError` a worker sends when a user function raises ``exc``.

    ``type`` is the class name, qualified by its module unless a builtin;
    ``message`` is ``str(exc)``; ``traceback`` the formatted traceback with
    chained exceptions. Each is cut to its byte limit (``fxstream.topics.budget``);
    the traceback keeps its end, where the raise site and the exception are.
    """
    try:
        formatted = "".join(traceback.format_exception(exc))
    except Exception:  # a broken exception object; the type and message still go
        formatted = f"{_type_name(exc)}: {_safe_str(exc)}\n"
    return TaskError(
        type=_keep_start(_printable(_type_name(exc)), _ERROR_TYPE_MAX),
        message=budget.truncate_utf8(_printable(_safe_str(exc)), budget.ERROR_MESSAGE_MAX_BYTES),
        traceback=budget.truncate_utf8_tail(_printable(formatted), budget.TRACEBACK_MAX_BYTES),
    )


# --- the serializer ------------------------------------------------------------------------


def _resolve(spec: str | Strategy, kind: StrategyKind, argument: str) -> Strategy:
    if isinstance(spec, Strategy):
        strategy = spec
    elif isinstance(spec, str):
        strategy = get_strategy(spec)
    else:
        raise TypeError(f"{argument}= takes a strategy id or a Strategy, not {_type_name(spec)}")
    if strategy.kind != kind:
        choices = ", ".join(s.id for s in registered_strategies() if s.kind == kind)
        raise ValueError(
            f"{argument}= needs a {kind} strategy ({choices}); "
            f"{strategy.id!r} is a {strategy.kind} strategy"
        )
    return strategy


class Serializer:
    """Serializes functions, arguments and results with one code and one data strategy.

    ``code`` and ``data`` are strategy ids or :class:`Strategy` instances;
    defaults: dill by value for code, ``dl`` for data (pickle, or dill where pickle
    would not load on the other side, as Globus Compute). Loading dispatches on
    the payload's header, so any strategy registered here (or given here)
    loads, whichever wrote it. Instances hold no state and are thread-safe.
    """

    __slots__ = ("code", "data")

    def __init__(self, code: str | Strategy = "dc", data: str | Strategy = "dl") -> None:
        self.code: Strategy = _resolve(code, "code", "code")
        self.data: Strategy = _resolve(data, "data", "data")

    def __repr__(self) -> str:
        return f"Serializer(code={self.code.id!r}, data={self.data.id!r})"

    # writing

    def serialize_function(self, fn: Callable[..., Any]) -> bytes:
        """A code payload holding ``fn`` (for ``FunctionRecord.code``)."""
        return self.code.dumps(fn)

    def pack_arguments(
        self, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> bytes:
        """A data payload holding ``(args, kwargs)`` (for ``TaskSubmission.payload``).

        When a value cannot be serialized, the error names which argument.
        """
        kwargs = {} if kwargs is None else kwargs
        for key in kwargs:
            if not isinstance(key, str):
                raise SerializationError(
                    f"keyword argument names are str, not {_type_name(key)} ({key!r})",
                    strategy=self.data.id,
                )
        pair = (tuple(args), dict(kwargs))
        try:
            return self.data.dumps(pair)
        except SerializationError as exc:
            # Only on failure: serialize each argument alone to name the culprit.
            named = [(f"argument {i}", value) for i, value in enumerate(pair[0])]
            named += [(f"keyword argument {key!r}", value) for key, value in pair[1].items()]
            for where, value in named:
                try:
                    self.data.dumps(value)
                except SerializationError as culprit:
                    raise SerializationError(
                        f"cannot serialize {where}: {culprit}", strategy=self.data.id
                    ) from culprit.__cause__ or culprit
            raise exc

    def serialize_value(self, obj: Any, *, substitute: Substitute | None = None) -> bytes:
        """A data payload holding ``obj`` (for ``TaskResult.value``).

        ``substitute`` replaces objects inside ``obj`` as they are written (see
        :data:`Substitute`); strategies that cannot substitute ignore it.
        """
        return self.data.dumps(obj, substitute=substitute)

    def serialize_value_into(
        self, obj: Any, sink: PayloadSink, *, substitute: Substitute | None = None
    ) -> None:
        """Write the payload :meth:`serialize_value` returns to ``sink``, as it is made
        (a large buffer inside ``obj`` is handed to ``sink`` as it is, not copied)."""
        self.data.dump(obj, sink, substitute=substitute)

    def with_data(self, data: str | Strategy) -> Serializer:
        """This serializer with another data strategy (what a worker answers a client with)."""
        strategy = _resolve(data, "data", "data")
        return self if strategy is self.data else Serializer(self.code, strategy)

    # reading

    def _load(self, payload: bytes, submitted_by: ClientInfo | None) -> tuple[Strategy, Any]:
        try:
            strategy_id, _ = _split(payload)
            if strategy_id == REFERENCES_ID:
                payload = payload_references(payload)[1]
                strategy_id, _ = _split(payload)
            if strategy_id == self.code.id:
                strategy = self.code
            elif strategy_id == self.data.id:
                strategy = self.data
            else:
                found = _REGISTRY.get(strategy_id)
                if found is None:
                    raise _unknown_strategy(strategy_id)
                strategy = found
            return strategy, strategy.loads(payload)
        except DeserializationError as exc:
            if submitted_by is None:
                raise
            explained = explain_load_failure(exc, submitted_by)
            raise explained from explained.__cause__

    def deserialize(self, payload: bytes, *, submitted_by: ClientInfo | None = None) -> Any:
        """Load any payload, whichever strategy wrote it.

        Raises :class:`DeserializationError` and nothing else for bytes that do
        not load. With ``submitted_by`` (the payload's :class:`ClientInfo`), the
        error compares the two sides' versions (see :func:`explain_load_failure`).
        """
        return self._load(payload, submitted_by)[1]

    def deserialize_from(self, source: PayloadSource) -> Any:
        """Load a payload from ``source`` (a value's, never a by-reference envelope),
        whichever strategy wrote it; :class:`DeserializationError` if it does not load.

        With a pickle-based strategy a large value is read from ``source`` straight into
        its own buffer, never held twice; give it only bytes already verified.
        """
        strategy_id, _ = _split(source.read(PAYLOAD_HEADER_LENGTH))
        if strategy_id == REFERENCES_ID:
            raise DeserializationError(
                "a stored value is a payload of its own, not a by-reference envelope",
                strategy=strategy_id,
            )
        if strategy_id == self.data.id:
            strategy = self.data
        else:
            found = _REGISTRY.get(strategy_id)
            if found is None:
                raise _unknown_strategy(strategy_id)
            strategy = found
        return strategy.load(source)

    def deserialize_function(
        self, payload: bytes, *, submitted_by: ClientInfo | None = None
    ) -> Callable[..., Any]:
        """Load a code payload; :class:`DeserializationError` unless it holds a callable."""
        strategy, fn = self._load(payload, submitted_by)
        if not callable(fn):
            raise DeserializationError(
                f"the payload holds {_type_name(fn)}, not a function", strategy=strategy.id
            )
        return cast("Callable[..., Any]", fn)

    def unpack_arguments(
        self, payload: bytes, *, submitted_by: ClientInfo | None = None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Load a payload written by :meth:`pack_arguments` into ``(args, kwargs)``."""
        strategy, value = self._load(payload, submitted_by)
        if isinstance(value, tuple | list) and len(value) == 2:
            args, kwargs = value
            if (
                isinstance(args, tuple | list)
                and isinstance(kwargs, dict)
                and all(isinstance(k, str) for k in kwargs)
            ):
                return tuple(args), kwargs
        raise DeserializationError(
            f"the payload holds {_type_name(value)}, not the (args, kwargs) pair of pack_arguments",
            strategy=strategy.id,
        )

    def client_info(self) -> ClientInfo:
        """This process's versions, for ``TaskSubmission.client`` (see :func:`client_info`)."""
        return client_info()
