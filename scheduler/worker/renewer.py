"""The claim renewer of a worker process: a body runs only while its claim holds.

It keeps alive the claims of what its process runs, and stops a body as
soon as it learns that its claim moved on (another worker took the
execution over, an operator or ``cancel_previous`` cancelled it, reconcile
marked it lost), or once the claim could not be confirmed for as long as
it lasts (the database unreachable, the process paused past it).

Stopping a body records nothing; whoever holds the execution now records
its outcome. In a prefork pool child (Celery's default pool) the child
exits at once, whatever the body is doing (``exit_on_loss``): the worker's
main process sees ``WorkerLostError``, finds no claim held under that
child's identity (``GuardedRequest``), so writes nothing, and the message
Celery requeues is refused by the claim as a duplicate. The ``solo`` and
``threads`` pools run other work in the same process, so there the body's
thread gets ``ClaimLost`` raised in it instead. Python delivers that only
when the thread next runs Python code: not during a blocking C call or a
``time.sleep()`` (it arrives when that returns), and a body that catches
``Exception`` and goes on swallows it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from django.db import DEFAULT_DB_ALIAS, DatabaseError, close_old_connections, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from scheduler import session_limits
from scheduler.conf import settings
from scheduler.exceptions import ClaimLost
from scheduler.failpoints import failpoint
from scheduler.owners import executions
from scheduler.owners.executions import Claim

logger = logging.getLogger(__name__)

#: How often the watch thread looks at the clock: a pause is noticed this soon after the process resumes.
TICK_SECONDS = 0.2
#: A tick this much later than planned means the process was paused.
PAUSE_SECONDS = 0.3
#: After a pause, how long the database gets to confirm a claim whose deadline passed before its body is stopped.
VERIFY_SECONDS = 0.5
#: Exit status of a pool child that stopped its body because its claim was lost (``EX_SOFTWARE``).
EXIT_STATUS = 70
#: After a renewal that found the database busy, how soon it is tried again.
BUSY_RETRY_SECONDS = 0.2
#: How often the claims are renewed while a body is inside a transaction (at most ``CLAIM_RENEW_SECONDS``).
IN_TRANSACTION_RENEW_SECONDS = 1.0

_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def _now() -> float:
    return time.clock_gettime(_CLOCK)


@dataclass
class _Hold:
    """What the renewer knows of one claim it holds (times on ``_CLOCK``)."""

    #: The thread running the body (``threading.get_ident()``).
    thread: int
    #: When the last confirmed renewal (or the claim itself) was sent.
    confirmed_at: float
    #: The claim surely holds until then: the database set it to expire no earlier.
    deadline: float
    #: The execution's hard time limit, until which its claim lasts anyway (0: none).
    limit: float
    #: The body thread's database connection (read, never used, by the renew thread).
    session: BaseDatabaseWrapper | None = None

    def body_session(self) -> int | None:
        """The backend pid of the body's PostgreSQL session while it is inside a transaction, else ``None``."""
        session = self.session
        raw = getattr(session, "connection", None)
        if session is None or raw is None or session.vendor != "postgresql" or not session.in_atomic_block:
            return None
        try:
            return int(raw.info.backend_pid)
        except Exception:  # noqa: BLE001 -- a connection closing meanwhile: then it holds nothing
            return None


class ClaimRenewer:
    """Renews the claims of one worker process and stops the bodies of those it lost.

    Two threads (started on first use, again after a fork):

    - The *renew* thread talks to the database. Asked to renew, it extends
      every claim the process holds in one short transaction. A claim it
      could not extend has moved on, and its body is stopped at once; or
      another transaction holds its row or the database, and the claim
      stands as it was. A renewal that only found the database busy
      (SQLite's write lock held past the busy timeout, a PostgreSQL row or
      lock another transaction holds) is tried again every
      ``BUSY_RETRY_SECONDS``, for as long as the claims last. A claim whose
      row its own body's transaction holds (a ``checkpoint()`` inside the
      body's ``atomic()``, PostgreSQL) counts as renewed: nobody can move it
      on before that transaction ends, and while a body is inside a
      transaction its claims are renewed every ``IN_TRANSACTION_RENEW_SECONDS``.
    - The *watch* thread keeps time and never touches the database, so a
      database call that hangs cannot hold it up. It asks for a renewal
      every ``SCHEDULER_CLAIM_RENEW_SECONDS``, and it stops a body whose
      claim the renew thread could not confirm before the claim's local
      deadline (``SCHEDULER_CLAIM_SECONDS`` after the last confirmed
      renewal was sent, or the execution's hard time limit if later).

    A pause of the whole process (SIGSTOP/SIGCONT, a frozen cgroup, a VM
    pause, a suspended host) shows as a jump of the clock between two ticks
    of the watch thread (every ``TICK_SECONDS``): it asks for a renewal at
    once and gives the database ``VERIFY_SECONDS`` to confirm each claim
    whose local deadline passed during the pause. The clock is
    ``CLOCK_BOOTTIME`` (Linux), which runs through a stopped process and a
    system suspend; where it is missing, ``CLOCK_MONOTONIC``, which stops
    during a system suspend.
    """

    def __init__(self) -> None:
        self._held: dict[Claim, _Hold] = {}
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._renew_due = threading.Event()
        #: When the watch thread last asked for a renewal.
        self._asked_at = 0.0
        #: Stop a body by exiting the process (a prefork pool child) rather than raising in its thread.
        self.exit_on_loss = False
        #: Since when (``_CLOCK``) every renewal found the database busy (0: the last one did not).
        self._busy_since = 0.0

    @staticmethod
    def now() -> float:
        """The renewer's clock: take it before claiming, for ``hold(since=...)``."""
        return _now()

    def hold(self, claim: Claim, *, since: float, timeout: float | None) -> None:
        """Keep ``claim`` (made after ``since``, by the calling thread) renewed until ``drop``."""
        claim_seconds = settings.CLAIM_SECONDS
        limit = since + timeout + settings.TIMEOUT_GRACE_SECONDS if timeout else 0.0
        with self._lock:
            if self._pid != os.getpid():  # first use in this (possibly forked) process
                self._held.clear()
                self._pid = os.getpid()
                self._renew_due = threading.Event()
                threading.Thread(target=self._renew_loop, name="claim-renewer", daemon=True).start()
                threading.Thread(target=self._watch_loop, name="claim-watch", daemon=True).start()
            self._held[claim] = _Hold(
                threading.get_ident(), since, max(since + claim_seconds, limit), limit, connections[DEFAULT_DB_ALIAS]
            )

    def confirm(self, claim: Claim) -> bool:
        """Before its body starts: whether ``claim`` (held by ``hold``) still holds.

        Free when the claim is young. A process paused between its claim and
        its body (a VM pause right after the claim's commit) resumes with the
        claim older than half its length, maybe expired and taken over: then
        the database is asked, in this thread, before the body runs. The
        watch thread would stop the body too, but only after a tick and a
        round trip, which a short body outruns.
        """
        with self._lock:
            hold = self._held.get(claim)
        if hold is None:
            return False
        if _now() - hold.confirmed_at < settings.CLAIM_SECONDS / 2:
            return True
        sent = _now()
        try:
            renewed = executions.renew([claim], seconds=settings.CLAIM_SECONDS)
        except DatabaseError:
            logger.warning("could not confirm the claim on execution %s", claim.execution_id, exc_info=True)
            close_old_connections()
            return False
        if claim not in renewed:
            return False
        with self._lock:
            hold.confirmed_at = sent
            hold.deadline = max(sent + settings.CLAIM_SECONDS, hold.limit)
        return True

    def drop(self, claim: Claim) -> None:
        """Stop renewing ``claim``: its holder is about to write its outcome, or gave it up."""
        with self._lock:
            self._held.pop(claim, None)

    # --- the renew thread --------------------------------------------------------------

    def _renew_loop(self) -> None:
        again: float | None = None
        while True:
            self._renew_due.wait(again)  # asked by the watch thread, or ``again`` seconds on
            self._renew_due.clear()
            try:
                again = self._renew()
            except Exception:  # the thread must outlive anything one renewal does
                logger.exception("claim renewal failed; trying again")
                again = None

    def _renew(self) -> float | None:
        """Renew the claims held; return how soon to renew again without being asked (``None``: when asked)."""
        with self._lock:
            held = dict(self._held)
        if not held:
            return None
        bodies = {claim: pid for claim, hold in held.items() if (pid := hold.body_session()) is not None}
        sent = _now()
        try:
            failpoint("worker.renew")
            renewed = executions.renew(held, seconds=settings.CLAIM_SECONDS, bodies=bodies)
            lost = executions.moved_on(held.keys() - renewed) if len(renewed) < len(held) else set()
            # Neither renewed nor lost: running, its row locked by another transaction; or just ended by its holder.
            unsettled = held.keys() - renewed - lost
            busy = executions.still_running(unsettled) if unsettled else set()
        except DatabaseError as exc:
            ids = sorted(claim.execution_id for claim in held)
            if session_limits.lock_wait_ended(exc):
                self._busy(ids, sent)
                return BUSY_RETRY_SECONDS
            logger.warning("could not renew the claims on executions %s; trying again", ids, exc_info=True)
            close_old_connections()  # a broken connection is replaced on the next try
            return None
        with self._lock:
            for claim in held.keys() - lost - busy:
                hold = self._held.get(claim)
                if hold is not None:
                    hold.confirmed_at = sent
                    hold.deadline = max(sent + settings.CLAIM_SECONDS, hold.limit)
        self._stop(lost, "its claim moved on (taken over, cancelled or marked lost)")
        if busy:  # their claims stand as they were, not confirmed: try again soon
            self._busy(sorted(claim.execution_id for claim in busy), sent)
            return BUSY_RETRY_SECONDS
        if self._busy_since:
            logger.info("claims renewed again after %.1fs of a busy database", sent - self._busy_since)
            self._busy_since = 0.0
        if bodies:
            return min(IN_TRANSACTION_RENEW_SECONDS, settings.CLAIM_RENEW_SECONDS)
        return None

    def _busy(self, ids: list[int], sent: float) -> None:
        """Note a renewal that found the database busy: logged once per busy spell; the claims stand until they run out."""
        if not self._busy_since:
            self._busy_since = sent
            logger.warning(
                "could not renew the claims on executions %s yet: another transaction holds the database or their rows; "
                "trying again every %ss while the claims last",
                ids,
                BUSY_RETRY_SECONDS,
                extra={"action": "claim_renew_busy"},
            )

    # --- the watch thread -------------------------------------------------------------

    def _watch_loop(self) -> None:
        ticker = threading.Event()  # never set: a sleep on the monotonic clock
        last = _now()
        renew_at = last + settings.CLAIM_RENEW_SECONDS
        verify_until = 0.0
        while True:
            ticker.wait(TICK_SECONDS)
            now = _now()
            if now - last > TICK_SECONDS + PAUSE_SECONDS:
                # The process was paused: let the database say at once whether its claims still hold.
                logger.warning("claim renewer: the process was paused for %.1fs; checking its claims", now - last)
                renew_at, verify_until = now, now + VERIFY_SECONDS
            last = now
            if now >= renew_at:
                renew_at = now + settings.CLAIM_RENEW_SECONDS
                self._asked_at = now
                self._renew_due.set()
            if now >= verify_until:
                self._stop(self._unconfirmed(now), "its claim could not be confirmed before it ran out")

    def _unconfirmed(self, now: float) -> set[Claim]:
        """Claims past their deadline although a renewal was asked for after their last confirmation."""
        with self._lock:
            return {
                claim
                for claim, hold in self._held.items()
                if hold.deadline <= now and self._asked_at > hold.confirmed_at
            }

    # --- stopping a body --------------------------------------------------------------

    def _stop(self, claims: Iterable[Claim], reason: str) -> None:
        with self._lock:  # a body dropping its claim (to write its outcome) waits for this
            stopping = {claim: self._held.pop(claim) for claim in claims if claim in self._held}
            for claim in stopping:
                logger.error(
                    "execution %s attempt %s: %s; stopping its body, recording nothing",
                    claim.execution_id,
                    claim.attempt,
                    reason,
                    extra={"action": "claim_lost_stopped", "execution_id": claim.execution_id},
                )
            if stopping and self.exit_on_loss:
                os._exit(EXIT_STATUS)
            for hold in stopping.values():
                _raise_in(hold.thread, ClaimLost)


def _raise_in(thread: int, error: type[BaseException]) -> None:
    """Raise ``error`` in the thread ``thread`` when it next runs Python code."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(error))
