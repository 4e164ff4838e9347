"""English formats: times as ``2026-11-26 02:52:07 UTC``, as the CLI prints them (ISO-8601, with seconds).

The admin's default (``Nov. 26, 2026, 2:52 a.m.``) drops the seconds, so the
rows of an every-5-seconds schedule look identical. ``T`` is the zone of
the shown time: ``TIME_ZONE`` (UTC).
"""

from __future__ import annotations

DATETIME_FORMAT = "Y-m-d H:i:s T"
SHORT_DATETIME_FORMAT = "Y-m-d H:i:s T"
TIME_FORMAT = "H:i:s"
DATE_FORMAT = "Y-m-d"
