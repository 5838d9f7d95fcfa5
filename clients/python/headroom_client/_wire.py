"""Encoding of one report as a single line of the agent's wire format.

A report is one compact UTF-8 JSON object terminated by ``"\\n"``::

    {"v":1,"pid":123,"ts_ms":1700000000000,"devices":[{"index":0,"uuid":"GPU-...",
     "allocated_bytes":0,"reserved_bytes":0,"active_bytes":0,
     "inactive_split_bytes":0,"peak_allocated_bytes":0,"alloc_retries":0,"ooms":0}]}

Device dicts coming from a stats provider are sanitised here: unknown keys are
ignored, counters become non-negative ints, ``uuid`` is kept only when it looks
like a device UUID, and at most ``MAX_DEVICES`` devices are kept so that a
line never exceeds ``MAX_LINE_BYTES``.
"""

import json
import re
from typing import Any, Dict, Iterable, List, Optional

WIRE_VERSION = 1
MAX_DEVICES = 64
MAX_LINE_BYTES = 32768  # including the terminating newline (the agent refuses longer lines)

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


def encode_report(devices: Optional[Iterable[Any]], pid: int, ts_ms: int) -> Optional[bytes]:
    """Encode a report line, or return None when there is nothing to send.

    Invalid device entries are skipped; only the first ``MAX_DEVICES`` valid ones
    are kept. Raises TypeError when ``devices`` is not an iterable of devices.
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
    while kept:
        report = {"v": WIRE_VERSION, "pid": int(pid), "ts_ms": int(ts_ms), "devices": kept}
        line = json.dumps(report, separators=(",", ":"), allow_nan=False).encode("utf-8") + b"\n"
        if len(line) <= MAX_LINE_BYTES:
            return line
        # Unreachable with the caps above; kept so the size limit can never be broken.
        kept = kept[: len(kept) // 2]
    return None
