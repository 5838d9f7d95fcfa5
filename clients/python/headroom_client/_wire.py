"""Encoding of one report as a single line of the agent's wire format.

A report is one compact UTF-8 JSON object terminated by ``"\\n"``::

    {"v":1,"pid":123,"ts_ms":1700000000000,"devices":[{"index":0,"uuid":"GPU-...",
     "allocated_bytes":0,"reserved_bytes":0,"active_bytes":0,
     "inactive_split_bytes":0,"peak_allocated_bytes":0,"alloc_retries":0,"ooms":0}]}

Device dicts coming from a stats provider are sanitised here: unknown keys are
ignored, counters become non-negative ints, ``uuid`` is kept only when it looks
like a device UUID, and at most ``MAX_DEVICES`` devices are kept so that a
line never exceeds ``MAX_LINE_BYTES``.

Version 2 adds, on any device, what the client counted in the job's own
tensors (``_composition``), by part and dtype::

    {"v":2,...,"devices":[{"index":0,...,"ooms":0,
     "composition":{"params":{"bfloat16":456},"grads":{},"optimizer":{"float32":246}}}]}

A part left out is unknown; ``{}`` is known to be zero bytes. A report uses
version 2 only when at least one device carries a composition, so a client
that tracks nothing sends exactly the version 1 lines that older agents read.
"""

import json
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional

WIRE_VERSION = 1
MAX_DEVICES = 64
MAX_LINE_BYTES = 32768  # including the terminating newline (the agent refuses longer lines)

# Version 2: a device may carry a "composition".
COMPOSITION_WIRE_VERSION = 2
MAX_COMPOSITION_LINE_BYTES = 65536  # the agent's limit for a version 2 line
COMPOSITION_PARTS = ("params", "grads", "optimizer")
MAX_DTYPES_PER_PART = 8
OTHER_DTYPE = "other"

# Counter fields, in wire order (after "index" and "uuid").
COUNTER_FIELDS = (
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "peak_allocated_bytes",
    "alloc_retries",
    "ooms",
)

# Largest value representable by both i64 and u64 on the agent side.
_MAX_COUNTER = (1 << 63) - 1
# ASCII letters, digits and dashes, at most 96 characters: what the agent
# accepts as a device UUID (anything else would make it reject the report).
_UUID_RE = re.compile(r"[A-Za-z0-9-]{1,96}")
# What the agent accepts as a dtype name; anything else is counted as "other".
_DTYPE_RE = re.compile(r"[a-z0-9_]{1,32}")
# Device ordinals are u32 on the agent side.
_MAX_INDEX = (1 << 32) - 1


def _counter(value: Any) -> int:
    """A non-negative int for a counter field; 0 when missing or not a number."""
    if type(value) is int and 0 <= value <= _MAX_COUNTER:
        return value  # the common case
    if value is None or isinstance(value, bool):
        return 0
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return 0
    if number < 0:
        return 0
    if number > _MAX_COUNTER:
        return _MAX_COUNTER
    return number


def _index(value: Any) -> Optional[int]:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if value < 0 or value > _MAX_INDEX:
        return None
    return value


def _uuid(value: Any) -> Optional[str]:
    if not isinstance(value, str):
        return None
    text = value.strip()
    return text if _UUID_RE.fullmatch(text) else None


def sanitize_device(device: Any) -> Optional[Dict[str, Any]]:
    """The wire form of one provider device dict, or None when it has no usable index."""
    if not isinstance(device, dict):
        return None
    index = _index(device.get("index"))
    if index is None:
        return None
    out = {"index": index}  # type: Dict[str, Any]
    uuid = _uuid(device.get("uuid"))
    if uuid is not None:
        out["uuid"] = uuid
    for field in COUNTER_FIELDS:
        out[field] = _counter(device.get(field))
    return out


def _add_capped(a: int, b: int) -> int:
    total = a + b
    return total if total <= _MAX_COUNTER else _MAX_COUNTER


def sanitize_part(part: Any) -> Optional[Dict[str, int]]:
    """The wire form of one part (dtype name -> bytes), or None when it is not
    a dict. Names the agent would refuse are counted as ``"other"``, zeros are
    left out, and beyond ``MAX_DTYPES_PER_PART`` names the smallest are merged
    into ``"other"``. Largest first, ``"other"`` last."""
    if not isinstance(part, dict):
        return None
    sums = {}  # type: Dict[str, int]
    for name, value in part.items():
        nbytes = _counter(value)
        if not nbytes:
            continue
        if not isinstance(name, str) or not _DTYPE_RE.fullmatch(name):
            name = OTHER_DTYPE
        sums[name] = _add_capped(sums.get(name, 0), nbytes)
    other = sums.pop(OTHER_DTYPE, 0)
    named = sorted(sums.items(), key=lambda item: (-item[1], item[0]))
    if not other and len(named) <= MAX_DTYPES_PER_PART:
        room = MAX_DTYPES_PER_PART
    else:
        room = MAX_DTYPES_PER_PART - 1  # one place for "other"
    if len(named) > room:
        for _, nbytes in named[room:]:
            other = _add_capped(other, nbytes)
        named = named[:room]
    out = dict(named)
    if other:
        out[OTHER_DTYPE] = other
    return out


class WireComposition(dict):
    """A composition already in wire form: made only by
    :func:`sanitize_composition`, so that a composition counted once and sent
    with every report is not checked again at every report."""

    __slots__ = ()


def sanitize_composition(composition: Any) -> Optional[WireComposition]:
    """The wire form of one device's composition, or None when no part is known."""
    if type(composition) is WireComposition:
        return composition
    if not isinstance(composition, dict):
        return None
    out = WireComposition()
    for name in COMPOSITION_PARTS:
        part = sanitize_part(composition.get(name))
        if part is not None:
            out[name] = part
    return out or None


def sanitize_compositions(compositions: Any) -> Dict[int, WireComposition]:
    """:func:`sanitize_composition` of each device of ``{index: composition}``,
    without the devices that have none."""
    out = {}  # type: Dict[int, WireComposition]
    for index, composition in compositions.items():
        clean = sanitize_composition(composition)
        if clean is not None:
            out[index] = clean
    return out


def _line(version: int, pid: int, ts_ms: int, devices: List[Dict[str, Any]]) -> bytes:
    report = {"v": version, "pid": int(pid), "ts_ms": int(ts_ms), "devices": devices}
    return json.dumps(report, separators=(",", ":"), allow_nan=False).encode("utf-8") + b"\n"


def encode_report(
    devices: Optional[Iterable[Any]],
    pid: int,
    ts_ms: int,
    compositions: Optional[Mapping[int, Any]] = None,
) -> Optional[bytes]:
    """Encode a report line, or return None when there is nothing to send.

    Invalid device entries are skipped; only the first ``MAX_DEVICES`` valid ones
    are kept. ``compositions`` maps a device index to that device's
    composition; a kept device with a usable one carries it, and the line is
    then version 2. A version 2 line over ``MAX_COMPOSITION_LINE_BYTES`` is
    sent without its compositions, as version 1. Raises TypeError when
    ``devices`` is not an iterable of devices.
    """
    if devices is None:
        return None
    if isinstance(devices, (str, bytes, bytearray, dict)):
        raise TypeError("stats provider must return a list of device dicts")
    kept = []  # type: List[Dict[str, Any]]
    for device in devices:
        clean = sanitize_device(device)
        if clean is None:
            continue
        kept.append(clean)
        if len(kept) >= MAX_DEVICES:
            break
    if compositions and kept:
        with_compositions = []  # type: List[Dict[str, Any]]
        carried = False
        for device in kept:
            composition = sanitize_composition(compositions.get(device["index"]))
            if composition is not None:
                device = dict(device, composition=composition)
                carried = True
            with_compositions.append(device)
        if carried:
            line = _line(COMPOSITION_WIRE_VERSION, pid, ts_ms, with_compositions)
            if len(line) <= MAX_COMPOSITION_LINE_BYTES:
                return line
            # Too long: the allocator figures matter more than the compositions.
    while kept:
        line = _line(WIRE_VERSION, pid, ts_ms, kept)
        if len(line) <= MAX_LINE_BYTES:
            return line
        # Unreachable with the caps above; kept so the size limit can never be broken.
        kept = kept[: len(kept) // 2]
    return None
