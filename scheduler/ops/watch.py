"""The watch pass: open and close the incidents operators are told about (``owners.notifications``).

The leader's watch (``LeaderWatch``) also records each run's check-ins. Two conditions are watched:

- a schedule overdue (the dead man's switch, ``Schedule.objects.overdue``),
  and its recovery; watched by the beat leader's housekeeping, since only a
  leader makes schedules run again;
- a lease that fences dispatch (the leadership, or a shard's with shards)
  without a holder for ``NOTIFY_LEADERLESS_SECONDS`` since its last holder's
  term ended, and a holder taking it again. Watched by the leader and by
  every worker (``Watcher``): with no beat alive, nobody else is left to
  tell. A lease that never had a holder is not watched (a deployment whose
  beat has not started yet).

A pass only reads unless a condition changed, so it costs no transaction
(on SQLite one takes the database's write lock). Several watchers may run
at once: an incident is one row per condition, so each start and end is
announced once.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import close_old_connections, connection
from django.db.models import Exists, OuterRef

from scheduler import dbclock
from scheduler.conf import settings
from scheduler.models import Incident, Schedule
from scheduler.ops import cluster
from scheduler.outbox import notifications as outbox_notifications
from scheduler.owners import notifications

logger = logging.getLogger(__name__)

#: Incidents of each kind one pass opens (and, apart, closes) at most; the next pass goes on.
PASS_LIMIT = 100
#: How far a pass looks back for check-ins past the last one's end, and on a new leader's first pass.
CHECK_IN_OVERLAP = timedelta(seconds=60)
CHECK_IN_LOOKBACK = timedelta(minutes=10)


@dataclass(frozen=True)
class WatchReport:
    opened: int = 0
    closed: int = 0
    #: Whether the leadership (lease 0's, or the unsharded lease's) has an open incident after the pass.
    leaderless: bool = False


class LeaderWatch:
    """The leader's watch: overdue schedules and their recovery, the leases, and each run's check-ins.

    Check-ins are read from the runs that started or succeeded since the
    last pass, looking back ``CHECK_IN_OVERLAP`` further each time (a
    row's time is its statement's, and its transaction may commit later),
    and never more than ``CHECK_IN_LOOKBACK`` (a leader's first pass, or
    one after a long time without the lease).
    """

    def __init__(self) -> None:
        self._check_ins_through: datetime | None = None

    def run(self, *, limit: int = PASS_LIMIT) -> WatchReport:
        now = dbclock.now()
        earliest = now - CHECK_IN_LOOKBACK
        since = max((self._check_ins_through or earliest) - CHECK_IN_OVERLAP, earliest)
        notifications.record_check_ins(since=since, until=now)
        self._check_ins_through = now
        return watch(overdue=True, limit=limit, now=now)


def watch(*, overdue: bool, limit: int = PASS_LIMIT, now: datetime | None = None) -> WatchReport:
    """One pass over the leases and, with ``overdue``, the overdue schedules; return what changed."""
    opened = closed = 0
    if overdue:
        now = now or dbclock.now()
        opened += _open_overdue(now, limit=limit)
        closed += _close_recovered(now, limit=limit)
    leases_opened, leases_closed, leaderless = _watch_leases()
    return WatchReport(opened + leases_opened, closed + leases_closed, leaderless)


def _open_overdue(now: datetime, *, limit: int) -> int:
    announced = Incident.objects.filter(kind=Incident.Kind.OVERDUE, schedule=OuterRef("pk"))
    rows = (
        Schedule.objects.overdue(now=now)
        .filter(~Exists(announced))
        .values("pk", "name", "task", "tenant", "overdue_at", "last_success_at")[:limit]
    )
    opened = 0
    for row in rows:
        since = row["overdue_at"]
        last = row["last_success_at"]
        payload = {
            "schedule": row["name"],
            "task": row["task"],
            "overdue_since": since.isoformat(),
            "last_success_at": last.isoformat() if last else None,
            "summary": f"schedule {row['name']!r} is overdue: no success since "
            f"{last.isoformat(timespec='seconds') if last else 'it was created'}",
        }
        opened += notifications.open_incident(
            Incident.Kind.OVERDUE, str(row["pk"]), schedule_id=row["pk"], tenant=row["tenant"], payload=payload
        )
    return opened


def _close_recovered(now: datetime, *, limit: int) -> int:
    # Probed by primary key per open incident, never a list of every schedule that is not overdue.
    still_overdue = Schedule.objects.overdue(now=now).filter(pk=OuterRef("schedule_id"))
    incidents = (
        Incident.objects.filter(kind=Incident.Kind.OVERDUE)
        .filter(~Exists(still_overdue))
        .select_related("schedule")[:limit]
    )
    closed = 0
    for incident in incidents:
        schedule = incident.schedule
        assert schedule is not None  # deleting a schedule deletes its incidents
        why = "is paused or disabled" if schedule.is_paused or not schedule.enabled else "succeeded"
        payload = {
            "schedule": schedule.name,
            "task": schedule.task,
            "overdue_since": incident.opened_at.isoformat(),
            "last_success_at": schedule.last_success_at.isoformat() if schedule.last_success_at else None,
            "summary": f"schedule {schedule.name!r} is no longer overdue: it {why}",
        }
        closed += notifications.close_incident(incident, payload=payload)
    return closed


def _watch_leases() -> tuple[int, int, bool]:
    """Open an incident per fencing lease without a holder past the threshold, close those held again."""
    threshold = settings.NOTIFY_LEADERLESS_SECONDS
    if not threshold:
        return 0, 0, False
    view = cluster.shard_view()
    names = [state.name for state in view.leases] or [settings.LEASE_NAME]
    open_ = {incident.subject: incident for incident in Incident.objects.filter(kind=Incident.Kind.LEADERLESS)}
    open_after = set(open_)
    opened = closed = 0
    for name in names:
        state = view.state(name)
        if state.is_held or state.expires_at is None:
            continue
        without = (view.db_now - state.expires_at).total_seconds()
        if without < threshold or name in open_:
            continue
        what = "the leadership" if len(names) == 1 else f"shard lease {name}"
        payload = {
            "lease": name,
            "last_holder": state.holder,
            "since": state.expires_at.isoformat(),
            "summary": f"{what} has had no holder for {without:.0f}s: nothing it fences is dispatched",
        }
        opened += notifications.open_incident(Incident.Kind.LEADERLESS, name, payload=payload)
        open_after.add(name)  # by this pass or, just before, another watcher's
    for name, incident in open_.items():
        state = view.state(name)
        if state.is_held or name not in names:  # held again, or no longer a lease that fences (a new shard count)
            payload = {
                "lease": name,
                "holder": state.holder,
                "since": incident.opened_at.isoformat(),
                "summary": f"lease {name} has a holder again: {state.holder}"
                if state.is_held
                else f"lease {name} no longer fences dispatch (shard count {view.count})",
            }
            closed += notifications.close_incident(incident, payload=payload)
            open_after.discard(name)
    return opened, closed, names[0] in open_after


class Watcher:
    """A worker's watch: every ``NOTIFY_LEADERLESS_SECONDS / 4``, watch the leases; while nobody leads, deliver too.

    The leader delivers notifications (``beat.housekeeping``); with no leader
    the workers do, so the news that nobody leads reaches someone. Its own
    thread and database connection; a failing pass is logged and retried.
    """

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not settings.NOTIFY_LEADERLESS_SECONDS or not settings.NOTIFY_INTERVAL_SECONDS:
            return
        self._thread = threading.Thread(target=self._run, name="scheduler-watch", daemon=True)
        self._thread.start()

    def stop(self, *, timeout: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        every = max(settings.NOTIFY_LEADERLESS_SECONDS / 4, 1.0)
        while not self._stop.wait(every):
            try:
                close_old_connections()
                if watch(overdue=False).leaderless:
                    outbox_notifications.deliver_due()
            except Exception:  # a watch is housekeeping: log it, watch again
                logger.exception("watch pass failed", extra={"action": "watch_failed"})
                connection.close()
        connection.close()
