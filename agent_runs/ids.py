"""Run ids: UUIDv7 strings, so new runs' keys land at the right end of the primary key index."""

from __future__ import annotations

import os
import time
import uuid


def new_run_id() -> str:
    """A random UUID of version 7: its first 48 bits are the Unix time in milliseconds.

    New runs' keys then land at the right end of the primary key index (no page splits
    scattered over the whole index, fewer page images in the WAL); uniqueness rests on the 74
    random bits, as for uuid4.
    """
    value = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10))
    value = value & ~(0xF << 76) | 0x7 << 76  # version 7
    value = value & ~(0x3 << 62) | 0x2 << 62  # RFC 9562 variant
    return str(uuid.UUID(int=value))
