"""LeaderScheduler: the Celery beat scheduler that only commits fires while it holds the lease.

Any number of ``celery -A project beat`` replicas may run. A replica commits
a fire only under a lease it holds, checked in the commit's own transaction
(``dispatch.dispatch_due``), and publishes what it committed after the
commit (``outbox.publish_pending``); on PostgreSQL every replica publishes
pending rows, each batch locked so two replicas send different ones. A
replica that holds nothing commits nothing and stands by forever.

What a replica holds is decided every tick by the stored shard count
(``shard_keeper.follow_count``), the same for every replica: the one lease
while it is 1 (``leadership.OneLease``), its share of the shard leases while
it is more (``shard_keeper.ShardKeeper``). A replica that reads a new count
gives up what it holds under the old one and takes its part of the new one
on that tick. Its holder of lease 0 keeps house (``housekeeping``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from datetime import datetime
from typing import Any, cast

from celery.beat import Scheduler
from django.db import DatabaseError, close_old_connections, connection
from django.db.backends.signals import connection_created

from scheduler import checks, logs, outbox, process_ids, shards, tracing
from scheduler.beat import dispatch, leadership, shard_keeper
from scheduler.beat.housekeeping import Housekeeping
from scheduler.beat.liveness import InstanceLock
from scheduler.beat.publishing import Publishing
from scheduler.beat.revoker import Revoker
from scheduler.conf import settings
from scheduler.exceptions import BrokerUnavailable, LeaseLost
from scheduler.models import Instance, Schedule
from scheduler.ops.builtin_schedules import ensure_builtin_schedules
from scheduler.ops.settings_schedules import sync_beat_schedule
from scheduler.owners import instances, schedules

logger = logging.getLogger(__name__)

#: A pass that fires more, or turns more schedules off, logs one line for them at INFO, and each at DEBUG.
FIRES_LOGGED_ONE_BY_ONE = 100


def _limit_idle_transactions(sender: Any, connection: Any, **kwargs: Any) -> None:
    """Make PostgreSQL end a beat session that sits idle inside a transaction.

    A leader frozen mid-transaction (SIGSTOP, a long GC pause) would keep the
    lease row locked and block every takeover; the server ends such a session
    after one TTL, which frees the lock.
    """
    if connection.vendor == "postgresql":
        timeout_ms = int(settings.LEASE_TTL_SECONDS * 1000)
        with connection.cursor() as cursor:
            cursor.execute(f"SET idle_in_transaction_session_timeout = {timeout_ms}")


def _level_of_each(count: int) -> int:
    """The level of one line per item among ``count``: INFO for a few, DEBUG for a burst (0: not logged).

    One INFO line per fire of a 10,000 burst costs the leader a tenth of its 2 s budget.
    """
    if count <= FIRES_LOGGED_ONE_BY_ONE:
        return logging.INFO
    return logging.DEBUG if logger.isEnabledFor(logging.DEBUG) else 0


class LeaderScheduler(Scheduler):
    """A ``celery.beat.Scheduler`` whose due set lives in the database, gated by a lease."""

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        # Celery builds a lazy instance just for the banner: no I/O here.
        kwargs.pop("schedule_filename", None)
        kwargs["max_interval"] = kwargs.get("max_interval") or settings.MAX_INTERVAL_SECONDS
        self.instance_id = process_ids.process_id(unique=True)
        self.lease_name: str = settings.LEASE_NAME
        #: PostgreSQL: this replica's instance lock, kept across changes of the shard count.
        self._lock = InstanceLock(self.instance_id) if connection.vendor == "postgresql" else None
        #: What this replica holds: the one lease until the first tick reads the stored shard count.
        self.leadership: leadership.Leadership = leadership.OneLease(
            self.instance_id, lock=self._lock, sender=type(self)
        )
        #: The stored shard count this replica read last (``None`` before its first tick).
        self.shard_count: int | None = None
        self.housekeeping = Housekeeping(app, self.instance_id)
        self._last_heartbeat = 0.0  # monotonic
        #: Whether the last heartbeat said this replica leads.
        self._heartbeat_leads: bool | None = None
        self._broker_down = False
        #: Sends the revokes of cancelled executions on a thread of its own (started on first use).
        self._revoker: Revoker | None = None
        #: PostgreSQL: publishes during a burst on a thread of its own (started on first use).
        self._publishing = Publishing(self._publish) if connection.features.has_select_for_update else None
        #: The last pass left due schedules because another transaction held a row they need.
        self._held_back = False
        #: The instants of the slots this replica committed ahead of them and has not seen come yet.
        self._ahead: set[datetime] = set()
        #: The earliest of them on this process's ``time.monotonic()`` clock.
        self._ahead_at = 0.0
        self._ticking = False
        self._interrupted = False
        #: close() was called: this replica is shutting down and must not tick again.
        self._stopping = False
        super().__init__(app, *args, **kwargs)

    # --- Celery's scheduler contract ------------------------------------------

    def setup_schedule(self) -> None:
        checks.refuse_to_start_on_errors("beat")
        logs.bind(instance_id=self.instance_id)
        connection_created.connect(_limit_idle_transactions, dispatch_uid="scheduler.beat.idle_tx")
        close_old_connections()
        try:
            synced = sync_beat_schedule(self.app.conf.beat_schedule)
            if synced:
                logger.info("beat_schedule entries synced: %s", ", ".join(synced))
        except DatabaseError:
            logger.exception("could not sync beat_schedule into the database; continuing")
        try:
            # After beat_schedule: an entry there that runs a built-in's task replaces it.
            ensure_builtin_schedules(self.app)
        except DatabaseError:
            logger.exception("could not create the built-in schedules; continuing")
        logger.info(
            "beat replica %s started (lease %r, ttl %ss, renew %ss)",
            self.instance_id,
            self.lease_name,
            settings.LEASE_TTL_SECONDS,
            settings.LEASE_RENEW_SECONDS,
            extra={"action": "beat_started", "instance_id": self.instance_id},
        )

    # Celery's Scheduler declares a plain attribute; reading it is all Celery does.
    @property
    def schedule(self) -> dict[str, Any]:  # type: ignore[override]
        # The due set lives in the database and is read per tick; there is no
        # in-memory heap to rebuild (and nothing for Celery to sync).
        return {}

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Hold what this replica should, dispatch what is due under it; return seconds to sleep.

        On PostgreSQL the sleep is spent inside the tick, waiting for a change
        in who holds what (``Leadership.wait``), and what is left is returned.

        Once ``close()`` was called it raises ``SystemExit`` instead: Celery's
        SIGTERM handler raises it wherever the signal lands, and Python drops
        an exception raised inside a weakref callback or a finalizer ("Exception
        ignored in ..."), which would leave this replica running, and leading,
        after the shutdown it was asked for.
        """
        if self._stopping:
            raise SystemExit()
        delay = self._guarded_tick()
        if self._stopping:  # asked to stop during this tick, and the signal's SystemExit was lost
            raise SystemExit()
        return delay

    def _guarded_tick(self) -> float:
        self._ticking = True
        try:
            with tracing.span(
                "scheduler.tick",
                instance_id=self.instance_id,
                lease_name=self.lease_name,
                lease_token=self._one_lease_token(),
            ):
                # First: the message of a slot committed ahead waits for nothing once its instant came.
                sent_first = self._ahead_came() and self._may_publish(self.leadership.held) and self._publish()
                self._follow_count()
                delay = 0.0 if sent_first else self._tick()
            return self.leadership.wait(delay)
        except DatabaseError:
            logger.exception(
                "database unavailable; not dispatching until it answers again",
                extra={"action": "database_unavailable", "instance_id": self.instance_id},
            )
            self.leadership.pause()
            # Drop the broken connection so the next tick reconnects.
            connection.close()
            return settings.FOLLOWER_RETRY_SECONDS
        except Exception:  # the loop boundary: one bad tick must not kill beat
            logger.exception("beat tick failed; trying again", extra={"action": "tick_failed"})
            return settings.FOLLOWER_RETRY_SECONDS
        finally:
            self._ticking = False

    def close(self) -> None:
        """Release what this replica holds on shutdown, so the others take it over at once."""
        self._stopping = True
        if self._ticking:
            # Celery calls this from its SIGTERM handler, here in the middle of
            # a tick: this thread is inside a database or broker call, and
            # using its connection now would wait on itself forever. Celery
            # calls close() again once the tick has unwound; release then, on
            # a fresh connection.
            self._interrupted = True
            return
        if self._interrupted:
            connection.close()
        if self._publishing is not None:
            self._publishing.close(timeout=2 * outbox.wait_seconds())
        if self._ahead:
            try:
                # Under this replica's lease still: whoever leads next plans the slots again.
                schedules.give_back_committed_ahead(dispatcher=self.instance_id)
            except DatabaseError:
                pass  # they stay committed: whoever leads next sends them at their instant
        try:
            # First: the shard keepers of the others no longer count this replica live when its release wakes them.
            instances.remove(self.instance_id)
        except DatabaseError:
            pass  # reconcile removes stale instances
        self.leadership.release("on shutdown")
        if self._lock is not None:
            self._lock.close()  # after the release: a follower that sees it free finds the lease free too
        super().close()

    @property
    def info(self) -> str:
        # No database here (the lazy banner instance): the stored count is read on the first tick.
        return (
            f"    . lease -> {self.lease_name}, or {self.lease_name}:<k> per shard as the stored shard count says "
            f"(SCHEDULER_SHARDS={shards.configured()} if none is stored) "
            f"(ttl {settings.LEASE_TTL_SECONDS}s, renew {settings.LEASE_RENEW_SECONDS}s)"
        )

    # --- one tick ---------------------------------------------------------------

    def _tick(self) -> float:
        """Hold what this replica should, dispatch for it, publish; return seconds to sleep."""
        self._heartbeat()  # first: the live replicas a shard keeper reads must include this one
        held = dict(self.leadership.hold())
        self._heartbeat()  # again at once if it now leads, or no longer does
        may_publish = self._may_publish(held)
        if not held:
            return 0.0 if may_publish and self._publish() else settings.FOLLOWER_RETRY_SECONDS
        # With one shard the commits are fenced by the one lease, with more by the shards held.
        fence: dispatch.Fence = held[0] if self.shard_count == 1 else held
        dispatch_started = time.monotonic()  # about when the database clock below was read
        try:
            report = dispatch.dispatch_due(fence)
        except LeaseLost as exc:
            self.leadership.lost(exc.names)
            return 0.0
        came = {instant for instant in self._ahead if instant <= report.db_now}
        if came:  # sent as the tick began, or by the publish below
            self._ahead -= came
            report.due_now = True
        self._ahead |= report.ahead
        if self._ahead:
            self._ahead_at = dispatch_started + (min(self._ahead) - report.db_now).total_seconds()
        more_pending = False
        try:
            if 0 in held:
                # Lease 0's holder keeps house for all; the broker check under a new lease comes first.
                self.housekeeping.before_publish(held[0])
            if report.more and self._publishing is not None:
                # A burst: what this tick committed goes out while the next tick commits more.
                self._publishing.wake()
            elif report.due_now or not self._ahead:
                # (Not when this tick only committed ahead: nothing of it is due yet.)
                more_pending = may_publish and self._publish()
        finally:
            # After the publish: a due slot's message waits for nothing but its commit.
            self._after_dispatch(report, fence)
        if 0 in held:
            self.housekeeping.start_due(held[0])
        if more_pending or report.more:
            return 0.0
        return self._seconds_until_next_work(report.db_now, fence, read_at=dispatch_started)

    def _ahead_came(self) -> bool:
        """Whether the instant of a slot committed ahead has come (by this process's clock)."""
        return bool(self._ahead) and time.monotonic() >= self._ahead_at

    @staticmethod
    def _may_publish(held: Mapping[int, Any]) -> bool:
        """Whether a replica holding ``held`` publishes.

        Publishing needs no lease (the worker claims each execution once),
        so the replicas share it. Only where rows lock (PostgreSQL): on
        SQLite every write waits for the one write lock and publishers
        cannot keep off each other's rows, so only the holder of lease 0
        publishes.
        """
        return connection.features.has_select_for_update or 0 in held

    def _after_dispatch(self, report: dispatch.DispatchReport, fence: dispatch.Fence) -> None:
        token = None if isinstance(fence, Mapping) else fence.token
        self._held_back = report.locked > 0
        self._revoke(report.cancelled_task_ids)
        self._log_outcomes(report, token)

    def _log_outcomes(self, report: dispatch.DispatchReport, token: int | None) -> None:
        """Log each schedule that turned itself off and each fire; a burst of either as one line."""
        by_token = f" (token {token})" if token is not None else ""
        level = _level_of_each(len(report.completed))
        if level != logging.INFO:
            reasons = Counter(reason for _, reason in report.completed)
            logger.info(
                "%d schedules turned themselves off: %s",
                len(report.completed),
                "; ".join(f"{reason} ({count})" for reason, count in reasons.most_common()),
                extra={"action": "schedules_completed", "instance_id": self.instance_id},
            )
        for name, reason in report.completed if level else ():
            logger.log(
                level,
                "schedule %s turned itself off: %s",
                name,
                reason,
                extra={"action": "schedule_completed", "schedule": name, "instance_id": self.instance_id},
            )
        level = _level_of_each(len(report.fired))
        if level != logging.INFO:
            logger.info(
                "dispatched %d slots, %s to %s%s",
                len(report.fired),
                min(slot for _, slot in report.fired).isoformat(),
                max(slot for _, slot in report.fired).isoformat(),
                by_token,
                extra={"action": "dispatched_many", "instance_id": self.instance_id, "token": token},
            )
        for name, slot in report.fired if level else ():
            logger.log(
                level,
                "dispatch %s slot %s%s",
                name,
                slot.isoformat(),
                by_token,
                extra={"action": "dispatched", "schedule": name, "instance_id": self.instance_id, "token": token},
            )

    def _publish(self) -> bool:
        """Publish pending executions; return whether a full batch went out (maybe more)."""
        try:
            sent = outbox.publish_pending(self.app)
        except BrokerUnavailable as exc:
            if not self._broker_down:
                logger.warning(
                    "broker unreachable (%s); executions stay pending until it returns",
                    exc,
                    extra={"action": "broker_unavailable", "instance_id": self.instance_id},
                )
            self._broker_down = True
            return False
        if self._broker_down:
            logger.info("broker reachable again", extra={"action": "broker_available"})
            self._broker_down = False
        return sent >= settings.DISPATCH_BATCH_SIZE

    def _revoke(self, task_ids: list[str]) -> None:
        """Stop executions cancelled by ``overlap=cancel_previous`` (already recorded ``cancelled``), off this tick."""
        if task_ids:
            if self._revoker is None:
                self._revoker = Revoker(self.app)
            self._revoker.revoke(task_ids)

    def _seconds_until_next_work(self, db_now: Any, fence: dispatch.Fence, *, read_at: float) -> float:
        """Seconds until the next work for ``fence``, a renewal or the loop bound, counted from now.

        The next work is a slot committed ahead reaching its instant, or
        ``COMMIT_AHEAD_SECONDS`` before the next slot, to commit it ahead;
        a slot nearer than that was left for the general path at its
        instant. ``db_now`` was read at ``read_at`` (``time.monotonic()``),
        before this tick's work and this method's read: without taking that
        time off, the leader would oversleep every slot by it.
        """
        active = Schedule.objects.active()
        if isinstance(fence, Mapping):
            active = active.filter(shard__in=list(fence))
        next_due = (
            active.filter(next_run_at__isnull=False)
            .order_by("next_run_at")
            .values_list("next_run_at", flat=True)
            .first()
        )
        elapsed = time.monotonic() - read_at
        # Scheduler.__init__ always sets max_interval; celery-types allows None.
        candidates: list[float] = [cast(float, self.max_interval), self.leadership.seconds_until_renew()]
        if next_due is not None:
            until = (next_due - db_now).total_seconds()
            ahead = dispatch.commit_ahead_seconds()
            candidates.append((until - ahead if until > ahead else until) - elapsed)
        if self._ahead:
            candidates.append((min(self._ahead) - db_now).total_seconds() - elapsed)
        # Schedules left because their rows were locked are due still: try them soon, not in a tight loop.
        return max(min(candidates), dispatch.LOCKED_RETRY_SECONDS if self._held_back else 0.0)

    # --- the shard count ----------------------------------------------------------

    def _follow_count(self) -> None:
        """Read the stored shard count (storing ``SCHEDULER_SHARDS`` if none is) and hold what it says.

        From 1 to more, the replica releases the one lease and takes its
        shards in this tick; back to 1, it releases every shard and seeks the
        one lease. The dispatch commits are fenced by the count too
        (``leases.assert_held_many``), so what it still holds under the old
        count commits nothing once the count changed.
        """
        count = shard_keeper.follow_count(self.instance_id)
        previous = self.shard_count
        if count == previous:
            return
        self._count_changed(previous, count)
        self.shard_count = count
        self.leadership = leadership.following(
            self.leadership, count, instance_id=self.instance_id, lock=self._lock, sender=type(self)
        )

    def _count_changed(self, previous: int | None, count: int) -> None:
        if previous is None:
            logger.info(
                "shard count %s (stored), followed by %s",
                count,
                self.instance_id,
                extra={"action": "shard_count", "instance_id": self.instance_id, "shards": count},
            )
        else:
            logger.warning(
                "shard count changed from %s to %s; %s follows it",
                previous,
                count,
                self.instance_id,
                extra={
                    "action": "shard_count_changed",
                    "instance_id": self.instance_id,
                    "shards": count,
                    "previous": previous,
                },
            )
        configured = shards.configured()
        if configured != count:
            logger.warning(
                "SCHEDULER_SHARDS is %s here but the stored shard count is %s: following the stored count "
                "(the setting only seeds an empty table; change the count with manage.py shards --set N)",
                configured,
                count,
                extra={
                    "action": "shard_count_differs",
                    "instance_id": self.instance_id,
                    "shards": count,
                    "configured": configured,
                },
            )

    def _one_lease_token(self) -> int | None:
        """The one lease's token while this replica holds it (``None`` with shards: each has its own)."""
        lease = self.leadership.held.get(0) if self.shard_count == 1 else None
        return lease.token if lease is not None else None

    # --- heartbeat ------------------------------------------------------------------

    def _heartbeat(self) -> None:
        """Write this replica's ``Instance`` row every renewal interval, and at once when whether it leads changed."""
        leads = bool(self.leadership.held)
        if leads == self._heartbeat_leads and time.monotonic() - self._last_heartbeat < settings.LEASE_RENEW_SECONDS:
            return
        instances.beat(self.instance_id, role=Instance.Role.BEAT, is_leader=leads)
        self._last_heartbeat, self._heartbeat_leads = time.monotonic(), leads
