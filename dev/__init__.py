"""Development drivers, not shipped: `make dashboard` (dashboard_demo) and `make screenshots`."""

from __future__ import annotations
