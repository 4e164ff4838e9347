"""Limits on what callers may store: the size and depth of task arguments, the length of free text, storable values.

Every entry point (the admin, the commands, the API, ``submit()``) reaches
these through the model's validation or ``submissions.submit``, so a value is
refused with the same message wherever it comes from.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any, TypeGuard

from django.core.exceptions import ValidationError
from django.core.validators import MaxLengthValidator

from scheduler.conf import settings

#: Longest ``description`` of a schedule, in characters.
DESCRIPTION_MAX_CHARS = 2000
#: The largest value the integer columns hold (PostgreSQL's ``integer``): counts, and seconds (68 years).
INTEGER_MAX = 2_147_483_647
#: The largest id a row can have, and the largest number SQLite can bind (64 bits).
KEY_MAX = 2**63 - 1
#: Longest ``paused_reason`` of a schedule (the pause action's reason), in characters.
PAUSED_REASON_MAX_CHARS = 500

#: How messages name a schedule's argument fields.
ARGUMENT_LABELS = {"args": "Arguments", "kwargs": "Keyword arguments"}

_CONTAINERS = (list, tuple, dict)

#: Half of a UTF-16 pair, alone: JSON's ``"\\ud800"`` decodes to one, Python's ``surrogateescape`` makes
#: one of a byte that is not UTF-8 (a command's argument), and no UTF-8 encodes one.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
#: Characters no database stores in text: NUL (PostgreSQL refuses it; SQLite would not, so both refuse it
#: alike) and lone surrogates.
_UNSTORABLE_CHARACTER = re.compile("[\x00\ud800-\udfff]")
#: What such a character becomes where it cannot be refused (``storable``): U+FFFD, the replacement character.
REPLACEMENT = "\ufffd"


def is_key_text(text: str) -> bool:
    """Whether ``text`` is an id as a page or a cursor writes one: ASCII digits, from 1 to ``KEY_MAX``."""
    # Counted before read: past 4,300 digits int() itself raises.
    return text.isascii() and text.isdigit() and len(text) <= len(str(KEY_MAX)) and 1 <= int(text) <= KEY_MAX


def is_whole_number(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` (``True`` is one to Python, but no count or id)."""
    return isinstance(value, int) and not isinstance(value, bool)


def nests_deeper_than(value: Any, limit: int) -> bool:
    """Return whether lists and objects in ``value`` nest more than ``limit`` levels (``[]`` is one).

    Walked with a stack, not recursion, so a value of any depth is measured
    without reaching Python's recursion limit; it stops at the first level
    past ``limit``, so a value that contains itself ends too.
    """
    stack = [(value, 1)] if isinstance(value, _CONTAINERS) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, _CONTAINERS))
    return False


def json_size(value: Any) -> int:
    """Return the bytes of ``value`` as compact JSON in UTF-8 (how big it is stored and sent); ValueError for NaN."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return len(text.encode("utf-8", "surrogatepass"))


def argument_problem(value: Any, *, label: str) -> str | None:
    """Return why ``value`` (task arguments) is refused, starting with ``label``, or None when it fits.

    At most ``SCHEDULER_ARGS_MAX_DEPTH`` levels of nesting, then at most
    ``SCHEDULER_ARGS_MAX_BYTES`` of compact JSON, no NaN or Infinity (not
    JSON, though Python writes them), and no NUL or lone surrogate in its text. The
    depth is checked first, so the size is only measured on a value
    ``json.dumps`` can encode. A value that is not JSON at all is left to the
    caller's own check.
    """
    if nests_deeper_than(value, settings.ARGS_MAX_DEPTH):
        return depth_problem(label)
    max_bytes = settings.ARGS_MAX_BYTES
    try:
        size = json_size(value)
    except TypeError:
        return None
    except ValueError:  # (a value that contains itself is past any depth, above)
        return f"{label} contain NaN or Infinity, which JSON does not allow."
    if size > max_bytes:
        return f"{label} are {size:,} bytes as JSON; at most {max_bytes:,} (SCHEDULER_ARGS_MAX_BYTES) are allowed."
    if holds_unstorable_text(value):
        return (
            f"{label} contain a NUL (\\u0000) or a lone surrogate (\\ud800-\\udfff), which no database stores as text."
        )
    return None


def storable(value: Any) -> Any:
    """``value`` (JSON, or text) as both databases store it: each NUL or lone surrogate as U+FFFD, NaN by its name.

    For records of what happened, which cannot be refused (a plain Celery
    call's arguments, a body's value or error, a notification receiver's
    answer): the call was made, the body ran. PostgreSQL stores a NUL in no
    text, no UTF-8 holds a lone surrogate, no JSON holds NaN, and a write they
    refused would leave the call unrecorded, the execution running or the
    delivery pass stopped.
    """
    if isinstance(value, str):
        return _UNSTORABLE_CHARACTER.sub(REPLACEMENT, value)
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)  # "NaN", "Infinity", "-Infinity"
    if isinstance(value, dict):
        return {storable(key): storable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(item) for item in value]
    return value


def holds_unstorable_text(value: Any) -> bool:
    """Whether a string in ``value`` (JSON), a key or a value, holds a NUL or a lone surrogate."""
    return any(_UNSTORABLE_CHARACTER.search(text) for text in strings_in(value))


def strings_in(value: Any) -> Iterator[str]:
    """Every string in ``value`` (JSON), keys and values, walked with a stack (any depth)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def depth_problem(label: str) -> str:
    """Return the message for task arguments nested past ``SCHEDULER_ARGS_MAX_DEPTH``, starting with ``label``."""
    max_depth = settings.ARGS_MAX_DEPTH
    return (
        f"{label} nest more than {max_depth} levels deep; at most {max_depth} (SCHEDULER_ARGS_MAX_DEPTH) are allowed."
    )


def text_problems(value: Any, limit: int) -> list[str]:
    """Return Django's "at most N characters" message for text longer than ``limit``, else nothing."""
    if not isinstance(value, str):
        return []
    try:
        MaxLengthValidator(limit)(value)
    except ValidationError as exc:
        return list(exc.messages)
    return []
