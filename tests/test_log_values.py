"""Values in log lines: what `logs.visible` passes as it is is exactly what `display.escape`
would leave unchanged, so the fast path shows the same text."""

from __future__ import annotations

from agent_runs.display import escape
from agent_runs.logs import MAX_VALUE_LENGTH, visible


def test_escape_leaves_every_printable_character_but_the_backslash_unchanged() -> None:
    changed = [
        hex(code)
        for code in range(0x110000)
        if (ch := chr(code)).isprintable() and ch != "\\" and escape(ch) != ch
    ]
    assert changed == []


def test_visible_equals_escape_on_plain_and_hostile_values() -> None:
    values = [
        "run 0190a1b2-0000-7000-8000-000000000001 attempt 1 (host-42/3:5f1e2d)",
        "completed",
        "naïve – ünïcödé ✓ 日本語",
        "back\\slash",
        "line\nbreak\r\x1b[31mred",
        "bidi \u202e reversed \u2066 isolate",
        "separator \u2028 \u2029 zero width \u200b",
        "lone \ud800 surrogate",
        "nbsp\u00a0and\u3000wide space",
    ]
    for value in values:
        assert visible(value) == escape(value), value


def test_a_long_printable_value_is_still_cut() -> None:
    shown = visible("x" * (MAX_VALUE_LENGTH + 5))
    assert isinstance(shown, str)
    assert shown == "x" * MAX_VALUE_LENGTH + " … [truncated 5 characters]"
