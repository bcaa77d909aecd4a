"""Import a PyTorch-profiler (Kineto) Chrome-trace JSON file, ``.json`` or ``.json.gz``, as a raw run.

What is read (everything else in the trace is outside the run's tables and is left alone):

- kernels: ``cat`` ``kernel`` (2021 and older: ``Kernel``), with grid, block, registers, shared
  memory, stream, device and correlation id from ``args``; the launch (``launch_api``,
  ``launch_thread``, ``launch_start_ns``) from the ``cuda_runtime`` / ``cuda_driver`` (older:
  ``Runtime``) event of the same correlation id. Kernels replayed from a CUDA graph all share the
  ``cudaGraphLaunch``'s correlation id, so they all get that launch.
- memops: ``gpu_memcpy`` / ``gpu_memset`` (older: ``Memcpy`` / ``Memset``), bytes from ``args``.
- ranges: ``user_annotation`` and the ``nn.Module: ...`` ``python_function`` events that
  ``torch.profiler(with_modules=True)`` writes (timeline ``cpu``, thread = OS thread id; in a 2021
  trace, which has neither, its ``ProfilerStep#N`` ``Operator`` events), and
  ``gpu_user_annotation`` (timeline ``gpu``, thread = stream); nested per thread by a sweep over
  the intervals sorted by start (longest first), which gives ``path``, ``depth`` and ``parent``.
- overheads: Kineto's ``overhead`` events, and a count of every event of an imported category
  that could not be converted (``skipped_events``) and of categories this importer does not know
  (``unknown_category``): nothing is dropped silently.

Times: Chrome traces give ``ts`` and ``dur`` in microseconds, as integers or decimal fractions
(nanosecond resolution). They are converted to integer nanoseconds from their decimal text, not
through a binary float, so ``1712195495519695.8`` is exactly ``1712195495519695800``. Where the
trace has ``baseTimeNanoseconds`` (Kineto 2.4+), ``ts`` counts from it and it is added, so every
time in the run is nanoseconds since the Unix epoch. ``end_ns = start_ns + dur``.

Speed: the file is decoded once by msgspec into small typed records that keep only the fields
read here (other keys are skipped by the decoder without building Python objects; flow, instant
and metadata events decode to empty records), then each table is built column by column with
pyarrow / numpy (benchmarks/bench_import.py measures it against HolisticTraceAnalysis). A trace
that does not fit the typed decoder (an event that is not an object, ``args`` that is not an
object, an unknown phase) is decoded generically and converted event by event; a column that
meets a value of the wrong type is rebuilt from the events that pass a per-event check, the
others skipped and counted.

Also recorded: the shared memory Kineto reports (static and dynamic together) goes to
``shared_dynamic``, ``shared_static`` stays null; ``rank`` is ``distributedInfo.rank`` (else 0);
the run id is a hash of the file as stored.
"""

from __future__ import annotations

import datetime as _dt
import gc
import hashlib
import itertools
import json
import operator
import os
import re
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Union

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from decodescope.analysis.schema import Run, RunMeta, from_pydict
from decodescope.tracer.errors import TraceError

__all__ = ["load_kineto", "short_name"]

KERNEL_CATS = frozenset({"kernel", "Kernel"})
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime", "Driver"})
MEMCPY_CATS = frozenset({"gpu_memcpy", "Memcpy"})
MEMSET_CATS = frozenset({"gpu_memset", "Memset"})
CPU_RANGE_CATS = frozenset({"user_annotation"})
# deviceProperties kept in a run's config_json["device"] (analysis.occupancy.limits_from_props)
DEVICE_KEYS = frozenset(
    {
        "numSms",
        "maxThreadsPerMultiprocessor",
        "regsPerMultiprocessor",
        "sharedMemPerMultiprocessor",
        "computeMajor",
        "computeMinor",
    }
)
GPU_RANGE_CATS = frozenset({"gpu_user_annotation"})
OVERHEAD_CATS = frozenset({"overhead"})
# torch.profiler(with_modules=True) writes one python_function event per nn.Module call,
# "nn.Module: Qwen2DecoderLayer_3": imported as cpu ranges, they give per-layer attribution
PYTHON_CATS = frozenset({"python_function", "Python"})
_MODULE_PREFIX = "nn.Module: "


def _module_ranges(events: list) -> list:
    return [e for e in events if type(e.name) is str and e.name.startswith(_MODULE_PREFIX)]


# Kineto before user_annotation (2021) wrote record_function ranges as "Operator" events like
# any aten op; the profiler's own step ranges are told apart by name: "ProfilerStep#5"
LEGACY_OP_CATS = frozenset({"Operator"})
_STEP_PREFIX = "ProfilerStep#"


def _legacy_step_ranges(events: list) -> list:
    return [e for e in events if type(e.name) is str and e.name.startswith(_STEP_PREFIX)]


# categories Kineto writes that hold nothing for the run's tables (host ops, Python frames, flow
# arrows, instants, metadata); they are neither imported nor reported
OTHER_CATS = frozenset(
    {
        "cpu_op",
        "Operator",
        "python_function",
        "Python",
        "ac2g",
        "async",
        "fwdbwd",
        "flow",
        "cpu_instant_event",
        "Trace",
        "Metadata",
        "user_annotation_fwd",
        "Memory",
        "mtia_runtime",
        "cuda_sync",
        "gpu_mem_alloc",
        None,
    }
)

_GRAPH_LAUNCH = re.compile(r"^(cudaGraphLaunch|cuGraphLaunch)")  # runtime or driver, any suffix
_ANON = "(anonymous namespace)"
_GENERIC_KERNEL_NAMES = frozenset({"Kernel", "Kernel2", "kernel", "device_kernel", "KernelLaunch"})


# ---------------------------------------------------------------------------------------------
# the typed records the decoder fills (unknown keys are skipped without building objects)


class _Args(msgspec.Struct, gc=False):
    correlation: Any = None
    stream: Any = None
    device: Any = None
    grid: Any = None
    block: Any = None
    registers: Any = msgspec.field(default=None, name="registers per thread")
    shared: Any = msgspec.field(default=None, name="shared memory")
    bytes: Any = None
    graph_id: Any = msgspec.field(default=None, name="graph id")
    graph_node_id: Any = msgspec.field(default=None, name="graph node id")


class _Event(msgspec.Struct, gc=False):
    cat: Any = None
    name: Any = None
    pid: Any = None
    tid: Any = None
    ts: Any = None
    dur: Any = None
    args: _Args | None = None


class _Trace(msgspec.Struct, gc=False):
    traceEvents: Any = msgspec.field(default=None)  # list[_Event], checked below
    deviceProperties: Any = None
    distributedInfo: Any = None
    baseTimeNanoseconds: Any = None
    cuda_runtime_version: Any = None
    cuda_driver_version: Any = None
    cupti_version: Any = None
    schemaVersion: Any = None
    trace_id: Any = None


# The decoder tells events apart by their phase ("ph", Kineto writes it first): complete events
# ("X", and "B"/"E" should a writer use them) become _Event; flow arrows, instants, counters,
# metadata and the rest become empty records whose fields the decoder skips without building
# a single object (a third of a typical trace). A phase outside the Chrome trace format fails
# the typed decode, and the generic path takes over.
_FULL_PHASES = ("X", "B", "E")
_SKIPPED_PHASES = "iIbneCstfPONDMVvRc"
_PHASED = tuple(
    msgspec.defstruct(f"_Event_{ph}", [], bases=(_Event,), tag_field="ph", tag=ph, gc=False)
    for ph in _FULL_PHASES
) + tuple(
    msgspec.defstruct(f"_Skip_{ph}", [], tag_field="ph", tag=ph, gc=False, namespace={"cat": None})
    for ph in _SKIPPED_PHASES
)
_AnyPhase = Union[_PHASED]  # noqa: UP007 - a Union built from a tuple of types


class _TypedTrace(_Trace, gc=False):
    traceEvents: list[_AnyPhase] | None = None  # type: ignore[valid-type]


# floats stay as their decimal text (``float_hook=str``) so times convert exactly
_DECODE_OBJECT = msgspec.json.Decoder(_TypedTrace, float_hook=str)
_DECODE_ARRAY = msgspec.json.Decoder(list[_AnyPhase], float_hook=str)  # type: ignore[valid-type]
_DECODE_ANY = msgspec.json.Decoder(float_hook=str)


# ---------------------------------------------------------------------------------------------
# public entry


def load_kineto(
    path: str | os.PathLike[str], *, run_id: str | None = None, rank: int | None = None
) -> Run:
    """Read a Kineto / PyTorch-profiler trace (``.json`` or ``.json.gz``) as a raw :class:`Run`.

    ``run_id`` defaults to a stable id derived from the trace's content (the same for the
    trace and its gzipped copy); ``rank`` defaults to the
    trace's ``distributedInfo.rank`` (0 when the trace has none).
    Raises :class:`TraceError` (one line naming the file) for anything that is not such a trace.
    """
    p = Path(path)
    data = _read_bytes(p)
    if data[:2] == b"\x1f\x8b":
        data = _gunzip(p, data)
    # the id hashes the trace itself: gzip and a UTF-8 byte order mark do not change it
    unmarked = memoryview(data)[3:] if data[:3] == _BOM else data
    rid = run_id or "kineto-" + hashlib.blake2b(unmarked, digest_size=8).hexdigest()
    del unmarked
    trace, events, skipped = _decode(p, data)
    del data
    return _Builder(p, trace, events, skipped, rid, rank).run()


# ---------------------------------------------------------------------------------------------
# reading and decoding


def _read_bytes(p: Path) -> bytes:
    if not p.exists():
        raise TraceError(p, "no such file or directory")
    if p.is_dir():
        raise TraceError(p, "is a directory, expected a Kineto JSON trace file")
    if not p.is_file():  # a pipe nobody writes to would block the read for ever
        raise TraceError(p, "not a regular file (a pipe or a device): save the trace to a file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise TraceError(p, f"cannot read: {e.strerror or e}") from None
    if not data:
        raise TraceError(p, "empty file")
    return data


_BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark, which some editors and tools write first
_GUNZIP_CHUNK = 1 << 20
_GUNZIP_MAX_RATIO = 200  # trust the size a gzip trailer states up to this many times the input


def _gunzip(p: Path, data: bytes) -> bytearray:
    """Decompress every gzip member of ``data`` into one bytearray, a chunk at a time, so the peak
    is the output plus one chunk (a one-shot decompress holds its output twice while joining).

    The output is allocated once at the size the gzip trailer states (ISIZE), when that is
    plausible, so growing it never copies what is already there."""
    hint = int.from_bytes(data[-4:], "little") if len(data) >= 18 else 0
    out = bytearray(hint if hint <= _GUNZIP_MAX_RATIO * len(data) else 0)
    pos = 0

    def put(chunk: bytes) -> None:
        nonlocal out, pos
        end = pos + len(chunk)
        if end > len(out):
            out += bytes(end - len(out)) if end - len(out) > len(out) // 8 else bytes(len(out) // 8)
        out[pos:end] = chunk
        pos = end

    try:
        while True:
            d = zlib.decompressobj(wbits=31)  # gzip wrapper; checks the CRC and length
            buf = data
            while not d.eof:
                chunk = d.decompress(buf, _GUNZIP_CHUNK)
                buf = d.unconsumed_tail
                if not chunk and not buf:
                    break  # the input is used up and nothing more comes out
                put(chunk)
            if not d.eof:
                raise TraceError(p, "truncated gzip data: the compressed stream ends early")
            rest = d.unused_data.lstrip(b"\0")  # a further member, or trailing padding
            if not rest:
                break
            if len(rest) >= len(data):  # no progress: never loop on the same bytes
                raise TraceError(p, "corrupt gzip data: a member that does not end")
            data = rest
            if data[:2] != b"\x1f\x8b":
                raise TraceError(p, "corrupt gzip data: trailing garbage after the stream")
    except zlib.error as e:
        raise TraceError(p, f"truncated or corrupt gzip data: {e}") from None
    del out[pos:]
    if not out or out.isspace():
        raise TraceError(p, "gzip file holds no data")
    return out


def _decode(p: Path, data: bytes | bytearray) -> tuple[_Trace, list[_Event], Counter]:
    """Decode ``data``: the typed fast path, else a generic decode converted event by event.

    A leading UTF-8 byte order mark (plain or inside the gzip data) is skipped without a copy.
    """
    if data[:3] == _BOM:
        data = memoryview(data)[3:]
    head = bytes(data[:4096]).lstrip()  # a memoryview has no lstrip
    if head[:1] not in (b"{", b"["):
        raise TraceError(p, "not a Kineto / Chrome trace: expected a JSON object ({...})")
    skipped: Counter = Counter()
    was_enabled = gc.isenabled()
    gc.disable()  # the decoder makes many small containers; collection passes only cost here
    try:
        try:
            if head[:1] == b"{":
                trace = _DECODE_OBJECT.decode(data)
                events = trace.traceEvents
            else:
                events = _DECODE_ARRAY.decode(data)
                trace = _Trace(traceEvents=events)
        except msgspec.ValidationError:
            trace, events = _decode_generic(p, data, skipped)
    except msgspec.DecodeError as e:
        raise TraceError(p, f"not valid JSON ({_json_problem(e)})") from None
    except RecursionError:
        raise TraceError(p, "JSON nested too deeply") from None
    finally:
        if was_enabled:
            gc.enable()
    if events is None:
        raise TraceError(p, "JSON is not a Kineto / Chrome trace: no traceEvents list")
    if not events and not sum(skipped.values()):
        raise TraceError(p, "trace holds no events (traceEvents is empty)")
    if not events:
        raise TraceError(
            p,
            f"JSON is not a Kineto / Chrome trace: no event is an object ({_fmt_counts(skipped)})",
        )
    return trace, events, skipped


def _json_problem(e: Exception) -> str:
    msg = str(e)
    if "truncated" in msg.lower():
        return "cut short: " + msg
    return msg


def _decode_generic(
    p: Path, data: bytes | bytearray | memoryview, skipped: Counter
) -> tuple[_Trace, list[_Event] | None]:
    obj = _DECODE_ANY.decode(data)
    if isinstance(obj, list):
        raw_events: Any = obj
        top: dict = {}
    elif isinstance(obj, dict):
        raw_events = obj.get("traceEvents")
        top = obj
    else:
        raise TraceError(
            p, f"JSON is not a Kineto / Chrome trace: top level is a {type(obj).__name__}"
        )
    if raw_events is None:
        return _Trace(), None
    if not isinstance(raw_events, list):
        raise TraceError(
            p,
            f"JSON is not a Kineto / Chrome trace: traceEvents is a {type(raw_events).__name__}, not a list",
        )
    events: list[_Event] = []
    for raw in raw_events:
        if not isinstance(raw, dict):
            skipped[f"event is a {type(raw).__name__}, not an object"] += 1
            continue
        args = raw.get("args")
        if args is not None and not isinstance(args, dict):
            skipped["args is not an object"] += 1
            raw = {k: v for k, v in raw.items() if k != "args"}
        try:
            events.append(msgspec.convert(raw, _Event, str_keys=True))
        except msgspec.ValidationError as e:
            skipped[f"event does not convert: {e}"] += 1
    fields = {f: top.get(f) for f in _Trace.__struct_fields__ if f != "traceEvents"}
    return _Trace(traceEvents=events, **fields), events


# ---------------------------------------------------------------------------------------------
# times: microseconds (int or decimal text) to integer nanoseconds


class _BadValues(ValueError):
    """A column holds a value of the wrong type; the caller falls back to the checked path."""


# |ts|, |dur| and baseTimeNanoseconds each below 3e18 ns (year 2065 as Unix time): their sum fits
# in int64
_I64_US_LIMIT = 3 * 10**15
# what a value of an unexpected type raises while a column is built
_CONVERT_ERRORS = (
    _BadValues,
    TypeError,
    ValueError,
    AttributeError,
    OverflowError,
    pa.ArrowException,
)


def _us_to_ns(values: list) -> np.ndarray:
    """Microseconds (ints, or floats kept as decimal text) to exact int64 ns; raises _BadValues."""
    n = len(values)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    try:
        ints = pa.array(values, type=pa.int64())
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        ints = None
    if ints is not None:
        if ints.null_count:
            raise _BadValues("missing time")
        arr = ints.to_numpy()
        if n and (arr.max() > _I64_US_LIMIT or arr.min() < -_I64_US_LIMIT):
            raise _BadValues("time out of range")
        return arr * 1000
    text = []
    for v in values:
        t = type(v)
        if t is str:
            text.append(v)
        elif t is int:
            text.append(str(v))
        elif t is float:
            text.append(repr(v))
        else:
            raise _BadValues(f"time is a {t.__name__}")
    s = pa.array(text, type=pa.string())
    try:
        dec = s.cast(pa.decimal128(38, 3))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return np.array([_decimal_ns(v) for v in text], dtype=np.int64)
    # a decimal128 with scale 3 stores the value in ns as a 128-bit integer: take the low word
    words = np.frombuffer(dec.buffers()[1], dtype="<i8")[2 * dec.offset : 2 * (dec.offset + n)]
    low, high = words[0::2], words[1::2]
    if np.any(high != (low >> 63)):
        raise _BadValues("time out of range")
    return low.copy()


def _decimal_ns(text: str) -> int:
    try:
        d = Decimal(text)
    except InvalidOperation:
        raise _BadValues(f"time {text[:30]!r} is not a number") from None
    if not d.is_finite() or abs(d) > _I64_US_LIMIT:
        raise _BadValues("time out of range")
    return int((d * 1000).to_integral_value())


def _ok_time(v: Any) -> bool:
    t = type(v)
    if t is int:
        return -_I64_US_LIMIT <= v <= _I64_US_LIMIT
    if t is str:
        try:
            _decimal_ns(v)
        except _BadValues:
            return False
        return True
    return False


# ---------------------------------------------------------------------------------------------
# small value parsers (per unique value or per event on the checked path)


_INT_TEXT = re.compile(r"-?[0-9]{1,18}")


def _int_or_none(v: Any) -> int | None:
    """An int64 from an int or from digits ("25738", Kineto 2021's "stream 7"); else None."""
    if type(v) is int:
        return v if -(2**63) <= v < 2**63 else None
    if type(v) is str:
        s = v.strip()
        if s.startswith("stream "):
            s = s[7:].strip()
        if _INT_TEXT.fullmatch(s):
            return int(s)
    return None


def _ints(values: list, typ: pa.DataType) -> pa.Array:
    """An integer column; values that are not integers of the type's range become null."""
    try:
        return pa.array(values, type=typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        bits = typ.bit_width - 1
        lo, hi = -(2**bits), 2**bits
        return pa.array([v if type(v) is int and lo <= v < hi else None for v in values], type=typ)


def _dim3(v: Any) -> tuple[int | None, int | None, int | None]:
    if isinstance(v, list) and len(v) == 3 and all(type(x) is int and 0 <= x < 2**31 for x in v):
        return v[0], v[1], v[2]
    return None, None, None


def _i32(v: Any) -> int | None:
    return v if type(v) is int and -(2**31) <= v < 2**31 else None


def _i64(v: Any) -> int | None:
    return v if type(v) is int and -(2**63) <= v < 2**63 else None


_TEMPLATE_OR_ARGS = re.compile(r"[<(]")


def short_name(name: str) -> str:
    """The short kernel name: no return type, parameter list, template arguments or namespaces.

    ``void at::native::vectorized_elementwise_kernel<4, ...>(int, ...)`` gives
    ``vectorized_elementwise_kernel``; a generic wrapper such as ``cutlass::Kernel2<Op>(...)``
    keeps its first template argument's short name: ``Kernel2<Op>``. Itanium-mangled names
    (``_Z...``) give their innermost identifier. Names without any of these come back as they are.
    """
    if name.startswith("_Z"):
        return _short_mangled(name)
    if not _TEMPLATE_OR_ARGS.search(name) and "::" not in name and " " not in name:
        return name
    s = name.replace(_ANON, "anonymous_namespace")
    qual, targs = _split_top(s)
    # drop a return type: the last top-level space before the name
    qual = qual.strip()
    cut = qual.rfind(" ")
    if cut >= 0:
        qual = qual[cut + 1 :]
    base = qual.rsplit("::", 1)[-1] if "::" in qual else qual
    base = base.strip() or name
    if base in _GENERIC_KERNEL_NAMES and targs:
        first = _first_template_arg(targs)
        if first:
            return f"{base}<{short_name(first)}>"
    return base


_OPEN = {"<": ">", "(": ")", "[": "]", "{": "}"}


_BRACKET = re.compile(r"[<>()\[\]{}]")


def _split_top(s: str) -> tuple[str, str]:
    """Split ``s`` into the qualified name with top-level template arguments and the parameter
    list removed, and the text of the last top-level template argument list of the name.

    Inside parentheses ``<`` and ``>`` are operators (``enable_if<((8)>(0))>``), not brackets."""
    out: list[str] = []
    stack: list[str] = []
    last_targs = ""
    start = -1
    prev = 0  # where the top-level text since the last bracket began
    for m in _BRACKET.finditer(s):
        ch, i = m.group(), m.start()
        if ch in _OPEN and not (ch == "<" and stack and stack[-1] == ")"):
            if not stack:
                out.append(s[prev:i])
                if ch == "(":
                    return "".join(out), last_targs
                start = i
            stack.append(_OPEN[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                prev = i + 1
                if ch == ">":
                    last_targs = s[start + 1 : i]
    if not stack:
        out.append(s[prev:])
    return "".join(out), last_targs


def _first_template_arg(targs: str) -> str:
    depth = 0
    for i, ch in enumerate(targs):
        if ch in "<([{":
            depth += 1
        elif ch in ">)]}":
            depth -= 1
        elif ch == "," and depth == 0:
            return targs[:i].strip()
    return targs.strip()


_MANGLED_ID = re.compile(r"(\d+)")


def _short_mangled(name: str) -> str:
    """Innermost identifier of an Itanium-mangled name (``_ZN2at6native9my_kernelEv`` -> my_kernel)."""
    i = 2
    if name[i : i + 1] == "N":
        i += 1
    while i < len(name) and name[i] in "rVKL":  # cv-qualifiers, local names
        i += 1
    last = None
    while i < len(name):
        m = _MANGLED_ID.match(name, i)
        if not m:
            break
        n = int(m.group(1))
        j = m.end()
        if n <= 0 or j + n > len(name):
            break
        last = name[j : j + n]
        i = j + n
        if name[i : i + 1] == "I":  # template args follow: the name is complete
            break
    return last or name


def _fmt_counts(c: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in c.most_common())


# ---------------------------------------------------------------------------------------------
# building the tables


def _memop_kind(name: Any) -> str:
    if not isinstance(name, str):
        return "memcpy_other"
    s = name.lower()
    if "htod" in s:
        return "memcpy_htod"
    if "dtoh" in s:
        return "memcpy_dtoh"
    if "dtod" in s:
        return "memcpy_dtod"
    return "memcpy_other"


_get_cat = operator.attrgetter("cat")
_get_corr = operator.attrgetter("args.correlation")
_get_name = operator.attrgetter("name")
_get_tid = operator.attrgetter("tid")
_get_ts = operator.attrgetter("ts")
_get_dur = operator.attrgetter("dur")
_ALL_CATS = sorted(
    KERNEL_CATS
    | LAUNCH_CATS
    | MEMCPY_CATS
    | MEMSET_CATS
    | CPU_RANGE_CATS
    | GPU_RANGE_CATS
    | OVERHEAD_CATS
    | (OTHER_CATS - {None})
)
_CAT_CODES: dict[Any, int] = {c: i for i, c in enumerate(_ALL_CATS)}
_CAT_CODES[None] = len(_ALL_CATS)


def _cat_name(cat: Any) -> str | None:
    if cat is None or isinstance(cat, str):
        return cat
    return "(category is not a string)"


def _dict_array(values: list) -> pa.DictionaryArray:
    return pa.array(values, type=pa.string()).dictionary_encode()


class _Builder:
    """Turns the decoded events into the run's tables (column by column)."""

    def __init__(
        self,
        path: Path,
        trace: _Trace,
        events: list[_Event],
        skipped: Counter,
        run_id: str,
        rank: int | None,
    ) -> None:
        self.path = path
        self.trace = trace
        self.events = events
        self.skipped = skipped  # "reason" -> count, for events of imported categories
        self.unknown: Counter = Counter()
        self.run_id = run_id
        dist = trace.distributedInfo if isinstance(trace.distributedInfo, dict) else {}
        self.dist = dist
        self.rank = rank if rank is not None else (_i32(dist.get("rank")) or 0)
        base = _int_or_none(trace.baseTimeNanoseconds)
        self.base_ns = base if base is not None and 0 <= base <= _I64_US_LIMIT * 1000 else 0

    # -- grouping ---------------------------------------------------------------------------

    def _groups(self) -> tuple[Counter, Callable[[Iterable[Any]], list[_Event]]]:
        """Count events per category and return a picker of the events of some categories.

        Vectorised: one pass in C collects the categories, numpy compares them."""
        events = self.events
        code_of = _CAT_CODES.get
        try:
            codes = np.fromiter(
                map(code_of, map(_get_cat, events), itertools.repeat(-1)),
                dtype=np.int16,
                count=len(events),
            )
            uniq, num = np.unique(codes, return_counts=True)
            counts = Counter(dict(zip(uniq.tolist(), num.tolist(), strict=True)))
            unknown = np.flatnonzero(codes < 0)
            if len(unknown):
                counts.pop(-1, None)
                counts.update(_cat_name(events[i].cat) for i in unknown.tolist())
        except TypeError:  # an unhashable category (a list, an object)
            cats = [_cat_name(e.cat) for e in events]
            codes = np.array([_CAT_CODES.get(c, -1) for c in cats], dtype=np.int16)
            counts = Counter(_CAT_CODES.get(c, c) for c in cats)

        def pick(wanted: Iterable[str]) -> list[_Event]:
            want = [_CAT_CODES[c] for c in wanted if _CAT_CODES[c] in counts]
            if not want:
                return []
            idx = np.flatnonzero(np.isin(codes, want)).tolist()
            if len(idx) == 1:
                return [events[idx[0]]]
            return list(operator.itemgetter(*idx)(events))

        return counts, pick

    def _checked(
        self,
        what: str,
        events: list[_Event],
        build: Callable[[list[_Event]], dict[str, Any]],
        valid: Callable[[_Event], str | None],
    ) -> dict[str, Any]:
        """``build(events)``; if a value of the wrong type stops it, drop (and count) the events
        that ``valid`` rejects and build again from the rest."""
        try:
            return build(events)
        except _CONVERT_ERRORS:
            pass
        keep = []
        for e in events:
            why = valid(e)
            if why is None:
                keep.append(e)
            else:
                self.skipped[f"{what}: {why}"] += 1
        try:
            return build(keep)
        except _CONVERT_ERRORS as e:
            # a value ``valid`` does not know about: count the whole category as not converted
            self.skipped[f"{what}: could not convert ({type(e).__name__}: {str(e)[:80]})"] += len(
                keep
            )
            return build([])

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> Run:
        counts, pick = self._groups()
        launches = self._launches(pick(LAUNCH_CATS))
        kernels = self._kernels(pick(KERNEL_CATS), launches)
        memops = self._memops(pick(MEMCPY_CATS), pick(MEMSET_CATS))
        cpu_ranges = pick(CPU_RANGE_CATS) + _module_ranges(pick(PYTHON_CATS))
        if not cpu_ranges:
            cpu_ranges = _legacy_step_ranges(pick(LEGACY_OP_CATS))
        ranges = self._ranges(cpu_ranges, pick(GPU_RANGE_CATS))
        overhead_rows = self._overhead_events(pick(OVERHEAD_CATS))
        for cat, n in counts.items():
            if isinstance(cat, str) or cat is None:  # a category this importer does not know
                self.unknown[repr(cat)[:60] if cat is None else cat[:60]] += n
        overheads = self._overheads(overhead_rows)
        meta = self._meta(kernels, launches)
        return Run(meta=meta, kernels=kernels, ranges=ranges, memops=memops, overheads=overheads)

    # launches: correlation id -> (api name, thread, start)

    def _launches(self, events: list[_Event]) -> dict[str, Any]:
        def build(evs: list[_Event]) -> dict[str, Any]:
            corr = pa.array(list(map(_get_corr, evs)), type=pa.int64())
            if corr.null_count:
                raise _BadValues("launch without correlation id")
            names = list(map(_get_name, evs))
            if set(map(type, names)) - {str}:
                raise _BadValues("name is not a string")
            tids = list(map(_get_tid, evs))
            if set(map(type, tids)) - {int}:
                tids = [_int_or_none(t) for t in tids]
            return {
                "corr": corr.to_numpy(),
                "api": _dict_array(names),
                "thread": _ints(tids, pa.int64()),
                "start": _us_to_ns(list(map(_get_ts, evs))) + self.base_ns,
            }

        def valid(e: _Event) -> str | None:
            if e.args is None or _i64(e.args.correlation) is None:
                return "no correlation id"
            if type(e.name) is not str:
                return "name is not a string"
            if not _ok_time(e.ts):
                return "bad ts"
            return None

        return self._checked("launch", events, build, valid)

    def _kernels(self, events: list[_Event], launches: dict[str, Any]) -> pa.Table:
        def build(evs: list[_Event]) -> dict[str, Any]:
            args = [e.args for e in evs]
            if None in args:
                raise _BadValues("kernel without args")
            start = _us_to_ns([e.ts for e in evs]) + self.base_ns
            dur = _us_to_ns([e.dur for e in evs])
            names = [e.name for e in evs]
            mangled = _dict_array(names)
            dictionary = mangled.dictionary.to_pylist()
            shorts = [short_name(n) for n in dictionary]
            uniq = {s: i for i, s in enumerate(dict.fromkeys(shorts))}
            remap = np.array([uniq[s] for s in shorts], dtype=np.int32)
            name = pa.DictionaryArray.from_arrays(
                pa.array(remap[mangled.indices.to_numpy(zero_copy_only=False)], type=pa.int32()),
                pa.array(list(uniq), type=pa.string()),
            )
            streams = [a.stream for a in args]
            if set(map(type, streams)) - {int}:
                streams = [
                    s if type(s) is int else _int_or_none(e.tid)
                    for s, e in zip(streams, evs, strict=True)
                ]
            devices = [a.device for a in args]
            if set(map(type, devices)) - {int}:
                devices = [
                    d if type(d) is int else _int_or_none(e.pid)
                    for d, e in zip(devices, evs, strict=True)
                ]
            grid = self._dims([a.grid for a in args])
            block = self._dims([a.block for a in args])
            corr = pa.array([a.correlation for a in args], type=pa.int64())
            cols: dict[str, Any] = {
                "run_id": pa.array([self.run_id] * len(evs), type=pa.string()),
                "rank": pa.array(np.full(len(evs), self.rank, dtype=np.int32)),
                "device": _ints(devices, pa.int32()),
                "stream": _ints(streams, pa.int64()),
                "start_ns": start,
                "end_ns": start + dur,
                "name": name,
                "mangled": mangled,
                "correlation_id": corr,
                "graph_id": pa.array([a.graph_id for a in args], type=pa.int64()),
                "graph_node_id": pa.array([a.graph_node_id for a in args], type=pa.int64()),
                "grid_x": grid[0],
                "grid_y": grid[1],
                "grid_z": grid[2],
                "block_x": block[0],
                "block_y": block[1],
                "block_z": block[2],
                "registers": pa.array([a.registers for a in args], type=pa.int32()),
                # Kineto's "shared memory" is static + dynamic together; it cannot be split
                "shared_dynamic": pa.array([a.shared for a in args], type=pa.int32()),
            }
            cols.update(self._join_launch(corr, launches))
            return cols

        def valid(e: _Event) -> str | None:
            a = e.args
            if a is None:
                return "no args"
            if type(e.name) is not str:
                return "name is not a string"
            if not _ok_time(e.ts) or not _ok_time(e.dur):
                return "bad ts or dur"
            for v in (a.correlation, a.graph_id, a.graph_node_id):
                if v is not None and _i64(v) is None:
                    return "bad correlation or graph id"
            for v in (a.stream,):
                if v is not None and _i64(v) is None:
                    return "bad stream"
            for v in (a.device, a.registers, a.shared):
                if v is not None and _i32(v) is None:
                    return "bad device, registers or shared memory"
            return None

        cols = self._checked("kernel", events, build, valid)
        return from_pydict(cols, "kernels")

    @staticmethod
    def _dims(values: list) -> tuple[pa.Array, pa.Array, pa.Array]:
        """Three int32 columns from [x, y, z] lists; anything else becomes null."""
        try:
            if set(map(type, values)) != {list} or set(map(len, values)) != {3}:
                raise ValueError("not all [x, y, z]")
            flat = itertools.chain.from_iterable(values)
            m = np.fromiter(flat, dtype=np.int64, count=3 * len(values)).reshape(-1, 3)
            if m.min() < 0 or m.max() >= 2**31:
                raise ValueError("out of range")
            return tuple(pa.array(m[:, i].astype(np.int32)) for i in range(3))  # type: ignore[return-value]
        except (ValueError, TypeError, OverflowError):
            trip = [_dim3(v) for v in values]
            return tuple(pa.array([t[i] for t in trip], type=pa.int32()) for i in range(3))  # type: ignore[return-value]

    def _join_launch(self, corr: pa.Array, launches: dict[str, Any]) -> dict[str, Any]:
        n = len(corr)
        lc = launches["corr"]
        if n == 0 or len(lc) == 0:
            return {}
        order = np.argsort(lc, kind="stable")
        sorted_c = lc[order]
        k = corr.to_numpy(zero_copy_only=False)
        valid = ~np.asarray(corr.is_null().to_numpy(zero_copy_only=False))
        k = np.where(valid, k, 0).astype(np.int64)
        pos = np.searchsorted(sorted_c, k)
        pos_c = np.minimum(pos, len(sorted_c) - 1)
        hit = valid & (sorted_c[pos_c] == k)
        idx = np.where(hit, order[pos_c], 0)
        hit_arr = pa.array(hit)
        api = launches["api"]
        return {
            "launch_api": pa.DictionaryArray.from_arrays(
                pa.array(api.indices.to_numpy(zero_copy_only=False)[idx], mask=~hit),
                api.dictionary,
            ),
            "launch_thread": pc.if_else(
                hit_arr, launches["thread"].take(pa.array(idx)), pa.scalar(None, pa.int64())
            ),
            "launch_start_ns": pa.array(launches["start"][idx], type=pa.int64(), mask=~hit),
        }

    def _memops(self, copies: list[_Event], sets: list[_Event]) -> pa.Table:
        events = copies + sets

        def build(evs: list[_Event]) -> dict[str, Any]:
            args = [e.args for e in evs]
            if None in args:
                raise _BadValues("memop without args")
            start = _us_to_ns([e.ts for e in evs]) + self.base_ns
            dur = _us_to_ns([e.dur for e in evs])
            kinds = ["memset" if e.cat in MEMSET_CATS else _memop_kind(e.name) for e in evs]
            streams = [
                a.stream if type(a.stream) is int else _int_or_none(e.tid)
                for a, e in zip(args, evs, strict=True)
            ]
            devices = [
                a.device if type(a.device) is int else _int_or_none(e.pid)
                for a, e in zip(args, evs, strict=True)
            ]
            return {
                "run_id": pa.array([self.run_id] * len(evs), type=pa.string()),
                "rank": pa.array(np.full(len(evs), self.rank, dtype=np.int32)),
                "device": _ints(devices, pa.int32()),
                "stream": _ints(streams, pa.int64()),
                "kind": _dict_array(kinds),
                "start_ns": start,
                "end_ns": start + dur,
                "bytes": pa.array([a.bytes for a in args], type=pa.int64()),
                "correlation_id": pa.array([a.correlation for a in args], type=pa.int64()),
                "graph_id": pa.array([a.graph_id for a in args], type=pa.int64()),
                "graph_node_id": pa.array([a.graph_node_id for a in args], type=pa.int64()),
            }

        def valid(e: _Event) -> str | None:
            a = e.args
            if a is None:
                return "no args"
            if not _ok_time(e.ts) or not _ok_time(e.dur):
                return "bad ts or dur"
            for v in (a.correlation, a.graph_id, a.graph_node_id, a.bytes, a.stream):
                if v is not None and _i64(v) is None:
                    return "bad bytes, stream or ids"
            if a.device is not None and _i32(a.device) is None:
                return "bad device"
            return None

        return from_pydict(self._checked("memop", events, build, valid), "memops")

    def _ranges(self, cpu: list[_Event], gpu: list[_Event]) -> pa.Table:
        def build(evs: list[_Event]) -> dict[str, Any]:
            n = len(evs)
            start = _us_to_ns([e.ts for e in evs]) + self.base_ns
            end = start + _us_to_ns([e.dur for e in evs])
            names = [e.name for e in evs]
            if set(map(type, names)) - {str}:
                raise _BadValues("range name is not a string")
            ncpu = sum(1 for e in evs if e.cat not in GPU_RANGE_CATS)
            timeline = ["cpu"] * ncpu + ["gpu"] * (n - ncpu)
            threads: list[int | None] = [_int_or_none(e.tid) for e in evs[:ncpu]]
            for e in evs[ncpu:]:
                s = e.args.stream if e.args is not None else None
                threads.append(s if type(s) is int else _int_or_none(e.tid))
            # nest per (timeline, thread): sweep over intervals sorted by start, longest first
            key_thread = np.array(
                [t if type(t) is int and -(2**63) < t < 2**63 else -(2**63) for t in threads],
                dtype=np.int64,
            )
            key_tl = np.array([0] * ncpu + [1] * (n - ncpu), dtype=np.int8)
            order = (
                np.lexsort((-(end - start), start, key_thread, key_tl)) if n else np.zeros(0, int)
            )
            path: list[str] = [""] * n
            depth = np.zeros(n, dtype=np.int32)
            parent: list[int | None] = [None] * n
            range_id = np.empty(n, dtype=np.int64)
            range_id[order] = np.arange(n, dtype=np.int64)
            stack: list[int] = []  # indexes into evs
            prev_key = None
            st, en = start.tolist(), end.tolist()
            for i in order.tolist():
                key = (key_tl[i], key_thread[i])
                if key != prev_key:
                    stack.clear()
                    prev_key = key
                while stack and (en[stack[-1]] <= st[i] or en[stack[-1]] < en[i]):
                    stack.pop()
                if stack:
                    top = stack[-1]
                    parent[i] = int(range_id[top])
                    path[i] = path[top] + "/" + names[i]
                else:
                    path[i] = names[i]
                depth[i] = len(stack)
                stack.append(i)
            cols = {
                "run_id": pa.array([self.run_id] * n, type=pa.string()),
                "rank": pa.array(np.full(n, self.rank, dtype=np.int32)),
                "range_id": range_id,
                "thread": _ints(threads, pa.int64()),
                "timeline": _dict_array(timeline),
                "start_ns": start,
                "end_ns": end,
                "name": _dict_array(names),
                "path": _dict_array(path),
                "depth": depth,
                "parent": pa.array(parent, type=pa.int64()),
            }
            t = pa.table(cols)
            return {
                k: v for k, v in zip(t.column_names, t.take(pa.array(order)).columns, strict=True)
            }

        def valid(e: _Event) -> str | None:
            if type(e.name) is not str:
                return "name is not a string"
            if not _ok_time(e.ts) or not _ok_time(e.dur):
                return "bad ts or dur"
            return None

        return from_pydict(self._checked("range", cpu + gpu, build, valid), "ranges")

    def _overhead_events(self, events: list[_Event]) -> list[dict[str, Any]]:
        rows = []
        for e in events:
            if not _ok_time(e.ts) or not _ok_time(e.dur):
                self.skipped["overhead: bad ts or dur"] += 1
                continue
            start = _us_to_ns([e.ts])[0] + self.base_ns
            rows.append(
                {
                    "kind": "kineto_overhead",
                    "start_ns": int(start),
                    "end_ns": int(start + _us_to_ns([e.dur])[0]),
                    "count": 1,
                    "detail": str(e.name),
                }
            )
        return rows

    def _overheads(self, rows: list[dict[str, Any]]) -> pa.Table:
        for why, count in self.skipped.most_common():
            rows.append({"kind": "skipped_events", "count": count, "detail": why})
        for cat, count in self.unknown.most_common():
            rows.append(
                {
                    "kind": "unknown_category",
                    "count": count,
                    "detail": f"events of category {cat!r} not imported",
                }
            )
        cols: dict[str, list] = {
            k: [r.get(k) for r in rows] for k in ("kind", "start_ns", "end_ns", "count", "detail")
        }
        cols["run_id"] = [self.run_id] * len(rows)
        cols["rank"] = [self.rank] * len(rows)
        return from_pydict(cols, "overheads")

    # -- metadata ----------------------------------------------------------------------------

    def _meta(self, kernels: pa.Table, launches: dict[str, Any]) -> RunMeta:
        t = self.trace
        props = t.deviceProperties if isinstance(t.deviceProperties, list) else []
        gpus = {
            p.get("id"): p.get("name")
            for p in props
            if isinstance(p, dict) and type(p.get("id")) is int
        }
        used = kernels.column("device").drop_null().to_pylist()
        gpu = None
        if used:
            dev = Counter(used).most_common(1)[0][0]
            gpu = gpus.get(dev)
        if gpu is None and gpus:
            names = [n for n in gpus.values() if isinstance(n, str)]
            gpu = names[0] if names else None
        # the device's per-SM figures, for the occupancy columns (analysis.occupancy)
        dev_props = next((p for p in props if isinstance(p, dict) and p.get("name") == gpu
                          and gpu is not None), None)  # fmt: skip
        api = kernels.column("launch_api")
        from_graph = pc.or_(
            pc.is_valid(kernels.column("graph_node_id")),
            pc.fill_null(
                pc.match_substring_regex(api.cast(pa.string()), _GRAPH_LAUNCH.pattern), False
            ),
        )
        graph_kernels = pc.sum(from_graph).as_py() or 0
        apis = launches["api"].dictionary.to_pylist() if "api" in launches else []
        has_graph = any(_GRAPH_LAUNCH.match(n) for n in apis)
        if not kernels.num_rows:
            mode = "unknown"
        elif graph_kernels == kernels.num_rows:
            mode = "graph"
        elif graph_kernels or has_graph:
            mode = (
                "mixed"  # some kernels replayed from a graph, or graph launches beside eager ones
            )
        else:
            mode = "eager"
        created = None
        if kernels.num_rows:
            first = kernels.column("start_ns").to_numpy().min()
            if (
                1_000_000_000 * 10**9 < first < 4_000_000_000 * 10**9
            ):  # a Unix-epoch clock (2001..2096)
                created = _dt.datetime.fromtimestamp(int(first) // 10**9, tz=_dt.UTC)
        config = {
            k: v
            for k, v in {
                "schemaVersion": t.schemaVersion,
                "trace_id": t.trace_id,
                "cupti_version": t.cupti_version,
                "baseTimeNanoseconds": t.baseTimeNanoseconds,
                "distributed_backend": self.dist.get("backend"),
                "nccl_version": self.dist.get("nccl_version"),
            }.items()
            if isinstance(v, str | int)
        }
        if dev_props is not None:
            config["device"] = {
                k: v for k, v in dev_props.items() if k in DEVICE_KEYS and type(v) is int
            }
        skipped = sum(self.skipped.values())
        return RunMeta(
            run_id=self.run_id,
            source="kineto",
            created_at=created,
            source_path=str(self.path),
            tp_world=_i32(self.dist.get("world_size")),
            graph_mode=mode,
            gpu=gpu if isinstance(gpu, str) else None,
            driver=_cuda_version(t.cuda_driver_version),
            cuda=_cuda_version(t.cuda_runtime_version),
            config_json=json.dumps(config, sort_keys=True) if config else None,
            dropped_records=skipped,
            partial=False,
        )


def _cuda_version(v: Any) -> str | None:
    """Kineto writes CUDA versions as 1000 * major + 10 * minor (12090 -> "12.9")."""
    v = _int_or_none(v)
    if v is None or v <= 0:
        return None
    return f"{v // 1000}.{(v % 1000) // 10}"
