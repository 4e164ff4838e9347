"""OpenTelemetry tracing: every span the scheduler makes, and the only module that imports OpenTelemetry.

Off by default. ``OTEL_TRACES_EXPORTER`` turns it on: ``console`` (one JSON
object per span and line on standard output), ``otlp`` (OTLP over HTTP to
``OTEL_EXPORTER_OTLP_ENDPOINT``), both comma-separated, or ``none``. The
other standard variables apply as usual (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``,
``OTEL_EXPORTER_OTLP_*``, ``OTEL_PROPAGATORS``, ``OTEL_SDK_DISABLED``). Off,
every hook below is one flag test: no span, no context, no header.

One slot's trace: the beat's ``scheduler.tick`` holds a
``scheduler.dispatch.commit`` per committed batch; the commit is the parent
of each of its executions' ``scheduler.publish`` span (remembered in this
process by the execution's Celery task id, which the commit chose), whose
W3C ``traceparent`` travels in the message headers. The worker's Celery
instrumentation continues it (``run/<task>``), and ``scheduler.claim``,
``scheduler.run`` and ``scheduler.finish`` hang below. An execution
published elsewhere (reconcile, a new leader, ``submit()`` in a web request
that the Django instrumentation traces) gets its publish span under what is
current there, or as the root of its own trace. Nothing is stored in the
database.

Hooks elsewhere are one line: ``with tracing.span(...)``, ``@tracing.traced(...)``,
``tracing.message_headers(row)`` and ``tracing.created(rows)``; the
attributes each span gets are chosen here.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from datetime import datetime
from typing import IO, Any, TypeVar, cast

from django.core.exceptions import ImproperlyConfigured

#: The keyword each hook passes, and the span attribute it becomes (docs/configuration.md, "Tracing").
ATTRIBUTES = {
    "schedule_name": "scheduler.schedule.name",
    "schedule_id": "scheduler.schedule.id",
    "execution_id": "scheduler.execution.id",
    "slot": "scheduler.slot",
    "attempt": "scheduler.attempt",
    "lease_name": "scheduler.lease.name",
    "lease_token": "scheduler.lease.token",
    "instance_id": "scheduler.instance.id",
    "tenant": "scheduler.tenant",
    "task": "scheduler.task",
    "trigger": "scheduler.trigger",
    "worker": "scheduler.worker",
    "status": "scheduler.status",
    "schedules": "scheduler.schedules",
    "executions": "scheduler.executions",
    "changes": "scheduler.changes",
}
#: Exporters ``OTEL_TRACES_EXPORTER`` may name.
EXPORTERS = ("console", "otlp", "none")
#: Longest a worker's pool child waits at exit for its last spans to be exported.
FLUSH_AT_EXIT_MILLIS = 5000
#: Executions committed here but not published yet whose commit span this process remembers.
REMEMBER_AT_MOST = 20_000

_tracer: Any = None  # set by setup(); None means off
_provider: Any = None
_remembered: OrderedDict[str, tuple[Any, dict[str, Any]]] = OrderedDict()
_remembered_lock = threading.Lock()
_NO_SPAN = nullcontext()
_NO_HEADERS: dict[str, str] = {}

T = TypeVar("T")


def enabled() -> bool:
    return _tracer is not None


def exporters_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> list[str]:
    """Return the exporters the environment asks for (none: tracing stays off), or raise ``ImproperlyConfigured``."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [name.strip().lower() for name in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    unknown = [name for name in names if name not in EXPORTERS]
    if unknown:
        raise ImproperlyConfigured(
            f"OTEL_TRACES_EXPORTER={environ['OTEL_TRACES_EXPORTER']!r}: unknown exporter {unknown[0]!r}; "
            f"use {', '.join(EXPORTERS)} (comma-separated)"
        )
    if "otlp" in names:
        for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = environ.get(variable, "")
            if protocol not in ("", "http/protobuf"):
                raise ImproperlyConfigured(f"{variable}={protocol!r}: only http/protobuf is supported (the default)")
    return [name for name in names if name != "none"]


def setup() -> None:
    """Configure tracing from the ``OTEL_*`` environment, once per process (``SchedulerConfig.ready``)."""
    global _tracer, _provider
    names = exporters_from_env()
    if not names or _tracer is not None:
        return
    from opentelemetry import trace
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "scheduler"}))
    # The batch processor exports from a thread of its own (and restarts it in
    # a forked pool child), so a slow collector never holds up a tick.
    provider = TracerProvider(resource=resource)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = provider.get_tracer("scheduler")
    # Adds its middleware to settings.MIDDLEWARE: ready() runs before the handler loads it.
    DjangoInstrumentor().instrument(tracer_provider=provider)
    _connect_worker_signals()


def _exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        # One line per span, to the real standard output: Celery redirects
        # sys.stdout to its logger, and a multi-line span would be torn apart.
        out = cast(IO[str], sys.__stdout__)  # None only without a console, where Celery has none either
        return ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # reads OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _HEADERS, _TIMEOUT


def _connect_worker_signals() -> None:
    """Trace task runs with the Celery instrumentation in worker processes only; flush a pool child on exit.

    Beat and web publish through ``message_headers``: the instrumentation's
    own publish span would only repeat ``scheduler.publish`` for each message.
    """
    from celery.signals import worker_init, worker_process_init, worker_process_shutdown

    worker_init.connect(_instrument_celery, weak=False, dispatch_uid="scheduler.tracing.worker")
    worker_process_init.connect(_instrument_celery, weak=False, dispatch_uid="scheduler.tracing.child")
    worker_process_shutdown.connect(_flush, weak=False, dispatch_uid="scheduler.tracing.flush")


def _instrument_celery(**_: Any) -> None:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    instrumentor = CeleryInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(tracer_provider=_provider)


def _flush(**_: Any) -> None:
    # A pool child ends without running atexit: export what it still holds,
    # within a bound, so a collector that does not answer never holds up a shutdown.
    _provider.force_flush(timeout_millis=FLUSH_AT_EXIT_MILLIS)


# --- spans -----------------------------------------------------------------------------


def _attributes(values: dict[str, Any]) -> dict[str, Any]:
    attributes = {}
    for key, value in values.items():
        if value is None or value == "":
            continue
        if isinstance(value, datetime):
            value = value.isoformat()
        elif not isinstance(value, (bool, int, float, str)):
            value = str(value)
        attributes[ATTRIBUTES[key]] = value
    return attributes


def span(name: str, **attributes: Any) -> Any:
    """Return a context manager that runs its block in a span (a no-op while tracing is off)."""
    if _tracer is None:
        return _NO_SPAN
    return _tracer.start_as_current_span(name, attributes=_attributes(attributes))


def traced(
    name: str,
    before: Callable[..., dict[str, Any]] | None = None,
    after: Callable[[Any], dict[str, Any]] | None = None,
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorate a function to run in a span named ``name``.

    ``before`` gets the call's arguments and returns the attributes (keys
    of ``ATTRIBUTES``); ``after`` gets the return value and returns more.
    """

    def decorate(function: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> T:
            if _tracer is None:
                return function(*args, **kwargs)
            with _tracer.start_as_current_span(
                name, attributes=_attributes(before(*args, **kwargs)) if before else None
            ) as current:
                result = function(*args, **kwargs)
                if after is not None:
                    current.set_attributes(_attributes(after(result)))
                return result

        return call

    return decorate


def claim_span(name: str, claim: Any) -> Any:
    """Return ``span(name)`` with the attributes of a worker's ``executions.Claim``."""
    if _tracer is None:
        return _NO_SPAN
    return span(name, **claim_attributes(claim))


# --- the execution's context: commit -> publish -> message headers ---------------------


def created(rows: Iterable[Any]) -> None:
    """Remember the current span (a dispatch commit) as the parent of these new Executions' publish spans."""
    if _tracer is None:
        return
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return
    with _remembered_lock:
        for row in rows:
            if row.celery_task_id:  # only pending rows get one: the others are never sent
                _remembered[row.celery_task_id] = (
                    context,
                    {
                        "schedule_name": row.schedule.name if row.schedule_id else None,
                        "tenant": row.tenant,
                        "lease_token": row.lease_token,
                        "trigger": row.trigger,
                    },
                )
        while len(_remembered) > REMEMBER_AT_MOST:
            _remembered.popitem(last=False)


def message_headers(row: dict[str, Any]) -> dict[str, str]:
    """Record the publish of one execution (a message row) and return the headers that carry its trace.

    Its parent is the dispatch commit that created it when this process
    remembers one, linked to what is current (the publishing batch);
    otherwise what is current, or nothing (a new trace).
    """
    if _tracer is None:
        return _NO_HEADERS
    from opentelemetry import propagate, trace

    with _remembered_lock:
        remembered = _remembered.pop(row.get("celery_task_id") or "", None)
    extra: dict[str, Any] = {}
    parent = links = None
    if remembered is not None:
        commit, extra = remembered
        parent = trace.set_span_in_context(trace.NonRecordingSpan(commit))
        current = trace.get_current_span().get_span_context()
        links = [trace.Link(current)] if current.is_valid else None
    values = {
        "execution_id": row.get("id"),
        "schedule_id": row.get("schedule_id"),
        "slot": row.get("scheduled_for"),
        "task": row.get("task"),
        **extra,
    }
    publish = _tracer.start_span(
        "scheduler.publish", context=parent, kind=trace.SpanKind.PRODUCER, attributes=_attributes(values), links=links
    )
    headers: dict[str, str] = {}
    propagate.inject(headers, context=trace.set_span_in_context(publish))
    publish.end()
    return headers


# --- attributes of the hooked calls ----------------------------------------------------


def commit_attributes(chunk: list[Any], *, fence: Any, **_: Any) -> dict[str, Any]:
    if isinstance(fence, Mapping):  # sharded: the leases of the shards in this chunk
        held = sorted({fence[item.shard] for item in chunk}, key=lambda lease: lease.name)
        return {"lease_name": ",".join(lease.name for lease in held), "schedules": len(chunk)}
    return {"lease_name": fence.name, "lease_token": fence.token, "schedules": len(chunk)}


def publish_attributes(sender: Any, rows: list[Any], **_: Any) -> dict[str, Any]:
    return {"executions": len(rows)}


def claiming_attributes(*, worker: str, execution_id: int | None = None, **_: Any) -> dict[str, Any]:
    return {"worker": worker, "execution_id": execution_id}


def claimed_attributes(execution: Any) -> dict[str, Any]:
    """Attributes of what a claim returned (``None``: a duplicate delivery, nothing claimed)."""
    if execution is None:
        return {"status": "not claimed"}
    from scheduler.models import Schedule

    name = None
    if execution.schedule_id is not None:  # one indexed read, only while tracing is on
        name = Schedule.objects.filter(pk=execution.schedule_id).values_list("name", flat=True).first()
    return {
        "execution_id": execution.pk,
        "attempt": execution.attempt,
        "schedule_id": execution.schedule_id,
        "schedule_name": name,
        "slot": execution.scheduled_for,
        "tenant": execution.tenant,
        "task": execution.task,
        "trigger": execution.trigger,
        "status": execution.status,
    }


def claim_attributes(held: Any, *_: Any, status: str | None = None, **__: Any) -> dict[str, Any]:
    """Attributes of a write by a claim holder (``held`` is an ``executions.Claim``)."""
    return {
        "execution_id": held.execution_id,
        "attempt": held.attempt,
        "schedule_id": held.schedule_id,
        "status": status,
    }


def reconciled_attributes(report: Any) -> dict[str, Any]:
    return {"changes": len(report.changes)}
