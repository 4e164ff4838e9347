"""The one place that reads the local wall clock."""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone


def now() -> datetime:
    """Return the current aware UTC time from this process's clock."""
    return timezone.now()
