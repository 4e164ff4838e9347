"""A worker's heartbeat: written only after a probe sent through the broker came back through its consumer.

A worker process can stay up and consume nothing: its broker went away
(Celery retries the connection for a long time), its consumer came back
deaf after a connection reset (celery/celery#8030, #10205), or a connection
went silent and waits for a reply that never comes. A thread that writes
the heartbeat on its own keeps writing through all of that, so a
healthcheck reading it cannot tell. Here the heartbeat thread, once every
``CLAIM_RENEW_SECONDS``, publishes a tiny message to a queue only this
process consumes, and writes ``Instance.last_seen`` only once the worker's
consumer received it: the message reached the broker, and the consumer's
event loop took it off again and ran its callback. ``manage.py alive --role
worker`` reads that. The cost per interval is one publish, one delivery and
one database write, plus, on Redis, one more connection whose idle BRPOP
returns every second.

The probe queue is consumed by a Celery consumer bootstep
(``ProbeConsumer``, added to the worker in ``project/celery.py``) on a
channel of its own, on the consumer's connection and event loop. Not on the
task consumer's channel: with late acknowledgement a busy worker's prefetch
window is full, and kombu's Redis transport then stops polling that channel
(``QoS.can_consume``), so a probe there would call every busy worker deaf.
What makes a consumer deaf belongs to the connection or the loop, not to
one channel (a reconnect that left the poller without its sockets,
celery/kombu#2007; a silent socket; a loop that stopped turning), so this
channel goes deaf with the task consumer's. A timer in the event loop
alone would not do: the loop keeps turning when no socket delivers. With
the ``solo`` pool the loop waits for each task, so such a worker is
reported deaf while a task runs longer than the check's window.

The queue is named after the process and a random token, so a process
never takes a probe of an earlier one with the same pid (a container's
pid 1). At most one probe waits in it: a probe that did not come back is
purged before the next is sent, so a deaf worker's queue does not grow,
and the queue is deleted when the worker stops. It has no ``x-expires``:
on Redis that makes the consumer's event loop refresh and sweep binding
tables with blocking calls, and a call on a silent socket would freeze the
loop for good instead of letting kombu's BRPOP health check reconnect.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from celery import bootsteps
from django.db import DatabaseError, close_old_connections
from kombu import Consumer, Exchange, Queue
from kombu.exceptions import KombuError

from scheduler import process_ids
from scheduler.conf import settings
from scheduler.models import Instance
from scheduler.owners import instances

if TYPE_CHECKING:
    from celery import Celery
    from kombu import Connection, Message
    from kombu.transport.base import StdChannel

logger = logging.getLogger(__name__)

#: Longest a probe's publish may wait on the broker's socket.
PUBLISH_TIMEOUT_SECONDS = 5.0
#: Distinguishes this process's probe queue from one of an earlier process with the same pid.
_TOKEN = uuid.uuid4().hex[:12]


def instance_id(nodename: str) -> str:
    """Return this worker process's id in the instance registry."""
    return process_ids.process_id(nodename or None)


def probe_queue(nodename: str) -> Queue:
    """Return this process's probe queue: routed by name (the default exchange), so no binding is declared."""
    name = f"scheduler.probe.{instance_id(nodename)}.{_TOKEN}"
    return Queue(name, exchange=Exchange(""), routing_key=name, durable=False)


class _Echoes:
    """The highest probe number this process's consumer has received."""

    def __init__(self) -> None:
        self._received = 0
        self._changed = threading.Condition()

    def received(self, number: int) -> None:
        with self._changed:
            if number > self._received:
                self._received = number
                self._changed.notify_all()

    def wait_for(self, number: int, timeout: float, stopping: threading.Event) -> bool:
        """Wait up to ``timeout`` seconds for probe ``number`` (or a later one); return whether it came."""
        with self._changed:
            self._changed.wait_for(lambda: self._received >= number or stopping.is_set(), timeout)
            return self._received >= number

    def wake(self) -> None:
        """Wake every waiter to look at its ``stopping`` event."""
        with self._changed:
            self._changed.notify_all()


_echoes = _Echoes()


class ProbeConsumer(bootsteps.ConsumerStep):
    """Consume this worker's probe queue on a channel of the worker's consumer connection."""

    name = "scheduler.probe"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.nodename = str(getattr(c, "hostname", "") or "")
        super().__init__(c, **kwargs)

    def get_consumers(self, channel: StdChannel) -> list[Consumer]:
        queue = probe_queue(self.nodename)
        return [Consumer(channel, queues=[queue], callbacks=[_on_probe], no_ack=True, accept=["json"])]


def _on_probe(body: Any, message: Message) -> None:
    # Runs in the consumer's event loop: no I/O here, the heartbeat thread writes.
    number = body.get("probe") if isinstance(body, dict) else None
    if isinstance(number, int) and not isinstance(number, bool):
        _echoes.received(number)


class Heartbeat(threading.Thread):
    """Probe the broker round trip every ``CLAIM_RENEW_SECONDS``; write the heartbeat when the probe came back."""

    def __init__(self, app: Celery, nodename: str) -> None:
        super().__init__(name="worker-heartbeat", daemon=True)
        self.app = app
        self.instance_id = instance_id(nodename)
        self.queue = probe_queue(nodename)
        self.stopping = threading.Event()
        self._connection: Connection | None = None
        self._deaf_since: float | None = None

    def run(self) -> None:
        number, came_back = 0, True
        try:
            while True:
                started = time.monotonic()
                interval = settings.CLAIM_RENEW_SECONDS
                number += 1
                error = self._publish(number, purge=not came_back)
                came_back = error is None and _echoes.wait_for(number, interval, self.stopping)
                if self.stopping.is_set():
                    return
                if came_back:
                    self._beat()
                else:
                    self._not_back(error or f"not consumed within {interval:g}s")
                if self.stopping.wait(max(interval - (time.monotonic() - started), 0.0)):
                    return
        finally:
            self._delete_queue()

    def stop(self, timeout: float) -> None:
        """Stop probing; wait up to ``timeout`` seconds for a heartbeat write in progress."""
        self.stopping.set()
        _echoes.wake()
        if self.is_alive():
            self.join(timeout)

    def _publish(self, number: int, *, purge: bool) -> str | None:
        """Send probe ``number`` to this process's queue (emptied first if ``purge``); return why not, or None."""
        try:
            if self._connection is None:
                # No retries here: the next probe is the retry. Timeouts keep a
                # silent socket from holding the thread past its interval.
                timeout = PUBLISH_TIMEOUT_SECONDS
                self._connection = self.app.connection_for_write(
                    transport_options={"socket_timeout": timeout, "socket_connect_timeout": timeout}
                )
                self._connection.ensure_connection(max_retries=0)
            channel = self._connection.default_channel
            if purge:
                self.queue(channel).purge()
            producer = self._connection.Producer(channel, serializer="json")
            producer.publish(
                {"probe": number}, exchange="", routing_key=self.queue.name, declare=[self.queue], retry=False
            )
            return None
        except self._caught() as exc:
            self._drop_connection()
            return f"{type(exc).__name__}: {exc}"

    def _delete_queue(self) -> None:
        """Delete this process's probe queue on the way out, if the broker answers at once."""
        if self._connection is not None:
            try:
                queue = self.queue(self._connection.default_channel)
                queue.purge()  # on Redis this deletes the list; delete() there only drops bindings
                queue.delete()
            except self._caught():
                logger.debug("could not delete the probe queue %s", self.queue.name, exc_info=True)
        self._drop_connection()

    def _caught(self) -> tuple[type[BaseException], ...]:
        """The errors a probe expects: kombu's, the socket's, and the transport's own."""
        return (KombuError, OSError, *self._errors())

    def _errors(self) -> tuple[type[BaseException], ...]:
        if self._connection is None:
            return ()
        return (*self._connection.connection_errors, *self._connection.channel_errors)

    def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.release()
            except Exception:  # a broken connection may fail in any way while closing
                logger.debug("closing the probe connection failed", exc_info=True)

    def _not_back(self, reason: str) -> None:
        if self._deaf_since is None:
            self._deaf_since = time.monotonic()
            logger.warning(
                "worker probe did not come back through the broker (%s); no heartbeat until it does",
                reason,
                extra={"action": "worker_probe_failed", "instance_id": self.instance_id},
            )

    def _beat(self) -> None:
        """Write ``last_seen`` (the database's clock): this worker just consumed its probe."""
        try:
            instances.beat(self.instance_id, role=Instance.Role.WORKER)
        except DatabaseError:
            logger.warning("could not write the worker heartbeat; trying again", exc_info=True)
            close_old_connections()
            return
        if self._deaf_since is not None:
            logger.warning(
                "worker probe came back through the broker again after %.0fs",
                time.monotonic() - self._deaf_since,
                extra={"action": "worker_probe_recovered", "instance_id": self.instance_id},
            )
            self._deaf_since = None
