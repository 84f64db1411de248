"""Payload serialization: round trips, clear refusals, and bad bytes only ever raise
DeserializationError. No broker needed."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import importlib.metadata
import math
import os
import pickle
import platform
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dill  # type: ignore[import-untyped]
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxstream.topics import (
    PAYLOAD_HEADER_LENGTH,
    ClientInfo,
    DeserializationError,
    FunctionRecord,
    JsonData,
    PayloadError,
    SerializationError,
    Serializer,
    Strategy,
    TaskError,
    TaskResult,
    client_info,
    code_sha256,
    decode,
    describe_exception,
    encode,
    explain_load_failure,
    get_strategy,
    register_strategy,
    registered_strategies,
    strategy_of,
)
from fxstream.topics import serialize as serialize_module

DATA_IDS = ["pk", "dl", "js"]
PICKLE_BASED_IDS = ["dc", "pk", "dl"]

# --- module-level functions to ship (by value: this module is not importable remotely) -------

OFFSET = 10


def add_offset(x: int) -> int:
    return x + OFFSET


def uses_helper(x: int, *, scale: int = 2) -> int:
    return add_offset(x) * scale


def is_even(n: int) -> bool:
    return True if n == 0 else is_odd(n - 1)


def is_odd(n: int) -> bool:
    return False if n == 0 else is_even(n - 1)


def make_adder(n: int) -> Callable[[int], int]:
    def add(x: int) -> int:
        return add_offset(x) + n

    return add


def divide(a: float, b: float) -> float:
    return a / b  # the raise site describe_exception must keep


class Boom(Exception):
    """A user-defined exception type, raised by a test function."""


# --- helpers ----------------------------------------------------------------------------------


@contextlib.contextmanager
def bounded_memory(headroom: int = 1 << 30) -> Iterator[None]:
    """Cap this process's address space while loading garbage.

    CPython 3.11's C unpickler sizes its memo from an index read from the bytes
    (gh-115952): garbage such as b"]r...." can ask for many GB. Under the cap
    that allocation fails (MemoryError, which must surface as
    DeserializationError) instead of filling the test machine's memory.
    """
    if not sys.platform.startswith("linux"):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        current = int(statm.read().split()[0]) * resource.getpagesize()
    limit = current + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def load_or_reject(payload: bytes) -> None:
    """Loading must return a value or raise DeserializationError, nothing else."""
    with bounded_memory(), contextlib.suppress(DeserializationError):
        Serializer().deserialize(payload)


OTHER_SIDE = ClientInfo(
    python_version="3.12.1", fxstream_version="0.2.0", serializers={"dill": "0.4.1"}
)
THIS_SIDE = ClientInfo(
    python_version="3.11.7", fxstream_version="0.1.0", serializers={"dill": "0.3.9"}
)

# Values pickle and dill bring back equal (no NaN: it is not equal to itself).
picklable = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=8), inner, max_size=5)
        | st.frozensets(st.integers(), max_size=5)
    ),
    max_leaves=20,
)
jsonable = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


# --- header and registry ----------------------------------------------------------------------


@pytest.mark.parametrize("strategy_id", ["dc", "pk", "dl", "js"])
def test_every_payload_starts_with_the_header(strategy_id: str) -> None:
    strategy = get_strategy(strategy_id)
    payload = strategy.dumps(add_offset if strategy.kind == "code" else [1, "two"])
    assert payload[:PAYLOAD_HEADER_LENGTH] == b"fx" + strategy_id.encode() + b"\n"
    assert strategy_of(payload) is strategy


def test_builtin_strategies_are_registered_with_their_kinds() -> None:
    kinds = {s.id: s.kind for s in registered_strategies()}
    assert kinds == {"dc": "code", "dl": "data", "js": "data", "pk": "data"}


def test_json_payload_is_plain_json_after_the_header() -> None:
    payload = Serializer(data="js").pack_arguments((1, "a", [2.5, None]), {"k": True})
    assert payload == b'fxjs\n[[1,"a",[2.5,null]],{"k":true}]'


def test_serializer_defaults_and_choices() -> None:
    default = Serializer()
    assert (default.code.id, default.data.id) == ("dc", "dl")
    assert Serializer(data=get_strategy("js")).data.id == "js"
    with pytest.raises(ValueError, match=r"code= needs a code strategy \(dc\); 'pk' is a data"):
        Serializer(code="pk")
    with pytest.raises(ValueError, match=r"unknown serialization strategy 'zz'; known: dc"):
        Serializer(data="zz")


def test_register_strategy_refuses_bad_and_taken_ids() -> None:
    class Reversed(Strategy):
        id = "pk"
        kind = "data"
        name = "reversed"
        library = "none"

        def encode_body(self, obj: Any) -> bytes:
            return bytes(obj)[::-1]

        def decode_body(self, body: memoryview) -> Any:
            return bytes(body)[::-1]

    with pytest.raises(ValueError, match="taken"):
        register_strategy(Reversed())
    Reversed.id = "PK"
    with pytest.raises(ValueError, match=r"two characters \[a-z0-9\]"):
        register_strategy(Reversed())


def test_a_registered_strategy_loads_by_header(monkeypatch: pytest.MonkeyPatch) -> None:
    class Reversed(Strategy):
        id = "rv"
        kind = "data"
        name = "reversed"
        library = "none"

        def encode_body(self, obj: Any) -> bytes:
            return bytes(obj)[::-1]

        def decode_body(self, body: memoryview) -> Any:
            return bytes(body)[::-1]

    with pytest.raises(DeserializationError, match="unknown payload strategy 'rv'"):
        Serializer().deserialize(b"fxrv\ncba")
    # A private copy of the registry, so the test leaves the process as it found it.
    monkeypatch.setattr(serialize_module, "_REGISTRY", dict(serialize_module._REGISTRY))
    register_strategy(Reversed())
    payload = Serializer(data="rv").serialize_value(b"abc")
    assert payload == b"fxrv\ncba"
    assert Serializer().deserialize(payload) == b"abc"


# --- functions --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "args", "expected"),
    [
        pytest.param(add_offset, (1,), 11, id="plain-def"),
        pytest.param(lambda x: x * x, (7,), 49, id="lambda"),
        pytest.param(make_adder(5), (1,), 16, id="closure"),
        pytest.param(uses_helper, (1,), 22, id="calls-module-helper"),
        pytest.param(is_even, (7,), False, id="mutual-recursion"),
        pytest.param(len, ([1, 2],), 2, id="builtin"),
    ],
)
def test_function_round_trip(fn: Callable[..., Any], args: tuple[Any, ...], expected: Any) -> None:
    serializer = Serializer()
    payload = serializer.serialize_function(fn)
    assert payload.startswith(b"fxdc\n")
    loaded = serializer.deserialize_function(payload)
    assert loaded(*args) == expected


def test_function_keeps_defaults_and_keyword_defaults() -> None:
    loaded = Serializer().deserialize_function(Serializer().serialize_function(uses_helper))
    assert loaded(1, scale=3) == 33
    assert loaded.__name__ == "uses_helper"


def test_same_function_same_code_hash() -> None:
    first = Serializer().serialize_function(uses_helper)
    second = Serializer().serialize_function(uses_helper)
    assert code_sha256(first) == code_sha256(second) == hashlib.sha256(first).hexdigest()
    record = FunctionRecord(
        function_id="f-1",
        name="uses_helper",
        owner_id="u-1",
        code=first,
        code_sha256=code_sha256(first),
        created_at=time.time(),
    )
    assert decode(encode(record), FunctionRecord).code_sha256 == code_sha256(first)


_FRESH_PROCESS = """
import sys
from fxstream.topics import Serializer
fn = Serializer().deserialize_function(sys.stdin.buffer.read())
print(repr(fn(*eval(sys.argv[1]))))
print(sorted(m for m in sys.modules if m == "tests" or m.startswith("tests.")))
"""


@pytest.mark.parametrize(
    ("fn", "args", "expected"),
    [
        pytest.param(uses_helper, (1,), "22", id="calls-module-helper"),
        pytest.param(is_even, (4,), "True", id="mutual-recursion"),
        pytest.param(lambda x: [x, OFFSET], (1,), "[1, 10]", id="lambda-using-a-global"),
        pytest.param(make_adder(5), (1,), "16", id="closure"),
    ],
)
def test_function_loads_in_a_fresh_process(
    tmp_path: Path, fn: Callable[..., Any], args: tuple[Any, ...], expected: str
) -> None:
    """By value: a fresh interpreter, in a directory where this test module cannot
    be imported, runs the function without importing it."""
    payload = Serializer().serialize_function(fn)
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, repr(args)],
        input=payload,
        capture_output=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().splitlines() == [expected, "[]"]


def test_deserialize_function_refuses_a_non_callable() -> None:
    payload = Serializer().serialize_value([1, 2])
    with pytest.raises(DeserializationError, match="holds list, not a function"):
        Serializer().deserialize_function(payload)


def test_serialize_function_refuses_a_non_callable() -> None:
    with pytest.raises(SerializationError, match="a code payload holds a function, not int"):
        Serializer().serialize_function(42)  # type: ignore[arg-type]


# --- arguments and values ---------------------------------------------------------------------


@pytest.mark.parametrize("data", DATA_IDS)
def test_arguments_round_trip(data: str) -> None:
    serializer = Serializer(data=data)
    args = (1, "two", [3.5, None, {"nested": [True, False]}])
    kwargs = {"alpha": {"beta": [1, 2, {"gamma": "δ"}]}, "n": -(2**40)}
    unpacked = serializer.unpack_arguments(serializer.pack_arguments(args, kwargs))
    assert unpacked == (args, kwargs)
    assert isinstance(unpacked[0], tuple)
    assert serializer.unpack_arguments(serializer.pack_arguments()) == ((), {})


@pytest.mark.parametrize("data", ["pk", "dl"])
def test_pickle_strategies_keep_bytes_tuples_and_sets(data: str) -> None:
    serializer = Serializer(data=data)
    args = (b"\x00raw\xff", (1, (2, 3)), {4, 5}, frozenset({6}))
    kwargs = {"blob": bytearray(b"xyz"), "empty": ()}
    assert serializer.unpack_arguments(serializer.pack_arguments(args, kwargs)) == (args, kwargs)


def test_dill_data_carries_lambdas() -> None:
    serializer = Serializer(data="dl")
    loaded = serializer.deserialize(serializer.serialize_value({"f": lambda x: x + 1}))
    assert loaded["f"](1) == 2


@pytest.mark.parametrize("data", ["pk", "dl"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=picklable)
def test_pickle_values_round_trip(data: str, value: Any) -> None:
    serializer = Serializer(data=data)
    assert serializer.deserialize(serializer.serialize_value(value)) == value


@settings(max_examples=200, deadline=None)
@given(value=jsonable)
def test_json_values_round_trip(value: Any) -> None:
    serializer = Serializer(data="js")
    assert serializer.deserialize(serializer.serialize_value(value)) == value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({1, 2}, "JSON cannot encode set; use the default data strategy"),
        (object(), "JSON cannot encode object; use the default data strategy"),
        ([1, {"k": b"x"}], r"JSON cannot encode bytes at \[1\]\['k'\]; use the default"),
        ({1: "a"}, r"JSON cannot encode a dict key of type int \(keys must be str\)"),
        (math.nan, r"JSON cannot encode the float nan \(JSON has no NaN or infinity\)"),
        (Boom("x"), "JSON cannot encode tests.topics.test_serialize.Boom"),
    ],
)
def test_json_refuses_what_would_not_come_back(value: Any, message: str) -> None:
    with pytest.raises(SerializationError, match=message) as caught:
        Serializer(data="js").serialize_value(value)
    assert caught.value.strategy == "js"
    assert isinstance(caught.value, ValueError)


def test_json_refuses_a_value_that_contains_itself() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(SerializationError, match="nested more than 256 levels deep"):
        Serializer(data="js").serialize_value(loop)


def test_pack_arguments_names_the_argument_that_fails() -> None:
    with pytest.raises(SerializationError, match="cannot serialize keyword argument 'k': JSON"):
        Serializer(data="js").pack_arguments((1, "ok"), {"k": {1}})
    with pytest.raises(
        SerializationError,
        match=r"cannot serialize argument 1: pickle cannot serialize function .*dill data",
    ):
        Serializer(data="pk").pack_arguments((1, lambda x: x))
    with pytest.raises(SerializationError, match="keyword argument names are str, not int"):
        Serializer().pack_arguments((), {1: "x"})  # type: ignore[dict-item]


def test_unpack_arguments_refuses_a_payload_that_is_not_a_pair() -> None:
    payload = Serializer().serialize_value([1, 2, 3])
    with pytest.raises(DeserializationError, match=r"not the \(args, kwargs\) pair"):
        Serializer().unpack_arguments(payload)


def test_values_load_whichever_strategy_wrote_them() -> None:
    reader = Serializer()
    for data in DATA_IDS:
        assert reader.deserialize(Serializer(data=data).serialize_value([1, "x"])) == [1, "x"]


# --- bad bytes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "the payload is empty, shorter than the 5-byte fxstream header"),
        (b"fxpk", "the payload is 4 bytes"),
        (pickle.dumps([1]), "not an fxstream payload.*looks like a bare pickle"),
        (b"fxPK\nabc", "not a strategy id"),
        (b"fxzz\nabc", r"unknown payload strategy 'zz'; this side knows dc \(dill code\), dl"),
        (b"fxpk\nnot a pickle", r"cannot load the pickle payload \(UnpicklingError"),
        (b"fxjs\n{", r"cannot load the JSON payload \(DecodeError"),
    ],
)
def test_bad_payloads_are_explained(payload: bytes, message: str) -> None:
    with pytest.raises(DeserializationError, match=message):
        Serializer().deserialize(payload)


def test_a_payload_must_be_bytes() -> None:
    with pytest.raises(DeserializationError, match="a payload is bytes, not NoneType"):
        Serializer().deserialize(None)  # type: ignore[arg-type]


def test_a_strategy_loads_only_its_own_payloads() -> None:
    with pytest.raises(DeserializationError, match="written by the 'js' strategy, not 'pk'"):
        get_strategy("pk").loads(b"fxjs\n[]")


def test_the_known_memo_bomb_is_refused_not_fatal() -> None:
    # From CPython gh-115952: asks the C unpickler for a ~26 GB memo table.
    load_or_reject(b"fxpk\n]replace.")


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_deserialization_error(data: bytes) -> None:
    load_or_reject(data)


@pytest.mark.parametrize("strategy_id", ["dc", "pk", "dl", "js", "zz"])
@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=200))
def test_arbitrary_bodies_only_raise_deserialization_error(strategy_id: str, body: bytes) -> None:
    load_or_reject(b"fx" + strategy_id.encode() + b"\n" + body)


@pytest.mark.parametrize("data", DATA_IDS)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=jsonable, cut=st.integers(min_value=0))
def test_truncated_payloads_raise_deserialization_error(data: str, value: Any, cut: int) -> None:
    serializer = Serializer(data=data)
    payload = serializer.pack_arguments((value,), {"k": value})
    truncated = payload[: cut % len(payload)]
    # A pickle ends with its STOP opcode, so every cut is an error; the
    # arguments pair in JSON is an array, so a cut leaves it unclosed.
    with pytest.raises(DeserializationError):
        serializer.deserialize(truncated)


@settings(max_examples=50, deadline=None)
@given(cut=st.integers(min_value=0))
def test_truncated_code_payloads_raise_deserialization_error(cut: int) -> None:
    payload = Serializer().serialize_function(uses_helper)
    with pytest.raises(DeserializationError):
        Serializer().deserialize_function(payload[: cut % len(payload)])


# --- version mismatches -----------------------------------------------------------------------


def test_explain_load_failure_names_both_sides() -> None:
    error = explain_load_failure(
        ModuleNotFoundError("No module named 'numpy'", name="numpy"), OTHER_SIDE, local=THIS_SIDE
    )
    assert isinstance(error, DeserializationError)
    assert str(error) == (
        "cannot load the payload (ModuleNotFoundError: No module named 'numpy'): it was "
        "serialized with Python 3.12.1, fxstream 0.2.0, dill 0.4.1 and is being loaded with "
        "Python 3.11.7, fxstream 0.1.0, dill 0.3.9; install 'numpy' where the payload is "
        "loaded, or install the same Python, fxstream and dill versions on both sides, or use "
        "the JSON data strategy (Serializer(data='js'), for plain JSON values)"
    )
    assert error.submitted_by == OTHER_SIDE
    assert isinstance(error.__cause__, ModuleNotFoundError)


def test_explain_load_failure_when_the_versions_match() -> None:
    error = explain_load_failure(
        DeserializationError("cannot load the JSON payload (DecodeError: x)", strategy="js"),
        THIS_SIDE,
        local=THIS_SIDE,
    )
    assert "msgspec (not reported)" in str(error)
    assert str(error).endswith("the versions match, so the payload may be corrupt")


def test_deserialize_with_submitted_by_explains_a_missing_module() -> None:
    # A dill payload referring to a module this process does not have.
    payload = b"fxdl\ncfxstream_no_such_module\nthing\n."
    with pytest.raises(DeserializationError) as caught:
        Serializer().deserialize(payload, submitted_by=OTHER_SIDE)
    message = str(caught.value)
    here = client_info()
    assert "No module named 'fxstream_no_such_module'" in message
    assert "serialized with Python 3.12.1, fxstream 0.2.0, dill 0.4.1" in message
    assert f"loaded with Python {here.python_version}" in message
    assert f"dill {here.serializers['dill']}" in message
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_client_info_reports_this_process() -> None:
    info = Serializer().client_info()
    assert info.python_version == platform.python_version()
    assert info.fxstream_version == importlib.metadata.version("fxstream-topics")
    assert info.serializers == {
        "dill": dill.__version__,
        "msgspec": msgspec.__version__,
        "pickle": str(pickle.HIGHEST_PROTOCOL),
    }


# --- remote exceptions ------------------------------------------------------------------------


def test_describe_exception_keeps_type_message_and_raise_site() -> None:
    try:
        divide(1, 0)
    except ZeroDivisionError as exc:
        error = describe_exception(exc)
    assert error.type == "ZeroDivisionError"
    assert error.message == "division by zero"
    assert "return a / b" in error.traceback
    assert "in divide" in error.traceback
    assert error.traceback.rstrip().endswith("ZeroDivisionError: division by zero")
    assert error.retryable is False


def test_describe_exception_of_a_shipped_function() -> None:
    remote = Serializer().deserialize_function(Serializer().serialize_function(divide))
    try:
        remote(1, 0)
    except ZeroDivisionError as exc:
        error = describe_exception(exc)
    assert error.type == "ZeroDivisionError"
    assert "in divide" in error.traceback


def test_describe_exception_qualifies_user_classes_and_chains() -> None:
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise Boom("outer") from inner
    except Boom as exc:
        error = describe_exception(exc)
    assert error.type == "tests.topics.test_serialize.Boom"
    assert "KeyError: 'inner'" in error.traceback
    assert "direct cause" in error.traceback


def test_describe_exception_fits_the_record_limits() -> None:
    huge = "x" * 300_000 + "END"
    try:
        raise ValueError(huge)
    except ValueError as exc:
        error = describe_exception(exc)
    assert len(error.message.encode()) <= 32_768
    assert error.message.startswith("xxx")
    assert "bytes cut" in error.message
    assert len(error.traceback.encode()) <= 65_536
    assert error.traceback.startswith("...[")
    assert error.traceback.rstrip().endswith("END")
    result = TaskResult(
        task_id="t-1",
        user_id="u-1",
        function_id="f-1",
        endpoint_id="e-1",
        outcome="error",
        error=error,
    )
    assert decode(encode(result), TaskResult).error == error


def test_describe_exception_survives_surrogates_and_broken_str() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    bad_text = ValueError(b"caf\xe9".decode("utf-8", "surrogateescape"))
    for exc in (bad_text, Unprintable()):
        error = describe_exception(exc)
        assert isinstance(error, TaskError)
        encode(
            TaskResult(
                task_id="t",
                user_id="u",
                function_id="f",
                endpoint_id="e",
                outcome="error",
                error=error,
            )
        )
    assert describe_exception(Unprintable()).message == "<unprintable Unprintable>"


def test_error_family() -> None:
    assert issubclass(SerializationError, PayloadError)
    assert issubclass(DeserializationError, PayloadError)
    assert issubclass(PayloadError, ValueError)
    assert JsonData.id == "js"


# --- the default data strategy: pickle where it suffices, dill by value where needed ----------

_MAIN_SCRIPT = """
import sys
from fxstream.topics import Serializer

class Point:
    def __init__(self, x):
        self.x = x

    def doubled(self):
        return Point(self.x * 2)

sys.stdout.buffer.write(Serializer().serialize_value([Point(21), {"f": lambda v: v + 1}]))
"""

_LOAD_SCRIPT = """
import sys
from fxstream.topics import Serializer
point, table = Serializer().deserialize(sys.stdin.buffer.read())
print(type(point).__name__, point.doubled().x, table["f"](1))
"""


def _python(tmp_path: Path, script: str, data: bytes = b"") -> bytes:
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=data,
        capture_output=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout


def test_a_class_of_main_travels_by_value_by_default(tmp_path: Path) -> None:
    """A script's own class (and a lambda) serialized in one process load in another,
    where that script's __main__ does not exist."""
    payload = _python(tmp_path, _MAIN_SCRIPT)
    assert payload[:PAYLOAD_HEADER_LENGTH] == b"fxdl\n"
    assert _python(tmp_path, _LOAD_SCRIPT, payload).decode().split() == ["Point", "42", "2"]


def test_the_default_data_strategy_writes_a_plain_pickle_when_it_suffices() -> None:
    value = {"numbers": list(range(100)), "text": "δ", "nested": (1.5, None, b"x")}
    payload = Serializer().serialize_value(value)
    assert payload[:PAYLOAD_HEADER_LENGTH] == b"fxdl\n"
    # Written by the C pickler (no dill types): the standard library loads the body.
    assert pickle.loads(payload[PAYLOAD_HEADER_LENGTH:]) == value
    assert Serializer().deserialize(payload) == value


def _advised_data_strategy(message: str) -> str:
    found = re.search(r"Serializer\(data='(\w\w)'\)", message)
    assert found is not None, f"no strategy advised in: {message}"
    return found.group(1)


@pytest.mark.parametrize(
    ("strategy", "value"),
    [
        pytest.param("pk", lambda x: x + 1, id="pickle-refuses-a-lambda"),
        pytest.param("js", {1, 2, 3}, id="json-refuses-a-set"),
        pytest.param("js", b"bytes", id="json-refuses-bytes"),
    ],
)
def test_following_a_refusals_advice_works(strategy: str, value: Any) -> None:
    with pytest.raises(SerializationError) as refused:
        Serializer(data=strategy).pack_arguments((value,))
    advised = Serializer(data=_advised_data_strategy(str(refused.value)))
    (loaded,), _ = advised.unpack_arguments(advised.pack_arguments((value,)))
    if callable(value):
        assert loaded(1) == value(1)
    else:
        assert loaded == value


def test_a_future_argument_is_refused_with_advice_that_works() -> None:
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    for data in DATA_IDS:
        with pytest.raises(SerializationError, match=r"argument 1: .*future.result\(\)") as caught:
            Serializer(data=data).pack_arguments((1, [future]))
        assert "Serializer(data=" not in str(caught.value)  # no strategy helps
    future.set_result(41)
    serializer = Serializer()
    assert serializer.unpack_arguments(serializer.pack_arguments((1, [future.result()]))) == (
        (1, [41]),
        {},
    )


class _Box:
    def __init__(self, value: Any) -> None:
        self.value = value


def _unbox(obj: Any) -> Any:
    return obj.value if type(obj) is _Box else NotImplemented


@pytest.mark.parametrize("data", ["pk", "dl"])
def test_substitute_writes_a_replacement_wherever_the_object_is(data: str) -> None:
    box = _Box([1, 2])
    value = {"alone": box, "nested": [box, (box,)], "lambda": lambda: 7}
    if data == "pk":
        del value["lambda"]
    loaded = Serializer().deserialize(
        Serializer(data=data).serialize_value(value, substitute=_unbox)
    )
    assert loaded["alone"] == [1, 2]
    # The same object is written once: identity survives as it would for the value itself.
    assert loaded["nested"][0] is loaded["alone"]
    assert loaded["nested"][1][0] is loaded["alone"]


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_a_large_dill_body_is_read_in_place_whatever_its_pickle_protocol(protocol: int) -> None:
    """Bodies above 1 MiB are read through a view of the payload, not copied whole first
    (``dill.loads`` copies its input); every pickle opcode must still read as before,
    protocol 0's line-based ones too."""
    value = {"big": os.urandom(3_000_000), "text": "x" * 2_000_000, "n": [1, 2.5, None]}
    payload = b"fxdl\n" + pickle.dumps(value, protocol=protocol)
    assert Serializer().deserialize(payload) == value


def test_a_large_value_is_one_buffer_with_its_header() -> None:
    """serialize_value writes the header and the body into one buffer: the same bytes as
    header + pickle, for the C pickler's values and for dill's (a lambda inside)."""
    data = os.urandom(2_000_000)
    payload = Serializer().serialize_value(data)
    assert payload[:5] == b"fxdl\n" and pickle.loads(payload[5:]) == data
    double = lambda x: 2 * x  # noqa: E731 (dill writes it by value)
    loaded = Serializer().deserialize(Serializer().serialize_value({"f": double, "d": data}))
    assert loaded["f"](21) == 42 and loaded["d"] == data
    as_pickle = Serializer(data="pk").serialize_value(data)
    assert as_pickle[:5] == b"fxpk\n" and Serializer().deserialize(as_pickle) == data
