"""Celery's result row written by the guard's outcome statement: a guarded success costs one write, not five.

django-celery-results stores a result after the body returns with a
``get_or_create``: a SELECT, then an INSERT in a transaction of its own,
four round trips on PostgreSQL, more than the guard's claim and outcome
together (``python -m bench.worker_overhead --profile``). For a guarded
task that succeeded, ``row_of`` computes the row by the backend's own code
(its ``store_result``, run on a copy whose model only keeps what it is asked
to store), the outcome's statement writes it (``owners.executions.finish``),
and Celery is told the result is stored: ``request.ignore_result``, which
``Backend.mark_as_done`` reads before storing.

Mirrors, checked against django-celery-results 2.6.0 and Celery 5.7.0
(``requirements.txt``):

- ``TaskResultManager.store_result`` (``django_celery_results/managers.py``):
  the row of ``task_id`` created with every field, or saved again in every
  field but ``date_created`` and ``date_started``; ``date_done`` is now
  (``auto_now``). ``upsert_sql`` writes the same in one statement.
- ``trace_task`` (``celery/app/trace.py``): callbacks and chains are sent
  after the body and before the result is stored, and add the results they
  send to its ``children``; a chord's part counts itself after. Requests
  with any of them are left to Celery.

Self-check (``FAST_PATH``): the first row written in a process is read back
by the ORM and must hold, field by field, what the manager was asked to
store; a difference stores it again by the manager and falls back.
"""

from __future__ import annotations

import copy
import functools
import threading
import weakref
from typing import Any, cast

from celery import states
from celery.app.task import get_actual_ignore_result  # type: ignore[attr-defined]  # celery-types predates it
from django.db import connections, router
from django.db.models import CharField, Field
from django.utils import timezone
from django_celery_results.backends.database import DatabaseBackend
from django_celery_results.managers import TaskResultManager
from django_celery_results.models import TaskResult

from scheduler.fastpath.guard import BREAKAGE, FastPath, comparable
from scheduler.fastpath.prepared import Param

FAST_PATH = FastPath("celery_result", slow_path="Celery storing a guarded task's result itself")

#: What ``DatabaseBackend._store_result`` hands ``TaskResultManager.store_result`` for a success (and ``using``).
STORED = (
    "task_id",
    "status",
    "result",
    "traceback",
    "meta",
    "content_encoding",
    "content_type",
    "periodic_task_name",
    "task_name",
    "task_args",
    "task_kwargs",
    "worker",
)
#: The columns the statement writes: those, and the two dates the model sets itself.
WRITTEN = (*STORED, "date_created", "date_done")
#: What saving the row again leaves as it was.
_KEPT_ON_CONFLICT = ("task_id", "date_created")

#: What the statement's ``Param`` names start with: ``result`` and ``traceback`` are the execution's too.
_PARAM = "celery_"

_captured = threading.local()
#: Each backend's probe: Celery keeps one backend per thread.
_probes: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


class _Keeper:
    """The manager of ``_Capture``: keeps what it is asked to store, in this thread."""

    def store_result(self, **props: Any) -> None:
        _captured.props = props


class _Capture:
    """Stands for ``TaskResult`` in the probe backend: nothing is written."""

    _default_manager = _Keeper()


def row_of(task: Any, value: Any, *, using: str) -> dict[str, Any] | None:
    """The TaskResult row Celery would store for ``task``'s success with ``value``; ``None``: Celery stores it.

    ``using`` is the database the outcome is written to: the row goes with
    it only where Django's router would store it too.
    """
    if FAST_PATH.fallen:
        return None
    request = task.request
    try:
        backend = task.backend
        if not _stored_plainly(task, backend, request) or router.db_for_write(TaskResult) != using:
            return None
        probe = _probe(backend)
        _captured.props = None
        probe.store_result(request.id, value, states.SUCCESS, request=request)
        props = _captured.props
    except BREAKAGE as exc:
        FAST_PATH.fall_back(f"computing the row raised {exc!r}", exc)
        return None
    except Exception:  # noqa: BLE001  # a result Celery cannot encode: its own path reports it as it always did
        return None
    if props is None or set(props) != {*STORED, "using"}:
        FAST_PATH.fall_back(f"the backend asked to store {sorted(props or ())}, not {sorted(STORED)}")
        return None
    if props["using"] is not None or not _fits(props):
        return None
    now = timezone.now()
    return {**{name: props[name] for name in STORED}, "date_created": now, "date_done": now}


def _probe(backend: Any) -> Any:
    """A copy of ``backend`` whose ``TaskModel`` keeps what it is asked to store; one per backend (a copy is slow)."""
    probe = _probes.get(backend)
    if probe is None:
        probe = _probes[backend] = copy.copy(backend)
        probe.TaskModel = _Capture
    return probe


def _stored_plainly(task: Any, backend: Any, request: Any) -> bool:
    """Whether Celery would store this success as ``TaskResultManager.store_result`` does, and do nothing more."""
    return (
        isinstance(backend, DatabaseBackend)
        and type(backend)._store_result is DatabaseBackend._store_result  # noqa: SLF001  # the code the row mirrors
        and backend.TaskModel is TaskResult
        and type(TaskResult._default_manager).store_result is TaskResultManager.store_result
        and not request.is_eager
        and not request.called_directly
        and not get_actual_ignore_result(task, request)
        and not request.chord
        and not request.callbacks
        and not request.chain
    )


def _fits(props: dict[str, Any]) -> bool:
    """Whether every text fits its column: a value too long is the manager's error to raise, not the outcome's."""
    return all(props[name] is None or len(props[name]) <= limit for name, limit in _limits().items())


@functools.cache
def _limits() -> dict[str, int]:
    """The length limit of each of ``STORED`` that has one (its CharFields), looked up once."""
    fields = [TaskResult._meta.get_field(name) for name in STORED]
    return {field.name: field.max_length for field in fields if isinstance(field, CharField) and field.max_length}


def stored(task: Any) -> None:
    """Tell Celery the success of ``task`` is stored: ``Backend.mark_as_done`` leaves the row as written."""
    task.request.ignore_result = True


def params(row: dict[str, Any]) -> dict[str, Any]:
    """The values of ``upsert_sql``'s ``Param`` objects for ``row``: named apart from the execution's own."""
    return {_PARAM + name: value for name, value in row.items()}


def upsert_sql(using: str, *, when: str) -> tuple[str, list[Any]]:
    """The row ``row_of`` returned, inserted or saved again as the manager would, only where ``when`` (SQL) holds.

    Its values are ``Param`` objects (``params``); it returns the row's id.
    """
    connection = connections[using]
    quote = connection.ops.quote_name
    meta = TaskResult._meta
    fields = [cast("Field[Any, Any]", meta.get_field(name)) for name in WRITTEN]
    columns = ", ".join(quote(field.column) for field in fields)
    saved_again = ", ".join(
        f"{quote(field.column)} = EXCLUDED.{quote(field.column)}"
        for field in fields
        if field.name not in _KEPT_ON_CONFLICT
    )
    sql = (
        f"INSERT INTO {quote(meta.db_table)} ({columns}) SELECT {', '.join(['%s'] * len(fields))} WHERE {when} "
        f"ON CONFLICT ({quote(fields[WRITTEN.index('task_id')].column)}) DO UPDATE SET {saved_again} "
        f"RETURNING {quote(meta.pk.column)}"
    )
    return sql, [Param(_PARAM + field.name, field).parameter(connection) for field in fields]


def check_written(row: dict[str, Any], using: str) -> None:
    """On the first row written in this process, read it back: each field must hold what ``row`` asked for.

    A difference stores the row again by the manager (Celery's own write)
    and falls back for the rest of the process.
    """
    FAST_PATH.check_once(lambda: _difference(row, using))
    if FAST_PATH.fallen:
        TaskResult._default_manager.store_result(**{name: row[name] for name in STORED}, using=using)


def _difference(row: dict[str, Any], using: str) -> str | None:
    written = TaskResult._default_manager.using(using).get(task_id=row["task_id"])
    for name in WRITTEN:
        if comparable(getattr(written, name)) != comparable(row[name]):
            return f"{name}: {getattr(written, name)!r} written, {row[name]!r} asked for"
    return None
