"""The built-in housekeeping schedules: created when a beat starts, then the operator's to edit.

Each built-in is identified by its fixed name. A beat creates the ones that
are missing and never updates an existing row, so what an operator changed
or disabled in the admin survives every restart. A built-in is also not
created when some other schedule already runs its task (a ``beat_schedule``
entry, or one made by hand), so housekeeping never runs twice a day.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction
from django.db.models import Q

from scheduler.conf import settings
from scheduler.models import Schedule
from scheduler.owners import schedules

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)

PRUNE_EXECUTIONS = "builtin: prune executions"
BACKEND_CLEANUP = "builtin: celery.backend_cleanup"

_KEEP_YOUR_EDITS = (
    " Built in: created when a beat starts if missing; your edits are kept."
    " Disable it rather than delete it (a deleted built-in is created again),"
    " or set SCHEDULER_BUILTIN_SCHEDULES = False."
)

#: Shared by both: a daily job that overran is not started twice, and one
#: missed while no beat ran (up to half a day) still runs once.
_DAILY = {
    "timezone": "UTC",
    "overlap": Schedule.Overlap.SKIP,
    "misfire": Schedule.Misfire.RUN_ONCE,
    "catchup_window": 12 * 3600,
}


def builtin_schedules(app: Celery) -> dict[str, dict[str, Any]]:
    """Return the built-in schedules this app needs, by name, as the field values of a new row."""
    builtins: dict[str, dict[str, Any]] = {
        PRUNE_EXECUTIONS: {
            **_DAILY,
            "task": "scheduler.prune_executions",
            "cron": "17 3 * * *",
            "description": (
                "Deletes finished executions older than SCHEDULER_PRUNE_OLDER_THAN_DAYS, keeping each"
                " schedule's newest SCHEDULER_PRUNE_KEEP_LAST; kwargs older_than_days and keep_last"
                " override them." + _KEEP_YOUR_EDITS
            ),
        },
    }
    # The entry Celery's own beat installs (celery.beat.Scheduler.install_default_entries),
    # under the same condition: results expire, and the backend does not expire them itself.
    if app.conf.result_expires and not app.backend.supports_autoexpire:
        builtins[BACKEND_CLEANUP] = {
            **_DAILY,
            "task": "celery.backend_cleanup",
            "cron": "0 4 * * *",
            "description": (
                "Deletes task results older than Celery's result_expires (default one day)." + _KEEP_YOUR_EDITS
            ),
        }
    return builtins


def ensure_builtin_schedules(app: Celery) -> list[str]:
    """Create each missing built-in schedule; return the names created.

    An existing row is never changed. Replicas starting together may race:
    the unique name lets exactly one insert win, and the others move on.
    """
    if not settings.BUILTIN_SCHEDULES:
        return []
    created = []
    for name, values in builtin_schedules(app).items():
        # The deployer's schedules only: a tenant's schedule of the same name must not keep a built-in away.
        deployers = Schedule.objects.filter(tenant="")
        if deployers.filter(Q(name=name) | Q(task=values["task"])).exists() or not _create(name, values):
            continue
        created.append(name)
        logger.info(
            "built-in schedule %r created", name, extra={"action": "builtin_schedule_created", "schedule": name}
        )
    return created


def _create(name: str, values: dict[str, Any]) -> bool:
    """Insert one built-in; return False when another replica inserted it first."""
    try:
        with transaction.atomic():
            schedules.create(name=name, origin=Schedule.Origin.BUILTIN, **values)
    except IntegrityError:
        return False
    return True
