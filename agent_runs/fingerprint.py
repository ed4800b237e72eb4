"""The manifest fingerprint: SHA-256 of the canonical JSON, the same after a jsonb round trip."""

from __future__ import annotations

import hashlib
from typing import Any

from agent_runs.validation import canonical_json


def manifest_fingerprint(manifest: Any) -> str:
    """SHA-256 hex digest of the canonical JSON of a manifest, the same after a jsonb round trip.

    Canonical JSON is `json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=False)`
    encoded as UTF-8, of `m` as a jsonb column gives it back, so the fingerprint of a manifest
    equals the fingerprint of what the database returns for it:

    - key order does not matter (keys are sorted); keys are unique in a dict, so jsonb's
      dropping of duplicate keys never arises; tuples are arrays, any Mapping an object;
    - floats are kept as floats, except the two jsonb rewrites: -0.0 is 0.0, and a float of
      magnitude >= 1e16 (printed with an exponent, e.g. 1e+16) is the integer its decimal
      text denotes (jsonb prints it as digits without a point, read back as an int);
      ints of any size below 4,000 digits are exact;
    - refused with InvalidArgument naming `manifest`: anything but a JSON object, non-str keys,
      NaN/Infinity, NUL or lone surrogates in any key or string, more than 64 nested levels.
    """
    return hashlib.sha256(canonical_json(manifest).encode("utf-8")).hexdigest()
