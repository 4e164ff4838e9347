"""The leader's housekeeping: the reconcile pass, the broker check, and the watch and notification delivery, each on a thread of its own.

Neither delays a tick or a lease renewal by more than a bounded broker call
(the first broker check under a new lease runs on the tick's thread, see
``Housekeeping.start_broker_check``), and a long reconcile pass never delays
the re-send of what the broker lost: each runs on its own thread and its
own database connection, at most one of each at a time, and
only starts while the lease it was started under is still held. Both repair
with conditional updates that an operator's ``manage.py reconcile`` may run
concurrently too, so a pass that outlives the lease does no harm.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.db import connection

from scheduler.conf import settings
from scheduler.ops import reconcile, watch
from scheduler.outbox import notifications as outbox_notifications
from scheduler.owners import leases

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)


class Housekeeping:
    """One beat replica's reconcile pass and broker check, started by its ticks while it leads."""

    def __init__(self, app: Celery, instance_id: str) -> None:
        self.app = app
        self.instance_id = instance_id
        #: The thread of the last reconcile pass, and of the last broker check (``None`` before the first).
        self.reconciler: threading.Thread | None = None
        self.broker_checker: threading.Thread | None = None
        self.notifier: threading.Thread | None = None
        #: Runs on the notifier's thread, one pass at a time.
        self.watch = watch.LeaderWatch()
        self._last_notify = 0.0  # monotonic
        self.last_reconcile = time.monotonic()  # the first pass runs one interval after start
        self._last_broker_check = 0.0  # monotonic
        #: (name, token) of the lease the last broker check ran under: the first check under another runs at once.
        self._broker_checked_under: tuple[str, int] | None = None

    def before_publish(self, lease: leases.LeaseHandle) -> None:
        """Under a lease just taken, check the broker now, before the lease's first publish (``start_broker_check``)."""
        if (lease.name, lease.token) != self._broker_checked_under:
            self.start_broker_check(lease)

    def start_due(self, lease: leases.LeaseHandle) -> None:
        """Start, under ``lease``, the broker check, the reconcile pass and the notification delivery that are due.

        Called after the tick's publish: a thread started now would share the
        tick's interpreter and database while the due messages wait.
        """
        self.start_broker_check(lease)
        self.start_reconcile(lease)
        self.start_notify(lease)

    def start_notify(self, lease: leases.LeaseHandle) -> None:
        """Deliver the notifications due every ``NOTIFY_INTERVAL_SECONDS``, in a thread of its own, one pass at a time.

        Its own thread: a slow webhook never holds a tick, and a delivery
        runs outside any transaction.
        """
        interval = settings.NOTIFY_INTERVAL_SECONDS
        started = time.monotonic()
        if not interval or started - self._last_notify < interval:
            return
        if self.notifier is not None and self.notifier.is_alive():
            return
        self._last_notify = started
        self.notifier = _thread("scheduler-notify", self._notify, lease)

    def start_reconcile(self, lease: leases.LeaseHandle) -> None:
        """Start a reconcile pass every ``RECONCILE_INTERVAL_SECONDS``, in its own thread, one at a time."""
        interval = settings.RECONCILE_INTERVAL_SECONDS
        started = time.monotonic()
        if not interval or started - self.last_reconcile < interval:
            return
        if self.reconciler is not None and self.reconciler.is_alive():
            return  # the last pass is still running; never two at once
        self.last_reconcile = started
        self.reconciler = _thread("scheduler-reconcile", self._reconcile, lease)

    def start_broker_check(self, lease: leases.LeaseHandle) -> None:
        """Ask the broker every ``BROKER_CHECK_SECONDS`` whether it lost messages, in a thread of its own, one at a time.

        Not on the reconcile thread: a broker restart is repaired within
        seconds however long a reconcile pass takes. The first check under
        a lease just taken (a new token) runs at once, on the caller's
        thread, before the lease's first publish: a broker that restarted
        while nobody led is repaired now, not a check later, and what this
        leader sends afterwards is not taken for lost with it. (A second
        copy of a running execution's message hides the first from Celery's
        revoke: a worker tracks one request per task id, so a cancelled body
        would run on.) Its broker calls are bounded (``outbox.wait_seconds``).
        """
        check = settings.BROKER_CHECK_SECONDS
        started = time.monotonic()
        under = (lease.name, lease.token)
        if not check or (under == self._broker_checked_under and started - self._last_broker_check < check):
            return
        if self.broker_checker is not None and self.broker_checker.is_alive():
            return
        first = under != self._broker_checked_under
        self._last_broker_check, self._broker_checked_under = started, under
        if first:
            self._check_broker(lease, on_own_thread=False)
        else:
            self.broker_checker = _thread("scheduler-broker-check", self._check_broker, lease)

    def _reconcile(self, lease: leases.LeaseHandle) -> None:
        """A reconcile pass while ``lease`` is held; a failing pass is logged and the next one runs an interval later."""
        try:
            state = _still_held(lease)
            if state is not None:
                self._log(reconcile.reconcile(now=state.db_now, app=self.app))
        except Exception:  # reconcile is housekeeping: log it, keep dispatching
            logger.exception(
                "reconcile failed; trying again in %ss",
                settings.RECONCILE_INTERVAL_SECONDS,
                extra={"action": "reconcile_failed"},
            )
        finally:
            connection.close()  # this thread's own connection (Django's are per thread)

    def _check_broker(self, lease: leases.LeaseHandle, *, on_own_thread: bool = True) -> None:
        """Send again what the broker lost, or what waited unclaimed too long, while ``lease`` is held.

        Every ``queued`` execution sent before a check that finds a broker
        run nobody confirmed is sent again, including those this leader
        sent itself since it took the lease: the broker may have restarted
        after they went out, and a copy it did keep is claimed once.
        """
        try:
            state = _still_held(lease)
            if state is None:
                return
            # An unreachable broker is logged once by the tick's publish.
            for report in (
                reconcile.resend_after_broker_restart(now=state.db_now, app=self.app),
                reconcile.resend_unclaimed(now=state.db_now, app=self.app),
            ):
                if report.changes:
                    self._log(report)
        except Exception:  # housekeeping: log it, keep dispatching
            logger.exception(
                "broker check failed; trying again in %ss",
                settings.BROKER_CHECK_SECONDS,
                extra={"action": "broker_check_failed"},
            )
        finally:
            if on_own_thread:
                connection.close()  # this thread's own connection (Django's are per thread)

    def _notify(self, lease: leases.LeaseHandle) -> None:
        try:
            if _still_held(lease) is not None:
                self.watch.run()
                outbox_notifications.deliver_due()
        except Exception:  # housekeeping: log it, keep dispatching
            logger.exception("notification delivery failed", extra={"action": "notify_failed"})
        finally:
            connection.close()  # this thread's own connection (Django's are per thread)

    def _log(self, report: reconcile.ReconcileReport) -> None:
        if report.changes or report.publish_error:
            logger.info(
                "reconcile: %s%s",
                report.summary(),
                f"; {report.publish_error}" if report.publish_error else "",
                extra={"action": "reconciled", "instance_id": self.instance_id, "counts": report.counts},
            )


def _thread(name: str, target: Callable[[leases.LeaseHandle], None], lease: leases.LeaseHandle) -> threading.Thread:
    # The copied context carries the bound log fields (instance id, token) into the thread.
    thread = threading.Thread(target=contextvars.copy_context().run, args=(target, lease), name=name, daemon=True)
    thread.start()
    return thread


def _still_held(lease: leases.LeaseHandle) -> leases.LeaseState | None:
    """Return the lease's state if ``lease`` still holds it (a pass that outlives it does no harm; it just does not start)."""
    state = leases.current(lease.name)
    if state.is_held and (state.holder, state.token) == (lease.holder, lease.token):
        return state
    return None
