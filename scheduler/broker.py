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
reconcile's ``RECONCILE_QUEUED_AFTER_SECONDS`` re-send still covers it.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kombu.exceptions import OperationalError

from scheduler.exceptions import BrokerUnavailable
from scheduler.failpoints import failpoint

if TYPE_CHECKING:
    from celery import Celery

#: Key in the broker's database holding the ``run_id`` whose messages the leader has accounted for.
MARKER_KEY = "scheduler:broker-run-id"


@contextmanager
def _redis(app: Celery) -> Iterator[Any | None]:
    """Yield the broker's Redis client (``None`` for another broker); wrap its errors in ``BrokerUnavailable``."""
    with app.connection_for_write() as conn:
        try:
            # One attempt: the caller tries again at its next check.
            conn.ensure_connection(max_retries=0)
            yield conn.default_channel.client if conn.transport.driver_type == "redis" else None
        except (OperationalError, OSError, *conn.connection_errors, *conn.channel_errors) as exc:
            raise BrokerUnavailable(f"broker unreachable: {exc}") from exc


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
