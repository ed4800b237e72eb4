"""JSON documents (input_payload, manifest, output): strict JSON, checked without recursion."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from agent_runs.errors import InvalidArgument
from agent_runs.validation.limits import MAX_JSON_DEPTH, MAX_JSON_INT, MAX_OUTPUT_BYTES
from agent_runs.validation.text import encodable, plain_str, shown


def _scalar(name: str, value: object, as_stored: bool) -> object:
    """A JSON scalar as a plain value; `as_stored`: numbers as jsonb gives them back."""
    if value is None or value is True or value is False:
        return value
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidArgument(f"{name} must be strict JSON: a string holds NUL (\\u0000)")
        if not encodable(value):
            raise InvalidArgument(f"{name} must be strict JSON: a string holds a lone surrogate")
        return plain_str(value)
    if isinstance(value, int):
        if not -MAX_JSON_INT < value < MAX_JSON_INT:
            raise InvalidArgument(f"{name} must be strict JSON: an int has 4,000 digits or more")
        return int(value)
    if isinstance(value, float):
        number = float(value)
        if not math.isfinite(number):
            raise InvalidArgument(f"{name} must be strict JSON: {number!r} is not a JSON number")
        if as_stored:
            return _as_jsonb(number)
        return number
    raise InvalidArgument(
        f"{name} must be strict JSON: a value of type {type(value).__name__} is not JSON"
    )


def _as_jsonb(number: float) -> float | int:
    """The number json.loads makes of jsonb's text for `number` (jsonb stores the decimal
    json.dumps writes, exactly, and prints it without exponent and without a negative zero)."""
    text = repr(number)
    if "e+" in text:  # >= 1e16: printed as digits without a point, read back as an int
        return int(Decimal(text))
    return 0.0 if number == 0 else number


def json_document(
    name: str, value: object, *, as_stored: bool = False, _root_depth: int = 1
) -> dict[str, Any]:
    """`value` as a plain dict of strict JSON (see the module doc), checked without recursion.

    Mappings become dicts, tuples lists, str/int/float subclasses plain values. With
    `as_stored`, numbers are the ones a jsonb round trip gives back.
    """
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{name} must be a JSON object (dict), got {type(value).__name__}")
    root: dict[str, Any] = {}
    # (source container, its plain copy, depth of the source)
    stack: list[tuple[Mapping[Any, Any] | list[Any] | tuple[Any, ...], Any, int]] = [
        (value, root, _root_depth)
    ]
    while stack:
        source, copy, depth = stack.pop()
        is_object = isinstance(source, Mapping)
        items: Iterable[tuple[Any, Any]]
        items = source.items() if isinstance(source, Mapping) else enumerate(source)
        key: Any
        for key, child in items:
            if is_object:
                if not isinstance(key, str):
                    raise InvalidArgument(
                        f"{name} must be strict JSON: key {shown(key, 60)} is not a string"
                    )
                if "\x00" in key or not encodable(key):
                    raise InvalidArgument(
                        f"{name} must be strict JSON: a key holds NUL or a lone surrogate"
                    )
            if isinstance(child, Mapping | list | tuple):
                if depth >= MAX_JSON_DEPTH:
                    raise InvalidArgument(
                        f"{name} must nest at most {MAX_JSON_DEPTH} objects/arrays deep"
                    )
                inner: dict[str, Any] | list[Any] = {} if isinstance(child, Mapping) else []
                stack.append((child, inner, depth + 1))
                child_copy: object = inner
            else:
                child_copy = _scalar(name, child, as_stored)
            if is_object:
                copy[plain_str(key)] = child_copy
            else:
                copy.append(child_copy)
    return root


def json_object(name: str, value: object) -> dict[str, Any]:
    """A dict of strict JSON (no NaN/Infinity, NUL or lone surrogates, which jsonb refuses)."""
    return json_document(name, value)


def canonical_json(manifest: object) -> str:
    """The canonical JSON text of a manifest as it reads back from jsonb (see the fingerprint)."""
    stored = json_document("manifest", manifest, as_stored=True)
    return json.dumps(stored, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def json_value(name: str, value: object) -> Any:
    """Any value of strict JSON (an object, an array or a scalar) as a plain value, under the
    rules of `json_document` (the same depth limit)."""
    if isinstance(value, Mapping):
        return json_document(name, value)
    if isinstance(value, list | tuple):
        return json_document(name, {"": value}, _root_depth=0)[""]
    return _scalar(name, value, False)


def output_text(value: object, name: str = "output") -> str | None:
    """A run's output as the JSON text sent to jsonb (None: no output): any strict JSON value
    whose JSON text is at most MAX_OUTPUT_BYTES bytes of UTF-8."""
    if value is None:
        return None
    text = json.dumps(json_value(name, value), ensure_ascii=False, separators=(",", ":"))
    size = len(text.encode())
    if size > MAX_OUTPUT_BYTES:
        raise InvalidArgument(
            f"{name} must be at most {MAX_OUTPUT_BYTES:,} bytes of JSON text, got {size:,}"
        )
    return text
