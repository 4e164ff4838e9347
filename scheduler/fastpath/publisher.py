"""Send execution messages: Celery's own messages, pushed to Redis in one pipeline per batch.

``send_task`` costs most of a publishing pass: per message it looks up
configuration, routes, merges options, sends signals and goes through
kombu's producer. Here a pass routes each distinct (task, queue, priority)
once, builds every message with the same Celery and kombu code that
``send_task`` runs (``app.amqp.as_task_v2``, the producer's serialiser,
the Redis channel's ``prepare_message``, envelope and priority list name)
and pushes a batch with one LPUSH per list in one pipeline. An unmodified
``celery worker`` cannot tell the messages apart (protocol 2, headers, ETA,
time limits, priority, queue); ``tests/integration/test_fastpath_publisher.py``
compares them with ``send_task``'s field for field, less the random delivery tag.

Celery's ``before_task_publish`` and ``after_task_publish`` signals are
sent only when something listens to them (the fast path skips them
otherwise, which is most of their cost); ``task-sent`` events, protocol 1,
publishing from inside a task (parent and root ids), task-level
``expires``, routes to a named exchange, and a schedule's own message
options (``expires``, ``headers``, ``exchange``, ``routing_key``) take
``send_task``, as does every broker other than Redis. Nothing waits for these messages' results,
so the result backend is not told of them (``on_task_call``).

Mirrors, checked against celery 5.7.0 and kombu 5.7.0 (``requirements.txt``):

- celery ``Celery.send_task`` (``celery/app/base.py``): its option merging
  (``app._tasks``, ``Task._get_exec_options``, ``amqp.router.route``,
  ``app.thread_oid``, ``anon_nodename()``, ``saferepr`` of the arguments);
- celery ``AMQP._create_task_sender.<locals>.send_task_message``
  (``celery/app/amqp.py``): default queue, delivery mode, the anonymous
  direct exchange, the publish signals;
- kombu ``Producer.publish``, ``Producer._publish``,
  ``Producer._delivery_details``, ``Producer._prepare`` (``kombu/messaging.py``);
- kombu ``virtual.Channel.basic_publish`` and ``_inplace_augment_message``
  (``kombu/transport/virtual/base.py``), ``redis.Channel._put``,
  ``_q_for_pri``, ``_get_message_priority``, ``priority_steps``, ``_expires``
  and ``conn_or_acquire`` (``kombu/transport/redis.py``).

Self-check (``FAST_PATH``): the first message a process builds is also put
through kombu's own ``Producer.publish`` on the same channel, stopped at the
Redis channel's ``_put``, and the two must be equal but for the random
delivery tag; the rest of ``send_task`` (routing, options) is Celery's own
code called here, compared with ``send_task`` by the test above. A
difference, or an internal gone or changed, sends every later message of
the process by ``send_task``.
"""

from __future__ import annotations

import copy
import uuid
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery import signals
from celery.app.routes import MapRoute
from celery.utils.nodenames import anon_nodename
from celery.utils.saferepr import saferepr
from kombu.exceptions import OperationalError as BrokerError
from kombu.utils.json import dumps

from scheduler import tracing
from scheduler.conf import settings
from scheduler.fastpath.guard import BREAKAGE, FastPath
from scheduler.models import Execution
from scheduler.models.schedule import MESSAGE_OPTION_FIELDS
from scheduler.timing import policies

if TYPE_CHECKING:
    from celery import Celery
    from kombu import Connection


#: Whether this process builds messages itself; else ``send_task`` sends them all.
FAST_PATH = FastPath("publisher", slow_path="Celery's send_task")

#: Options a route may carry that the fast path expresses; any other sends by ``send_task``.
_ROUTE_OPTIONS = frozenset(
    {
        "queue",
        "exchange",
        "routing_key",
        "exchange_type",
        "priority",
        "serializer",
        "compression",
        "delivery_mode",
        "time_limit",
        "soft_time_limit",
    }
)


def time_limits(timeout: int | None) -> dict[str, float]:
    """Return Celery's time-limit options for an execution ``timeout`` (none when unset).

    The soft limit raises ``SoftTimeLimitExceeded`` in the task at ``timeout``;
    the hard limit kills the worker child ``TIMEOUT_GRACE_SECONDS`` later.
    """
    if not timeout:
        return {}
    return {"soft_time_limit": float(timeout), "time_limit": float(timeout) + settings.TIMEOUT_GRACE_SECONDS}


def has_message_options(row: dict[str, Any]) -> bool:
    """Whether the row's schedule sets Celery message options (``MESSAGE_OPTION_FIELDS``): ``send_task`` sends it."""
    return any(row.get(name) for name in MESSAGE_OPTION_FIELDS)


def start_at(row: dict[str, Any]) -> datetime:
    """When the row's message may run: its slot plus its schedule's jitter for that slot, or its ``not_before``."""
    start = row["scheduled_for"]
    if row.get("jitter"):
        start += timedelta(seconds=policies.jitter_offset(row.get("schedule_id") or 0, start, row["jitter"]))
    not_before = row.get("not_before")
    return max(start, not_before) if not_before is not None else start


@dataclass(frozen=True)
class _Route:
    """What Celery's routing decided for one (task, queue, priority): the same for every such row."""

    queue: str
    priority: int | None
    serializer: str
    compression: str | None
    delivery_mode: Any
    time_limit: float | None
    soft_time_limit: float | None


@dataclass(frozen=True)
class _Message:
    """What Celery's ``as_task_v2`` made of a row, with the scheduler's headers: what kombu's producer is given."""

    route: _Route
    headers: dict[str, Any]
    properties: dict[str, Any]
    body: Any


@dataclass(frozen=True)
class _Built:
    """One message ready to push: its Redis list, the queue it routes to, the envelope, Celery's body."""

    key: str
    queue: str
    message: dict[str, Any]
    body: Any


@dataclass(frozen=True)
class _Batch:
    """A batch's pipeline, worked out before any of it is sent (a broken internal raises here, not halfway)."""

    #: The Redis channel's client, as ``_put`` acquires it.
    client: Callable[[], AbstractContextManager[Any]]
    #: {Redis list: serialised messages}.
    lists: dict[str, list[str]]
    #: (Redis list, milliseconds) for each list of a queue declared with ``x-expires``.
    expiries: list[tuple[str, int]]
    built: list[_Built]


class Publisher:
    """One broker connection for a publishing pass; ``send`` pushes one batch of rows.

    A row has the ``executions.MESSAGE_FIELDS``, and ``schedule_id`` and
    ``jitter`` when it belongs to a schedule with jitter.
    """

    def __init__(self, app: Celery, connection: Connection) -> None:
        self.app = app
        self.connection = connection
        self.producer = connection.Producer()
        conf = app.conf
        self.fast = (
            connection.transport.driver_type == "redis"
            and conf.task_protocol == 2
            and not conf.task_send_sent_event
            # Inside a task, send_task adds the parent and root ids.
            and app.current_worker_task is None
        )
        # Map routes depend on the task name only; any other router may read the arguments.
        self._routes_by_name = all(isinstance(route, MapRoute) for route in app.amqp.routes)
        self._routes: dict[tuple[str, str, int | None], _Route | None] = {}
        # What as_task_v2 and send_task would look up per message (Celery's
        # configuration lookups were a third of the cost), read once.
        self._repr_maxlevels = conf.task_repr_maxlevels
        self._origin = anon_nodename()
        self._reply_to = app.thread_oid

    @tracing.traced("scheduler.publish.batch", tracing.publish_attributes)
    def send(self, rows: list[dict[str, Any]], *, now: datetime) -> None:
        """Send one message per row; raise ``kombu.exceptions.OperationalError`` if the broker fails.

        On failure, some of the messages may have been delivered: the caller
        leaves the rows ``pending``, and a message sent twice is claimed once.
        """
        slow = rows
        if self.fast and not FAST_PATH.fallen:
            try:
                messages, slow = self._messages(rows, now=now)
            except BREAKAGE as exc:
                FAST_PATH.fall_back(f"building a message raised {exc!r}", exc)
            else:
                if messages and FAST_PATH.check_once(lambda: self._difference(messages[0])):
                    try:
                        batch = self._batch([self._build(message) for message in self._announced(messages)])
                    except BREAKAGE as exc:
                        # Nothing of the batch was sent: send_task sends all of it.
                        FAST_PATH.fall_back(f"building a batch raised {exc!r}", exc)
                    else:
                        self._push(batch)
                if FAST_PATH.fallen:
                    slow = rows
        if slow:
            self._send_tasks(slow, now=now)

    # --- the fast path ----------------------------------------------------------------

    def _messages(self, rows: list[dict[str, Any]], *, now: datetime) -> tuple[list[_Message], list[dict[str, Any]]]:
        """Return Celery's messages for ``rows``, and the rows only ``send_task`` can express."""
        messages, slow = [], []
        for row in rows:
            message = None if has_message_options(row) else self._message(row, now=now)
            if message is None:
                slow.append(row)
            else:
                messages.append(message)
        return messages, slow

    def _announced(self, messages: list[_Message]) -> list[_Message]:
        """Send Celery's ``before_task_publish`` for each message, if anyone listens; a receiver may add headers."""
        if signals.before_task_publish.receivers:
            for message in messages:
                signals.before_task_publish.send(
                    sender=message.headers["task"],
                    body=message.body,
                    exchange="",
                    routing_key=message.route.queue,
                    declare=[],
                    headers=message.headers,
                    properties=message.properties,
                    retry_policy={},
                )
        return messages

    def _difference(self, message: _Message) -> str | None:
        """How the fast path's envelope of ``message`` differs from kombu's producer's; ``None``: alike.

        kombu's own ``Producer.publish`` runs on the same channel, stopped
        at the Redis channel's ``_put``, so nothing of it is sent.
        """
        channel: Any = self.connection.default_channel  # kombu's Redis channel
        if not hasattr(type(channel), "_put"):  # shadowing it below would stop nothing
            return "kombu's Redis channel has no _put"
        slow = copy.deepcopy(message)
        captured: list[tuple[str, dict[str, Any]]] = []
        channel._put = lambda queue, sent, **kwargs: captured.append((queue, sent))
        try:
            self.producer.publish(
                slow.body,
                exchange="",
                routing_key=slow.route.queue,
                serializer=slow.route.serializer,
                compression=slow.route.compression,
                delivery_mode=slow.route.delivery_mode,
                headers=slow.headers,
                retry=False,
                **slow.properties,
            )
        finally:
            del channel._put
        if len(captured) != 1:
            return f"kombu's Producer.publish reached the Redis channel's _put {len(captured)} times, not once"
        fast = self._build(copy.deepcopy(message))
        [(queue, sent)] = captured
        if (queue, _untagged(sent)) != (fast.queue, _untagged(fast.message)):
            return f"kombu put {sent!r} on {queue!r}, the fast path {fast.message!r} on {fast.queue!r}"
        if fast.key != channel._q_for_pri(queue, channel._get_message_priority(sent, reverse=False)):
            return f"the fast path's Redis list {fast.key!r} is not kombu's"
        return None

    def _route(self, row: dict[str, Any]) -> _Route | None:
        """Celery's routing and options for the row, as ``send_task`` computes them; ``None`` if not expressible."""
        key = (row["task"], row["queue"], row["priority"])
        if self._routes_by_name and key in self._routes:
            return self._routes[key]
        amqp, conf = self.app.amqp, self.app.conf
        # send_task's own lookup (no app finalisation); the registry attribute is not in celery-types.
        task = self.app._tasks.get(row["task"])  # type: ignore[attr-defined]
        exec_options = getattr(task, "_get_exec_options", None)
        options = {k: v for k, v in (exec_options() if exec_options else {}).items() if v is not None}
        if row["queue"]:
            options["queue"] = row["queue"]
        if row["priority"] is not None:
            options["priority"] = row["priority"]
        route: _Route | None = None
        if "expires" not in options:
            options = amqp.router.route(options, row["task"], row["args"], row["kwargs"], task)
            route = self._expressible(options, conf)
        if self._routes_by_name:
            self._routes[key] = route
        return route

    def _expressible(self, options: dict[str, Any], conf: Any) -> _Route | None:
        """Return the route when its message goes to one Redis list through the default exchange."""
        if not set(options) <= _ROUTE_OPTIONS:
            return None
        queue = options.get("queue") or (None if options.get("exchange") else self.app.amqp.default_queue)
        if queue is None:
            return None
        if isinstance(queue, str):
            queue = self.app.amqp.queues[queue]
        exchange_type = options.get("exchange_type") or getattr(queue.exchange, "type", "direct")
        # send_task_message's rule: a direct exchange without both names is the default one.
        if not ((not options.get("exchange") or not options.get("routing_key")) and exchange_type == "direct"):
            return None
        return _Route(
            queue=queue.name,
            priority=options.get("priority"),
            serializer=options.get("serializer") or conf.task_serializer,
            compression=options.get("compression") or conf.task_compression,
            delivery_mode=options.get("delivery_mode")
            or queue.exchange.delivery_mode
            or conf.task_default_delivery_mode,
            time_limit=options.get("time_limit"),
            soft_time_limit=options.get("soft_time_limit"),
        )

    def _message(self, row: dict[str, Any], *, now: datetime) -> _Message | None:
        """Return Celery's message for the row, as ``send_task`` would make it; ``None`` if not expressible."""
        route = self._route(row)
        if route is None:
            return None
        limits: dict[str, Any] = time_limits(row["timeout"]) or {
            "time_limit": route.time_limit,
            "soft_time_limit": route.soft_time_limit,
        }
        eta = start_at(row)
        amqp = self.app.amqp
        args, kwargs = row["args"] or (), row["kwargs"] or {}
        headers, properties, body, _ = amqp.as_task_v2(
            row["celery_task_id"] or str(uuid.uuid4()),
            row["task"],
            args,
            kwargs,
            # ignore_result=None as send_task passes an unset option; celery-types says bool.
            eta=eta if eta > now else None,
            reply_to=self._reply_to,
            ignore_result=None,  # type: ignore[arg-type]
            origin=self._origin,
            # Empty arguments (most schedules) repr alike either way, without saferepr's cost.
            argsrepr=saferepr(args, amqp.argsrepr_maxsize, maxlevels=self._repr_maxlevels) if args else repr(args),
            kwargsrepr=saferepr(kwargs, amqp.kwargsrepr_maxsize, maxlevels=self._repr_maxlevels)
            if kwargs
            else repr(kwargs),
            **limits,
        )
        headers[Execution.MESSAGE_HEADER] = row["id"]
        headers.update(tracing.message_headers(row))
        if route.priority is not None:
            properties["priority"] = route.priority
        return _Message(route, headers, properties, body)

    def _build(self, message: _Message) -> _Built:
        """Return (Redis list, envelope) for Celery's message, as kombu's producer and Redis channel would put it."""
        route, headers, body = message.route, message.headers, message.body
        properties = dict(message.properties)
        # kombu's Producer.publish, then the Redis channel's basic_publish and _put.
        priority = properties.pop("priority", 0)
        _, properties["delivery_mode"] = self.producer._delivery_details("", route.delivery_mode)
        payload, content_type, content_encoding = self.producer._prepare(
            body, route.serializer, None, None, route.compression, headers
        )
        # kombu's Redis channel: the stubs know only the StdChannel interface.
        channel: Any = self.connection.default_channel
        envelope = channel.prepare_message(payload, priority, content_type, content_encoding, headers, properties)
        channel._inplace_augment_message(envelope, "", route.queue)
        return _Built(
            channel._q_for_pri(route.queue, channel._get_message_priority(envelope)), route.queue, envelope, body
        )

    def _batch(self, built: list[_Built]) -> _Batch:
        """Return the pipeline's commands for ``built``: one LPUSH per list, and the expiries ``_put`` would set."""
        lists: defaultdict[str, list[str]] = defaultdict(list)
        for item in built:
            lists[item.key].append(dumps(item.message))
        channel: Any = self.connection.default_channel  # kombu's Redis channel, as above
        expiries = [
            (channel._q_for_pri(queue, step), channel._expires[queue])
            for queue in {item.queue for item in built}
            if queue in channel._expires  # a queue declared with x-expires
            for step in channel.priority_steps
        ]
        return _Batch(channel.conn_or_acquire, dict(lists), expiries, built)

    def _push(self, batch: _Batch) -> None:
        """Run the batch's commands in one pipeline, oldest first out; then Celery's after-publish signal."""
        if not batch.built:
            return
        try:
            with batch.client() as client, client.pipeline(transaction=False) as pipe:
                for key, payloads in batch.lists.items():
                    pipe.lpush(key, *payloads)
                for key, milliseconds in batch.expiries:
                    pipe.pexpire(key, milliseconds)
                pipe.execute()
        except (*self.connection.connection_errors, *self.connection.channel_errors) as exc:
            raise BrokerError(f"broker publish failed, delivery uncertain: {exc}") from exc
        built = batch.built
        if signals.after_task_publish.receivers:
            for item in built:
                signals.after_task_publish.send(
                    sender=item.message["headers"]["task"],
                    body=item.body,
                    headers=item.message["headers"],
                    exchange="",
                    routing_key=item.queue,
                )

    # --- the fallback: Celery's send_task ------------------------------------------------

    def _send_tasks(self, rows: list[dict[str, Any]], *, now: datetime) -> None:
        # Room for every command of the batch: kombu flushes it once, when the block ends.
        with self.producer.batch(max_size=4 * len(rows)):  # type: ignore[attr-defined]  # kombu 5.7; not in the stubs
            for row in rows:
                self.app.send_task(row["task"], args=row["args"], kwargs=row["kwargs"], **self._options(row, now=now))

    def _options(self, row: dict[str, Any], *, now: datetime) -> dict[str, Any]:
        options: dict[str, Any] = {
            "task_id": row["celery_task_id"] or None,
            # The schedule's own headers first: they never override the execution's (``RESERVED_HEADERS``).
            "headers": {
                **(row.get("headers") or {}),
                Execution.MESSAGE_HEADER: row["id"],
                **tracing.message_headers(row),
            },
            "producer": self.producer,
            # Fail fast: a broker outage must not stall the caller.
            "retry": False,
            **time_limits(row["timeout"]),
        }
        if row["queue"]:
            options["queue"] = row["queue"]
        if row["priority"] is not None:
            options["priority"] = row["priority"]
        for name in ("exchange", "routing_key"):
            if row.get(name):
                options[name] = row[name]
        eta = start_at(row)
        if eta > now:
            options["eta"] = eta
        if row.get("expires"):
            options["expires"] = eta + timedelta(seconds=row["expires"])
        return options


def _untagged(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` less its delivery tag, a fresh uuid per message."""
    properties = {key: value for key, value in message["properties"].items() if key != "delivery_tag"}
    return {**message, "properties": properties}
