"""Calling management commands in tests: their output, or the one-line refusal they must give."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command


def run(*args: str) -> str:
    """Run ``manage.py <args>`` in process; return what it wrote to stdout."""
    out = io.StringIO()
    call_command(*args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def refused(*args: str) -> str:
    """Run a command that must refuse with exit code 1 and a one-line message; return the message."""
    with pytest.raises(CommandError) as caught:
        run(*args)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message and caught.value.returncode == 1
    return message
