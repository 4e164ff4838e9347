"""Broker identity: tell whether the broker may have lost its messages since the leader last looked.

A Redis broker restarted without its data (or flushed) has lost every
message it held: the queues, and the unacknowledged ones that workers had
prefetched or were keeping for a later ETA. Nothing in the database says
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

Every connection the beat opens to the broker (``bounded_connection``)
gives up on a silent socket after ``wait_seconds()``: a broker that stopped
answering (SIGSTOP, a VM pause, a network that drops packets) still takes
TCP connections from its listen backlog, and a call without a timeout
would wait for it for ever, holding the leader's tick past its lease.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kombu.exceptions import OperationalError

from scheduler.conf import settings
from scheduler.exceptions import BrokerUnavailable
from scheduler.failpoints import failpoint

if TYPE_CHECKING:
    from celery import Celery
    from kombu import Connection

#: Key in the broker's database holding the ``run_id`` whose messages the leader has accounted for.
MARKER_KEY = "scheduler:broker-run-id"


def wait_seconds() -> float:
    """Return the longest one broker call of the beat waits for an answer: a tenth of the lease TTL (1 s by default).

    The leader's tick renews its lease; a stalled call costs it that much
    per tick at most, so it keeps its lease while the broker is silent.
    """
    return settings.LEASE_TTL_SECONDS / 10


@contextmanager
def bounded_connection(app: Celery) -> Iterator[Connection]:
    """Yield a new broker connection whose connect and every socket read and write wait at most ``wait_seconds()``."""
    timeout = wait_seconds()
    with app.connection_for_write(
        transport_options={"socket_timeout": timeout, "socket_connect_timeout": timeout}
    ) as conn:
        yield conn


@contextmanager
def _redis_channel(app: Celery) -> Iterator[Any | None]:
    """Yield the broker's Redis channel (``None`` for another broker); wrap its errors in ``BrokerUnavailable``."""
    with bounded_connection(app) as conn:
        errors: tuple[type[BaseException], ...] = (
            OperationalError,
            OSError,
            *conn.connection_errors,
            *conn.channel_errors,
        )
        try:
            # One attempt: the caller tries again at its next check.
            conn.ensure_connection(max_retries=0)
            yield conn.default_channel if conn.transport.driver_type == "redis" else None
        except errors as exc:
            raise BrokerUnavailable(f"broker unreachable: {exc}") from exc


@contextmanager
def _redis(app: Celery) -> Iterator[Any | None]:
    """Yield the broker's Redis client (``None`` for another broker); wrap its errors in ``BrokerUnavailable``."""
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
