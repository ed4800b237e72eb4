"""Fault-injection suite: real worker processes, killed workers, dropped connections, a restart.

`python -m chaos` (`make chaos`) starts its own embedded PostgreSQL, enqueues a seeded mix of
scripted runs, drives worker processes and a reconciler while injecting faults, drains, then
checks the crash-safety invariants over the whole database. See `chaos/__main__.py` for options.
"""

from __future__ import annotations
