"""Where a worker's pool child spends each task: opt-in timers for ``python -m bench.worker_overhead --profile``.

Loaded only by the benchmark's worker (``--include bench.profiling``) and
only when ``BENCH_PROFILE_DIR`` is set. In each prefork pool child it wraps
the functions a task passes through with wall-clock timers and, at the
child's exit, writes ``<pid>.json`` into that directory: per bucket, the
seconds spent in it (its own time: time in a nested bucket counts there),
the part of that spent in database calls (the driver and the server, per
``CursorWrapper``), and the number of queries.

The timers cost about a microsecond per call: the figures are the code's,
not cProfile's (which slows every Python call and so inflates Celery's own
overhead most). Only the child's main thread, which runs the tasks, is
timed; the claim renewer's threads are not.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from celery import signals

#: The environment variable the benchmark sets: where each pool child writes its timings.
DIRECTORY_VARIABLE = "BENCH_PROFILE_DIR"

_seconds: defaultdict[str, float] = defaultdict(float)
_db_seconds: defaultdict[str, float] = defaultdict(float)
_queries: defaultdict[str, int] = defaultdict(int)
#: Open buckets of the main thread: [name, seconds in nested buckets].
_stack: list[list[Any]] = []
_window = {"first": 0.0, "last": 0.0, "tasks": 0}
_main_thread = threading.main_thread().ident


def _timed(bucket: str, function: Any) -> Any:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != _main_thread:
            return function(*args, **kwargs)
        started = time.perf_counter()
        _stack.append([bucket, 0.0])
        try:
            return function(*args, **kwargs)
        finally:
            name, nested = _stack.pop()
            elapsed = time.perf_counter() - started
            _seconds[name] += elapsed - nested
            if _stack:
                _stack[-1][1] += elapsed

    return call


def _database_call(function: Any) -> Any:
    """Count a cursor execution, and its time, against the bucket it runs in."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != _main_thread:
            return function(*args, **kwargs)
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            bucket = _stack[-1][0] if _stack else "outside a task"
            _db_seconds[bucket] += time.perf_counter() - started
            _queries[bucket] += 1

    return call


def _task_window(function: Any) -> Any:
    """Time each job the child runs, and note when the first started and the last ended."""
    timed = _timed("Celery's tracer (around the task)", function)

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        _window["first"] = _window["first"] or started
        try:
            return timed(*args, **kwargs)
        finally:
            _window["last"] = time.perf_counter()
            _window["tasks"] += 1

    return call


def _patch(owner: Any, name: str, bucket: str) -> None:
    setattr(owner, name, _timed(bucket, getattr(owner, name)))


def _install() -> None:
    from celery.app import trace
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.backends.utils import CursorWrapper
    from django_celery_results.backends.database import DatabaseBackend

    from scheduler import logs, tracing
    from scheduler.fastpath import celery_result
    from scheduler.owners import executions
    from scheduler.worker import task as guard
    from scheduler.worker.renewer import ClaimRenewer

    trace.fast_trace_task = _task_window(trace.fast_trace_task)  # the job billiard hands the child, by name
    CursorWrapper._execute = _database_call(CursorWrapper._execute)
    _patch(executions, "record_ad_hoc", "ad-hoc insert")
    _patch(executions, "claim", "claim")
    _patch(executions, "fail_exhausted", "claim")
    for name in ("finish", "record_result", "retry"):
        _patch(executions, name, "outcome write")
    _patch(DatabaseBackend, "mark_as_done", "result backend write")
    _patch(celery_result, "row_of", "result row for the outcome (encoding)")
    _patch(guard, "close_old_connections", "connection checks")
    _patch(BaseDatabaseWrapper, "close_if_health_check_failed", "connection checks")
    _patch(signals.task_prerun.__class__, "send", "signals (prerun/postrun handlers)")
    _patch(ClaimRenewer, "hold", "claim renewer")
    _patch(ClaimRenewer, "drop", "claim renewer")
    _patch(tracing, "claim_span", "tracing hooks")
    for name in ("bind", "unbind"):
        _patch(logs, name, "guard's own code")
    _patch(guard.ExecutionTask, "before_start", "guard's own code")
    _patch(guard.ExecutionTask, "__call__", "guard's own code")
    _rebuild_tracers(trace)


def _rebuild_tracers(trace: Any) -> None:
    """Build each task's tracer again in this child, so it calls the timed functions.

    The worker built them before forking, holding the task's ``run`` and
    ``before_start`` as they were then (as ``Consumer.update_strategies`` does).
    """
    tasks, _, hostname = trace._localized
    for name, task in list(tasks.items()):
        if name.startswith("bench."):
            task.run = _timed("task body", task.run)
            task.__trace__ = trace.build_tracer(name, task, task.app.loader, hostname, app=task.app)


@signals.worker_process_init.connect
def _start(**_: Any) -> None:
    if os.environ.get(DIRECTORY_VARIABLE):
        _install()


@signals.worker_process_shutdown.connect
def _write(**_: Any) -> None:
    directory = os.environ.get(DIRECTORY_VARIABLE)
    if not directory or not _window["tasks"]:
        return
    in_tasks = sum(_seconds.values())
    payload = {
        "tasks": _window["tasks"],
        # From the first job's start to the last one's end, in and between jobs.
        "window_seconds": _window["last"] - _window["first"],
        "in_tasks_seconds": in_tasks,
        "seconds": dict(_seconds),
        "db_seconds": dict(_db_seconds),
        "queries": dict(_queries),
    }
    Path(directory, f"{os.getpid()}.json").write_text(json.dumps(payload))
