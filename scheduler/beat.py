"""LeaderScheduler: the Celery beat scheduler that only commits fires while it holds the lease.

Any number of ``celery -A project beat`` replicas may run. Each tick a replica
keeps or seeks the database lease; followers commit nothing and stand by
forever (they never exit on losing the lease, unlike RedBeat, sibson/redbeat#230).
The leader commits due fires under its fencing token (``dispatch.dispatch_due``)
and publishes them after the commit (``dispatch.publish_pending``); on
PostgreSQL followers publish pending rows too, each batch locked so two
replicas send different ones. Its
periodic reconcile pass runs in a thread of its own, so it never delays a
tick or a lease renewal, and its broker check in another, so a long
reconcile pass never delays the re-send of what the broker lost.

Whether a replica seeks the one lease or shares shard leases with the others
is decided every tick by the stored shard count (``shard_keeper.follow_count``),
the same for every replica: a replica that reads a new count gives up what it
holds under the old one and takes its part of the new one on that tick.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import Any, cast

from celery.beat import Scheduler
from django.db import DatabaseError, close_old_connections, connection
from django.db.backends.signals import connection_created
from kombu.exceptions import OperationalError as BrokerError

from scheduler import dispatch, instances, leases, logs, reconcile, shard_keeper, shards, signals, tracing
from scheduler.builtin_schedules import ensure_builtin_schedules
from scheduler.conf import settings
from scheduler.exceptions import LeaseLost
from scheduler.models import Instance, Schedule
from scheduler.revoker import Revoker
from scheduler.settings_schedules import sync_beat_schedule
from scheduler.shard_keeper import ShardKeeper

logger = logging.getLogger(__name__)


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


class LeaderScheduler(Scheduler):
    """A ``celery.beat.Scheduler`` whose due set lives in the database, gated by a lease."""

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        # Celery builds a lazy instance just for the banner: no I/O here.
        kwargs.pop("schedule_filename", None)
        kwargs["max_interval"] = kwargs.get("max_interval") or settings.MAX_INTERVAL_SECONDS
        self.instance_id = leases.new_instance_id()
        self.lease_name: str = settings.LEASE_NAME
        self.lease: leases.LeaseHandle | None = None
        #: While the stored shard count is more than 1: the shards this replica holds (``self.lease`` stays ``None``).
        self.shards: ShardKeeper | None = None
        #: The stored shard count this replica read last (``None`` before its first tick).
        self.shard_count: int | None = None
        self._announced = False
        #: PostgreSQL: this replica's instance lock, and its wait for the holder's.
        self._instance_lock: leases.InstanceLock | None = None
        #: (holder, token) of a leader whose instance lock came free: its process is gone.
        self._holder_gone: tuple[str, int] | None = None
        self._last_renew = 0.0  # monotonic
        self._last_heartbeat = 0.0  # monotonic
        self._broker_down = False
        self._last_reconcile = time.monotonic()  # the first pass runs one interval after start
        self._last_broker_check = 0.0  # monotonic
        #: (name, token) of the lease the last broker check ran under: the first check under another runs at once.
        self._broker_checked_under: tuple[str, int] | None = None
        self._reconciler: threading.Thread | None = None
        self._broker_checker: threading.Thread | None = None
        #: Sends the revokes of cancelled executions on a thread of its own (started on first use).
        self._revoker: Revoker | None = None
        #: The last pass left due schedules because another transaction held a row they need.
        self._held_back = False
        self._ticking = False
        self._interrupted = False
        super().__init__(app, *args, **kwargs)

    # --- Celery's scheduler contract ------------------------------------------

    def setup_schedule(self) -> None:
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
        """Keep or seek leadership, dispatch what is due; return seconds to sleep.

        A PostgreSQL follower spends its sleep inside the tick, waiting for the
        holder to go (``_follower_wait``), and returns 0.
        """
        self._ticking = True
        try:
            with tracing.span(
                "scheduler.tick",
                instance_id=self.instance_id,
                lease_name=self.lease_name,
                lease_token=self.lease and self.lease.token,
            ):
                self._follow_count()
                delay = self._tick() if self.shards is None else self._tick_sharded()
            if self.shards is not None:
                return self._shard_wait(delay)
            return self._follower_wait(delay)
        except DatabaseError:
            logger.exception(
                "database unavailable; not dispatching until it answers again",
                extra={"action": "database_unavailable", "instance_id": self.instance_id},
            )
            self._step_down("database unavailable")
            if self.shards is not None and (dropped := self.shards.forget()):
                # Uncertain, so paused: taken again, under new tokens, once the database answers.
                logger.warning(
                    "shards %s paused until the database answers", dropped, extra={"action": "shards_paused"}
                )
            # Drop the broken connection so the next tick reconnects.
            connection.close()
            return settings.FOLLOWER_RETRY_SECONDS
        except Exception:  # the loop boundary: one bad tick must not kill beat
            logger.exception("beat tick failed; trying again", extra={"action": "tick_failed"})
            return settings.FOLLOWER_RETRY_SECONDS
        finally:
            self._ticking = False

    def close(self) -> None:
        """Release the lease on shutdown so a follower takes over at once."""
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
        if self.shards is not None:
            self._leave_shards(shutdown=True)
        self._release_lease("on shutdown")
        if self._instance_lock is not None:
            self._instance_lock.close()  # after the release: a follower that sees it free finds the lease free too
        try:
            instances.remove(self.instance_id)
        except DatabaseError:
            pass  # reconcile removes stale instances
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
        lease = self._keep_or_seek_leadership()
        self._heartbeat()
        if lease is None:
            # A follower publishes what the leader committed: sending needs no
            # lease (the worker claims each execution once), so the replicas
            # share the leader's publishing while it commits. Only where rows
            # lock (PostgreSQL): on SQLite every write waits for the one write
            # lock and publishers cannot keep off each other's rows, so a
            # second publisher would mostly send the same rows again.
            if connection.features.has_select_for_update and self._publish():
                return 0.0
            return settings.FOLLOWER_RETRY_SECONDS
        try:
            dispatch_started = time.monotonic()  # about when the database clock below was read
            report = dispatch.dispatch_due(lease)
        except LeaseLost:
            # Released as well: a no-op when another replica took it over, but
            # when the shard count changed under the commit the row still
            # names this replica, and nobody should wait out its TTL.
            leases.release(lease)
            self._step_down("lost")
            return 0.0
        self._after_dispatch(report, token=lease.token)
        more_pending = self._publish()
        self._start_broker_check(lease)
        self._start_reconcile(lease)
        if more_pending or report.more:
            return 0.0
        return self._seconds_until_next_work(report.db_now, elapsed=time.monotonic() - dispatch_started)

    def _tick_sharded(self) -> float:
        """One tick with shards: step the shards held towards the preferred ones, dispatch for those held."""
        assert self.shards is not None
        if connection.vendor == "postgresql" and not self._hold_instance_lock():
            self.shards.forget()  # without our instance lock the others take our shards as a gone replica's
            return settings.FOLLOWER_RETRY_SECONDS
        self._heartbeat()
        if not self._announced and self._instance_lock is not None:
            self._instance_lock.notify("joined")  # the others release the shards this replica should own now
        self._announced = True
        assert self.shard_count is not None
        held = dict(self.shards.step(self.shard_count))
        # Publishing needs no lease (see ``_tick``); on SQLite only shard 0's holder publishes.
        may_publish = connection.features.has_select_for_update or 0 in held
        if not held:
            return 0.0 if may_publish and self._publish() else settings.FOLLOWER_RETRY_SECONDS
        dispatch_started = time.monotonic()
        try:
            report = dispatch.dispatch_due(held)
        except LeaseLost as exc:
            self.shards.forget(exc.names)
            leases.release_many([lease for lease in held.values() if lease.name in exc.names])  # as in ``_tick``
            return 0.0
        self._after_dispatch(report, token=None)
        more_pending = may_publish and self._publish()
        if 0 in held:
            # Shard 0's holder keeps house for all.
            self._start_broker_check(held[0])
            self._start_reconcile(held[0])
        if more_pending or report.more:
            return 0.0
        return self._seconds_until_next_work(
            report.db_now, elapsed=time.monotonic() - dispatch_started, in_shards=list(held)
        )

    def _after_dispatch(self, report: dispatch.DispatchReport, *, token: int | None) -> None:
        self._held_back = report.locked > 0
        self._revoke(report.cancelled_task_ids)
        for name, reason in report.completed:
            logger.info(
                "schedule %s turned itself off: %s",
                name,
                reason,
                extra={"action": "schedule_completed", "schedule": name, "instance_id": self.instance_id},
            )
        for name, slot in report.fired:
            logger.info(
                "dispatch %s slot %s%s",
                name,
                slot.isoformat(),
                f" (token {token})" if token is not None else "",
                extra={"action": "dispatched", "schedule": name, "instance_id": self.instance_id, "token": token},
            )

    def _publish(self) -> bool:
        """Publish pending executions; return whether a full batch went out (maybe more)."""
        try:
            sent = dispatch.publish_pending(self.app)
        except (BrokerError, OSError, ConnectionError) as exc:
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

    def _start_reconcile(self, lease: leases.LeaseHandle) -> None:
        """Start a reconcile pass every ``RECONCILE_INTERVAL_SECONDS``, in its own thread, one at a time."""
        interval = settings.RECONCILE_INTERVAL_SECONDS
        started = time.monotonic()
        if not interval or started - self._last_reconcile < interval:
            return
        if self._reconciler is not None and self._reconciler.is_alive():
            return  # the last pass is still running; never two at once
        self._last_reconcile = started
        self._reconciler = self._thread("scheduler-reconcile", self._reconcile, lease)

    def _start_broker_check(self, lease: leases.LeaseHandle) -> None:
        """Ask the broker every ``BROKER_CHECK_SECONDS`` whether it lost messages, in a thread of its own, one at a time.

        Not on the reconcile thread: a broker restart is repaired within
        seconds however long a reconcile pass takes. The first check under
        a lease just taken (a new token) runs at once: a broker that
        restarted while nobody led is repaired now, not a check later.
        """
        check = settings.BROKER_CHECK_SECONDS
        started = time.monotonic()
        under = (lease.name, lease.token)
        if not check or (under == self._broker_checked_under and started - self._last_broker_check < check):
            return
        if self._broker_checker is not None and self._broker_checker.is_alive():
            return
        self._last_broker_check, self._broker_checked_under = started, under
        self._broker_checker = self._thread("scheduler-broker-check", self._check_broker, lease)

    def _thread(self, name: str, target: Any, lease: leases.LeaseHandle) -> threading.Thread:
        # The copied context carries the bound log fields (instance id, token) into the thread.
        thread = threading.Thread(target=contextvars.copy_context().run, args=(target, lease), name=name, daemon=True)
        thread.start()
        return thread

    def _reconcile(self, lease: leases.LeaseHandle) -> None:
        """A reconcile pass, on this thread's own database connection, while ``lease`` is held.

        A failing pass is logged and the next one runs an interval later.
        Reconcile's changes are conditional updates that an operator's
        ``reconcile`` may run concurrently too, so a pass that outlives the
        lease does no harm; it just does not start without it.
        """
        try:
            state = self._still_held(lease)
            if state is not None:
                self._log_reconcile(reconcile.reconcile(now=state.db_now, app=self.app))
        except Exception:  # reconcile is housekeeping: log it, keep dispatching
            logger.exception(
                "reconcile failed; trying again in %ss",
                settings.RECONCILE_INTERVAL_SECONDS,
                extra={"action": "reconcile_failed"},
            )
        finally:
            connection.close()  # this thread's own connection (Django's are per thread)

    def _check_broker(self, lease: leases.LeaseHandle) -> None:
        """Send again what the broker lost, or what waited unclaimed too long, on this thread's own connection.

        Every ``queued`` execution sent before a check that finds a broker
        run nobody confirmed is sent again, including those this leader
        sent itself since it took the lease: the broker may have restarted
        after they went out, and a copy it did keep is claimed once.
        """
        try:
            state = self._still_held(lease)
            if state is None:
                return
            # An unreachable broker is logged once by the tick's publish.
            for report in (
                reconcile.resend_after_broker_restart(now=state.db_now, app=self.app),
                reconcile.resend_unclaimed(now=state.db_now, app=self.app),
            ):
                if report.changes:
                    self._log_reconcile(report)
        except Exception:  # housekeeping: log it, keep dispatching
            logger.exception(
                "broker check failed; trying again in %ss",
                settings.BROKER_CHECK_SECONDS,
                extra={"action": "broker_check_failed"},
            )
        finally:
            connection.close()  # this thread's own connection (Django's are per thread)

    @staticmethod
    def _still_held(lease: leases.LeaseHandle) -> leases.LeaseState | None:
        """Return the lease's state if ``lease`` still holds it (a pass that outlives it does no harm; it just does not start)."""
        state = leases.current(lease.name)
        if state.is_held and (state.holder, state.token) == (lease.holder, lease.token):
            return state
        return None

    def _log_reconcile(self, report: reconcile.ReconcileReport) -> None:
        if report.changes or report.publish_error:
            logger.info(
                "reconcile: %s%s",
                report.summary(),
                f"; {report.publish_error}" if report.publish_error else "",
                extra={"action": "reconciled", "instance_id": self.instance_id, "counts": report.counts},
            )

    def _revoke(self, task_ids: list[str]) -> None:
        """Stop executions cancelled by ``overlap=cancel_previous`` (already recorded ``cancelled``), off this tick."""
        if task_ids:
            if self._revoker is None:
                self._revoker = Revoker(self.app)
            self._revoker.revoke(task_ids)

    def _seconds_until_next_work(self, db_now: Any, *, elapsed: float, in_shards: list[int] | None = None) -> float:
        """Seconds until the next slot, renewal or loop bound, counted from now.

        ``db_now`` was read ``elapsed`` seconds ago, before this tick's work:
        without taking that off, the leader would oversleep every slot by the
        length of its own tick.
        """
        active = Schedule.objects.active()
        if in_shards is not None:
            active = active.filter(shard__in=in_shards)
        next_due = (
            active.filter(next_run_at__isnull=False)
            .order_by("next_run_at")
            .values_list("next_run_at", flat=True)
            .first()
        )
        # Scheduler.__init__ always sets max_interval; celery-types allows None.
        candidates: list[float] = [cast(float, self.max_interval), self._seconds_until_renew()]
        if next_due is not None:
            candidates.append((next_due - db_now).total_seconds() - elapsed)
        # Schedules left because their rows were locked are due still: try them soon, not in a tight loop.
        return max(min(candidates), dispatch.LOCKED_RETRY_SECONDS if self._held_back else 0.0)

    def _seconds_until_renew(self) -> float:
        if self.shards is not None:
            return self.shards.seconds_until_renew()
        return settings.LEASE_RENEW_SECONDS - (time.monotonic() - self._last_renew)

    # --- leadership -------------------------------------------------------------

    def _keep_or_seek_leadership(self) -> leases.LeaseHandle | None:
        ttl = settings.LEASE_TTL_SECONDS
        if self.lease is not None:
            if self._seconds_until_renew() <= 0:
                try:
                    self.lease = leases.renew(self.lease, ttl=ttl)
                    self._last_renew = time.monotonic()
                    self._hold_lease_lock()
                except LeaseLost:
                    leases.record_renew_failure(self.lease_name)
                    self._step_down("lost")
            if self.lease is not None:
                return self.lease

        gone, self._holder_gone = self._holder_gone, None
        if connection.vendor == "postgresql" and not self._hold_instance_lock():
            # Followers take the lease from a holder whose instance lock
            # is free: leading without ours would only be taken away.
            return None
        # ``gone``: the holder's process is gone, so take over now instead
        # of waiting for the TTL (unless someone else took over meanwhile).
        lease = leases.acquire(self.lease_name, self.instance_id, ttl=ttl, gone=gone)
        if lease is None:
            return None
        self.lease = lease
        logs.bind(token=lease.token)
        self._last_renew = time.monotonic()
        self._last_heartbeat = 0.0  # publish is_leader at once
        self._hold_lease_lock()
        logger.info(
            "leadership acquired by %s (token %s%s)",
            self.instance_id,
            lease.token,
            ", previous holder's session is gone" if gone else "",
            extra={"action": "lease_acquired", "instance_id": self.instance_id, "token": lease.token},
        )
        signals.leadership_acquired.send(sender=self.__class__, instance_id=self.instance_id, token=lease.token)
        return lease

    def _hold_instance_lock(self) -> bool:
        """PostgreSQL: take or keep this replica's instance lock; return whether held."""
        if self._instance_lock is None:
            self._instance_lock = leases.InstanceLock(self.instance_id)
        return self._instance_lock.try_acquire()

    def _hold_lease_lock(self) -> None:
        """PostgreSQL, while leading the one lease: hold the lock replicas of the old version lead by.

        Without it, a replica of the version before the instance lock, still
        running during a rolling upgrade, would find that lock free, take
        the lease by force every second, and be taken over in turn
        (``leases._lease_lock_key``).
        """
        if self._instance_lock is not None:
            self._instance_lock.hold_lease_lock(self.lease_name)

    def _drop_lease_lock(self) -> None:
        if self._instance_lock is not None:
            self._instance_lock.release_lease_lock(self.lease_name)

    def _shard_wait(self, delay: float) -> float:
        """On PostgreSQL, spend a sharded replica's sleep waiting for a change among the replicas; return what is left.

        The wait ends at once on any notification (a shard released, a replica
        joined) or when the next replica in id order is gone (its instance
        lock came free): then the others are told, and every replica takes
        its new shards on its next tick instead of a TTL later.
        """
        if self._instance_lock is None or delay <= 0:
            return delay
        watched = self.shards.watched() if self.shards is not None else None
        outcome = self._instance_lock.wait_for(watched, None, timeout=delay)
        if outcome is None:
            return delay
        if outcome is leases.Wait.GONE:
            self._instance_lock.notify(f"gone:{watched}")
        return 0.0

    def _follow_count(self) -> None:
        """Read the stored shard count (storing ``SCHEDULER_SHARDS`` if none is) and switch between one lease and shards.

        From 1 to more, the replica releases the one lease and takes its
        shards in this tick; back to 1, it releases every shard and seeks the
        one lease. The dispatch commits are fenced by the count too
        (``leases.assert_held_many``), so what it still holds under the old
        count commits nothing once the count changed.
        """
        count = shard_keeper.follow_count(self.instance_id)
        if count != self.shard_count:
            self._count_changed(self.shard_count, count)
            self.shard_count = count
        if count > 1 and self.shards is None:
            self._release_lease(f"for shards (the shard count is now {count})")
            self.shards = ShardKeeper(self.instance_id)
            self._announced = False
        elif count == 1 and self.shards is not None:
            self._leave_shards(shutdown=False)
            self.shards = None

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

    def _release_lease(self, reason: str) -> None:
        """Give the one lease up, if held, so a follower takes it at once (shutdown, or shards from now on)."""
        if self.lease is None:
            return
        token = self.lease.token
        try:
            released = leases.release(self.lease)
        except DatabaseError:
            released = False
            logger.exception("could not release the lease %s; it expires by itself", reason)
        self.lease = None
        self._drop_lease_lock()
        logs.unbind("token")
        self._last_heartbeat = 0.0
        if released:
            logger.info(
                "leadership released by %s (token %s) %s",
                self.instance_id,
                token,
                reason,
                extra={"action": "lease_released", "instance_id": self.instance_id, "token": token},
            )
        signals.leadership_lost.send(
            sender=self.__class__, instance_id=self.instance_id, token=token, reason="released"
        )

    def _leave_shards(self, *, shutdown: bool) -> None:
        """Release every held shard; on shutdown leave the live list first, so the others take them at once."""
        assert self.shards is not None
        when = "on shutdown" if shutdown else "for the one lease (shard count 1)"
        try:
            if shutdown:
                instances.remove(self.instance_id)
            released = self.shards.release_all()
        except DatabaseError:
            logger.exception("could not release the shards %s; they expire by themselves", when)
            self.shards.forget()
            return
        if released:
            logger.info(
                "shards released by %s %s: %s",
                self.instance_id,
                when,
                ", ".join(released),
                extra={"action": "shards_released", "instance_id": self.instance_id, "leases": released},
            )

    def _follower_wait(self, delay: float) -> float:
        """On PostgreSQL, spend a follower's sleep waiting for the holder to go; return what is left to sleep.

        The wait ends at once when the holder's instance lock comes free (its
        process is gone: the next tick takes the lease by ``gone``) or a
        release of the lease is notified (the next tick takes it as usual),
        and after ``delay`` otherwise, as the plain sleep would. SQLite has
        neither, so its followers just sleep.
        """
        if self.lease is not None or self._instance_lock is None or delay <= 0:
            return delay
        state = leases.current(self.lease_name)
        if not state.is_held or state.holder == self.instance_id:
            return delay
        started = time.monotonic()
        outcome = self._instance_lock.wait_for(state.holder, self.lease_name, timeout=delay)
        if outcome is None:
            return delay  # the wait could not run: sleep, and reconnect on the next tick
        if outcome is leases.Wait.GONE and leases.lease_lock_held(self.lease_name):
            # The holder has no instance lock, but someone holds the lock of
            # leading: a leader of the version before the instance lock (a
            # rolling upgrade), alive. Its lease runs out by TTL, or it
            # releases it: wait for that, as that version's followers do.
            left = max(delay - (time.monotonic() - started), 0.0)
            return left if self._instance_lock.wait_for(None, self.lease_name, timeout=left) is None else 0.0
        if outcome is leases.Wait.GONE:
            self._holder_gone = (state.holder, state.token)
        return 0.0

    def _step_down(self, reason: str) -> None:
        if self.lease is None:
            return
        token, self.lease = self.lease.token, None
        self._drop_lease_lock()
        logs.unbind("token")
        logger.warning(
            "leadership lost by %s (token %s): %s",
            self.instance_id,
            token,
            reason,
            extra={"action": "lease_lost", "instance_id": self.instance_id, "token": token},
        )
        signals.leadership_lost.send(sender=self.__class__, instance_id=self.instance_id, token=token, reason=reason)
        self._last_heartbeat = 0.0

    def _leads(self) -> bool:
        return self.lease is not None or bool(self.shards and self.shards.held)

    def _heartbeat(self) -> None:
        if time.monotonic() - self._last_heartbeat < settings.LEASE_RENEW_SECONDS:
            return
        instances.beat(self.instance_id, role=Instance.Role.BEAT, is_leader=self._leads())
        self._last_heartbeat = time.monotonic()
