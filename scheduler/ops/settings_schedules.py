"""Upsert the entries of Celery's ``beat_schedule`` setting as Schedule rows."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from celery.schedules import crontab
from celery.schedules import schedule as every
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from scheduler.models import Schedule
from scheduler.owners import schedules

logger = logging.getLogger(__name__)


def _timing_fields(value: Any) -> dict[str, Any]:
    """Translate a Celery schedule value into our timing fields."""
    if isinstance(value, (int, float)):
        value = timedelta(seconds=value)
    if isinstance(value, timedelta):
        return {"cron": "", "interval": max(int(value.total_seconds()), 1), "run_at": None}
    if isinstance(value, crontab):
        # crontab keeps the user's text only in these private attributes (celery-types omits them).
        parts = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        fields = tuple(getattr(value, f"_orig_{part}") for part in parts)
        return {"cron": " ".join(str(f) for f in fields), "interval": None, "run_at": None}
    if isinstance(value, every):
        # celery-types omits the attribute schedule.__init__ sets.
        run_every: timedelta = value.run_every  # type: ignore[attr-defined]
        return {"cron": "", "interval": max(int(run_every.total_seconds()), 1), "run_at": None}
    raise ValueError(f"unsupported schedule type {type(value).__name__}")


def sync_beat_schedule(beat_schedule: dict[str, dict[str, Any]]) -> list[str]:
    """Create or update one Schedule per ``beat_schedule`` entry; return their names.

    Runtime state (``enabled``, counters, history) of an existing row is kept;
    only what the setting defines is overwritten. An invalid entry is logged
    and skipped, so one bad entry never stops the beat.
    """
    synced = []
    for name, entry in (beat_schedule or {}).items():
        try:
            options = entry.get("options") or {}
            values = {
                "task": entry["task"],
                "args": list(entry.get("args") or []),
                "kwargs": dict(entry.get("kwargs") or {}),
                "queue": options.get("queue", ""),
                **_timing_fields(entry["schedule"]),
            }
        except (KeyError, TypeError, ValueError) as exc:
            logger.error("beat_schedule entry %r ignored: %s", name, exc, extra={"action": "settings_schedule_invalid"})
            continue
        for _ in range(2):  # a second replica may create the same row concurrently
            try:
                with transaction.atomic():
                    schedule = Schedule.objects.select_for_update().filter(name=name).first() or Schedule(name=name)
                    changed = schedule._state.adding or any(getattr(schedule, k) != v for k, v in values.items())
                    if changed:
                        for key, value in values.items():
                            setattr(schedule, key, value)
                        schedule.full_clean(validate_unique=False)
                        schedules.save(schedule)
                synced.append(name)
                break
            except IntegrityError:
                continue
            except ValidationError as exc:
                logger.error(
                    "beat_schedule entry %r ignored: %s", name, exc, extra={"action": "settings_schedule_invalid"}
                )
                break
    return synced
