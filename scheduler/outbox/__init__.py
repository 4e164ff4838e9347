"""The outbox: every execution committed ``pending`` is published to the broker at least once, then marked ``queued``.

Executions are committed first and sent after the commit, by whoever
committed them (the leader's pass, ``submit()``, an operator's run now, a
backfill, a reconcile). Whatever was committed and not sent, by a crash
or a broker outage, stays ``pending``, and the next ``publish_pending``
pass sends it, on any beat replica. A message may go out twice (a crash
between the push and the mark); the worker claims each execution once.

A broker that fails, however its client library says so, raises
``BrokerUnavailable`` here, with the library's error as its ``__cause__``:
what the broker took before it failed is marked ``queued``, the rest stays
``pending``. Callers catch that one exception, never kombu's or Redis's
(``errors_as_unavailable``, which ``scheduler.outbox.broker`` uses too).

Every connection the outbox and the beat open to the broker
(``bounded_connection``) gives up on a silent socket after
``wait_seconds()``: a broker that stopped answering (SIGSTOP, a VM pause, a
network that drops packets) still takes TCP connections from its listen
backlog, and a call without a timeout would wait for it for ever, holding
the leader's tick past its lease.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction
from kombu.exceptions import OperationalError

from scheduler import dbclock
from scheduler.conf import settings
from scheduler.exceptions import BrokerUnavailable
from scheduler.failpoints import failpoint
from scheduler.fastpath import publisher
from scheduler.owners import executions, work_rules

if TYPE_CHECKING:
    from celery import Celery
    from kombu import Connection

#: Messages pushed to the broker in one round trip (one Redis pipeline), and
#: pending rows one publishing transaction locks, sends and marks ``queued``.
PUBLISH_BATCH = 500


def publish(app: Celery, rows: list[dict[str, Any]], *, now: datetime) -> list[int]:
    """Send one message per execution row, in batches; return the ids sent.

    A row has the ``executions.MESSAGE_FIELDS`` (see ``executions.message_row``),
    and ``schedule_id`` and ``jitter`` when it belongs to a schedule with
    jitter. The messages are Celery's own, so an unmodified worker runs them
    (``publisher``: one Redis pipeline per batch, ``send_task`` on other brokers).

    A broker failure stops the sending and raises ``BrokerUnavailable``; the
    batches the broker took so far are marked ``queued`` either way, the
    rest stay ``pending`` for ``publish_pending``.
    """
    sent: list[int] = []
    try:
        with errors_as_unavailable(), connect(app) as sender:
            for start in range(0, len(rows), PUBLISH_BATCH):
                batch = rows[start : start + PUBLISH_BATCH]
                sender.send(batch, now=now)
                sent += [row["id"] for row in batch]
    finally:
        if sent:
            executions.mark_queued(sent, now=now)
    return sent


def publish_pending(app: Celery, *, limit: int | None = None) -> int:
    """Send up to ``limit`` ``pending`` executions to the broker and mark them ``queued``; return how many.

    Any beat replica may run this, followers included, beside the leader
    that commits the rows. Each batch is one short transaction that holds
    its rows locked against other publishers (``executions.pending_rows(locked=True)``)
    from before the push until they are marked ``queued``, so two publishers
    send different batches, and a row is sent twice only if a commit fails
    after its push (the worker claims it once all the same). SQLite has no
    row locks: see ``_publishing_transaction``.

    Buffered rows whose schedule went idle are released after the sending,
    not before: a due slot's message waits for no other statement, and
    what was released goes out in the same pass while the limit allows. A
    schedule's ``jitter`` delays its message by a per-slot amount
    (``policies.jitter_offset``). A broker failure stops the pass and
    raises ``BrokerUnavailable``: the batches sent before it are committed
    ``queued``, the failed one and the rest stay ``pending`` for the next
    pass; the caller decides whether to log.
    """
    limit = limit or settings.DISPATCH_BATCH_SIZE
    sent = _send_pending(app, limit)
    if executions.release_buffered() and sent < limit:
        sent += _send_pending(app, limit - sent)
    return sent


def _send_pending(app: Celery, limit: int) -> int:
    sent = 0
    with errors_as_unavailable():
        while sent < limit:
            wanted = min(PUBLISH_BATCH, limit - sent)
            with _publishing_transaction():
                batch, now = executions.pending_rows(limit=wanted, locked=True)
                if now is None:
                    break
                failpoint("publish.holding_batch")
                failpoint("publish.send")
                _kept.send(app, batch, now=now)
                failpoint("publish.before_mark_queued")
                executions.mark_queued([row["id"] for row in batch], now=now)
                failpoint("publish.after_mark_queued")
            sent += len(batch)
            if len(batch) < wanted:  # nothing more was pending: no second, empty transaction
                break
    return sent


def offer_places(app: Celery, keys: Iterable[str], *, max_age: float = work_rules.CACHE_SECONDS) -> list[int]:
    """Send the executions waiting for a place of each of ``keys`` that may run now, oldest first; return their ids.

    Called by a worker whose execution left its place, and by every reconcile
    pass (a worker that died frees its place only when reconcile marks its
    execution lost). A broker failure raises ``BrokerUnavailable``; what was
    not sent is offered again by the next pass.
    """
    limits = {limit.pk: limit.limit for limit in work_rules.limits_in_force(max_age=max_age)}
    now = dbclock.now()
    sent: list[int] = []
    for key in keys:
        rows = executions.offer_waiting(key, limits.get(work_rules.limit_id(key)), now=now)
        if rows:
            sent += publish(app, rows, now=now)
    return sent


def wait_seconds() -> float:
    """Return the longest one broker call of the beat waits for an answer: a tenth of the lease TTL (1 s by default).

    The leader's tick renews its lease; a stalled call costs it that much
    per tick at most, so it keeps its lease while the broker is silent.
    """
    return settings.LEASE_TTL_SECONDS / 10


def bounded_connection(app: Celery) -> Connection:
    """Return a new broker connection (a context manager) whose connect and socket calls wait ``wait_seconds()`` at most."""
    timeout = wait_seconds()
    return app.connection_for_write(transport_options={"socket_timeout": timeout, "socket_connect_timeout": timeout})


#: What kombu and the socket under it raise when the broker fails, whatever the transport.
FAILURES: tuple[type[BaseException], ...] = (OperationalError, OSError)


@contextmanager
def errors_as_unavailable(*transport_errors: type[BaseException]) -> Iterator[None]:
    """Raise ``BrokerUnavailable`` in place of a broker failure in the block (``FAILURES``, and ``transport_errors``).

    Its message is the original's (the driver's words), and the original is its ``__cause__``.
    """
    try:
        yield
    except (*FAILURES, *transport_errors) as exc:
        raise BrokerUnavailable(str(exc)) from exc


@contextmanager
def connect(app: Celery) -> Iterator[publisher.Publisher]:
    """Yield a ``Publisher`` on a new bounded connection; fail at once if the broker is unreachable or silent."""
    sender = _new_publisher(app)
    try:
        yield sender
    finally:
        sender.connection.release()


def _new_publisher(app: Celery) -> publisher.Publisher:
    # A publisher holds its batch's rows locked while it pushes, and the
    # leader's tick waits for its own pushes: one connection attempt, no
    # retry loop (kombu's would block the beat for many seconds per
    # outage); the rows simply stay pending.
    conn = bounded_connection(app)
    try:
        conn.ensure_connection(max_retries=0)
        return publisher.Publisher(app, conn)
    except BaseException:
        conn.release()
        raise


class _KeptPublisher(threading.local):
    """This thread's publisher, kept from one ``publish_pending`` pass to the next.

    The beat publishes every tick, and opening a broker connection cost it
    more than pushing a tick's messages: the time a due slot waits. A kept
    connection the broker dropped (a restart) is reconnected by the Redis
    client itself; after any failure the next pass opens a fresh one. A
    forked child opens its own.
    """

    def __init__(self) -> None:
        self.publisher: publisher.Publisher | None = None
        self.opened_for: tuple[int, int, str] | None = None

    def send(self, app: Celery, batch: list[dict[str, Any]], *, now: datetime) -> None:
        if self.opened_for != self._identity(app):
            self.close()
        try:
            self._open(app).send(batch, now=now)
        except BaseException:
            self.close()  # the next pass starts on a fresh connection
            raise

    def _open(self, app: Celery) -> publisher.Publisher:
        if self.publisher is None:
            self.publisher = _new_publisher(app)
            self.opened_for = self._identity(app)
        return self.publisher

    def close(self) -> None:
        sender, self.publisher = self.publisher, None
        if sender is not None and self.opened_for is not None and self.opened_for[0] == os.getpid():
            try:
                sender.connection.release()
            except Exception:  # noqa: BLE001 -- a broken connection closes as it can; a new one replaces it
                pass

    @staticmethod
    def _identity(app: Celery) -> tuple[int, int, str]:
        return os.getpid(), id(app), str(app.conf.broker_url)


_kept = _KeptPublisher()


def _publishing_transaction() -> AbstractContextManager[Any]:
    """The transaction one publishing batch runs in: a short one where rows lock, none on SQLite.

    SQLite has no row locks, and its transactions take the whole database's
    write lock when they begin (``transaction_mode`` IMMEDIATE): holding it
    across the broker push would stall every other writer, a new leader's
    takeover included, whenever a publisher is slow or frozen. There each
    statement commits by itself, and a row two publishers read at once is
    sent twice (claimed once).
    """
    return transaction.atomic() if connection.features.has_select_for_update else nullcontext()
