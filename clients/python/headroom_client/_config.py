"""Configuration read from the environment."""

import os
from typing import Mapping, Optional

SOCKET_ENV = "HEADROOM_ALLOCATOR_SOCKET"
DISABLE_ENV = "HEADROOM_ALLOCATOR_DISABLE"
DEFAULT_SOCKET_PATH = "/run/headroom/allocator.sock"

_TRUE_WORDS = frozenset(("1", "true", "yes"))


def socket_path_from_env(environ: Optional[Mapping[str, str]] = None) -> str:
    """The agent socket path: ``$HEADROOM_ALLOCATOR_SOCKET`` if set and non-empty,
    otherwise the default path the agent listens on."""
    env = os.environ if environ is None else environ
    value = env.get(SOCKET_ENV, "").strip()
    return value or DEFAULT_SOCKET_PATH


def disabled_by_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when ``$HEADROOM_ALLOCATOR_DISABLE`` is ``1``, ``true`` or ``yes``
    (case-insensitive)."""
    env = os.environ if environ is None else environ
    return env.get(DISABLE_ENV, "").strip().lower() in _TRUE_WORDS
