"""The broker beyond publishing: its identity, its queues' depth, revokes; each failure is ``BrokerUnavailable``.

Their broker failures leave as ``BrokerUnavailable``, at the outbox's edge
(``scheduler.outbox.errors_as_unavailable``).

The broker's identity tells whether it may have lost its messages since
the leader last looked. A Redis broker restarted without its data (or
flushed) has lost every message it held: the queues, and the
unacknowledged ones that workers had prefetched or were keeping for a
later ETA. Nothing in the database says
so; the broker's own ``run_id`` (``INFO server``) does. The leader keeps a
marker key in the broker holding the ``run_id`` it last confirmed after
re-sending what was lost. A missing marker (an empty or flushed broker) or
one from another run (a restart from an old snapshot) means messages sent
before now may be gone; an unchanged one means every message sent is still
there, however long the queue. The marker lives in the broker, so a new
leader knows what its predecessor confirmed.

A broker that is not Redis is never reported as having lost messages;
the re-send of what waited unclaimed past ``RECONCILE_QUEUED_AFTER_SECONDS``
still covers it. On Redis that re-send leaves alone a queue that still
holds messages (``queues_holding_messages``): what waits behind them is
most likely there too.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from scheduler.failpoints import failpoint
from scheduler.outbox import bounded_connection, errors_as_unavailable

if TYPE_CHECKING:
    from celery import Celery

#: Key in the broker's database holding the ``run_id`` whose messages the leader has accounted for.
MARKER_KEY = "scheduler:broker-run-id"


@contextmanager
def _redis_channel(app: Celery) -> Iterator[Any | None]:
    """Yield the broker's Redis channel (``None`` for another broker); raise ``BrokerUnavailable`` if the broker fails."""
    with bounded_connection(app) as conn, errors_as_unavailable(*conn.connection_errors, *conn.channel_errors):
        # One attempt: the caller tries again at its next check.
        conn.ensure_connection(max_retries=0)
        yield conn.default_channel if conn.transport.driver_type == "redis" else None


@contextmanager
def _redis(app: Celery) -> Iterator[Any | None]:
    """Yield the broker's Redis client (``None`` for another broker); raise ``BrokerUnavailable`` if the broker fails."""
    with _redis_channel(app) as channel:
        yield None if channel is None else channel.client


def unconfirmed_run(app: Celery) -> str | None:
    """Return the broker's ``run_id`` if messages sent before now may be lost from it, else ``None``."""
    with _redis(app) as client:
        failpoint("broker.check")
        if client is None:
            return None
        run_id = client.info("server")["run_id"]
        marker = client.get(MARKER_KEY)
        return None if marker is not None and marker.decode() == run_id else run_id


def confirm_run(app: Celery, run_id: str) -> None:
    """Record that every message lost before broker run ``run_id`` has been sent again."""
    with _redis(app) as client:
        if client is not None:
            # Written even if the broker restarted again in between: the
            # marker then names an old run, and the next check catches it.
            client.set(MARKER_KEY, run_id)


def queues_holding_messages(app: Celery, queues: Collection[str]) -> set[str] | None:
    """Return which of ``queues`` hold messages waiting in the broker now; ``None`` for a broker that is not Redis.

    Counts the messages in a queue's lists (one per priority step, as
    kombu files them), not the ones workers took and have not acknowledged.
    """
    with _redis_channel(app) as channel:
        if channel is None:
            return None
        names = sorted(set(queues))
        with channel.client.pipeline(transaction=False) as pipe:
            for name in names:
                for step in channel.priority_steps:
                    pipe.llen(channel._q_for_pri(name, step))
            lengths = pipe.execute()
        steps = len(channel.priority_steps)
        return {name for index, name in enumerate(names) if any(lengths[index * steps : (index + 1) * steps])}


def revoke(app: Celery, task_ids: str | list[str], *, once: bool = False) -> None:
    """Revoke the tasks ``task_ids`` (one id or several), terminating them where they run.

    Raises ``BrokerUnavailable`` if the broker fails.

    ``once``: a single connection attempt, for an operator waiting on the
    answer. Otherwise Celery retries until the broker takes the message,
    for as long as it is silent: the beat calls this from its own thread
    (``revoker``), never on its tick.
    """
    with errors_as_unavailable():
        if not once:
            app.control.revoke(task_ids, terminate=True)
            return
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=0)
            app.control.revoke(task_ids, terminate=True, connection=conn)
