"""End to end: N tasks due at one instant -> sent -> executed -> recorded, through two workers.

Two real ``celery worker`` processes (prefork, ``--concurrency`` each) consume
the default queue of the benchmark's own Redis and store results in its own
PostgreSQL (django-celery-results, as the project does). Then, one after the
other, in the same run and with the same workers:

- **leader-gated**: one real ``celery -A project beat`` (the leader) and N
  hourly schedules of ``bench.noop`` (a guarded task) whose slot is the whole
  second T. Done when all N executions are ``succeeded``.
- **plain Celery beat**: ``celery beat`` with Celery's own
  ``PersistentScheduler`` and N ``beat_schedule`` entries of
  ``bench.noop_plain`` (Celery's plain ``Task``), each a crontab for the
  minute T (crontab has minute resolution, so T is the next whole minute at
  least 15 s away). Done when N results are stored.

For both, the clock runs from T to the last result's ``date_done`` (the
database clock; the workers record it), so sending, executing and recording
are all inside it. executions/s = N / that time. Peak and end figures come
from the database, not from logs.

Run: ``python -m bench.end_to_end [--tasks 10000] [--concurrency 1]``
(it starts its own PostgreSQL and Redis). Writes ``bench/results/end_to_end.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from bench.common import (
    CELERY,
    ROOT,
    execute_sql,
    insert_generated,
    measure_in_child,
    stop_process,
    table,
    write_results,
)
from tests.support.processes import worker_argv

WORKERS = 2
POLL_SECONDS = 0.05
LEAD_SECONDS = 3
#: The plain beat's crontab fires on a whole minute; it must start before it.
PLAIN_LEAD_SECONDS = 15


# --- inside the child process (Django configured) ----------------------------------------


def _reset() -> None:
    import redis

    execute_sql(
        "TRUNCATE scheduler_execution, scheduler_schedule, scheduler_instance, scheduler_lease,"
        " django_celery_results_taskresult CASCADE"
    )
    redis.Redis.from_url(os.environ["REDIS_URL"]).flushdb()


def _start(command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
    with log.open("ab") as out:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=env or os.environ.copy(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _worker_command(name: str, concurrency: int) -> list[str]:
    # Quiet, and with heartbeats: a deployed worker's.
    return worker_argv(name, concurrency=concurrency, tasks="bench.tasks", log_level="warning", heartbeat=True)


def _start_workers(concurrency: int, logs: Path) -> list[subprocess.Popen[Any]]:
    from project.celery import app

    workers = [
        _start(_worker_command(f"e2e-{number}", concurrency), logs / f"worker-{number}.log")
        for number in range(WORKERS)
    ]
    deadline = time.monotonic() + 60
    while len({name for reply in app.control.ping(timeout=1.0) for name in reply if name.startswith("e2e-")}) < WORKERS:
        if time.monotonic() > deadline:
            raise SystemExit("the benchmark workers did not answer a ping within 60 s")
    return workers


def _wait_until_recorded(count: int, due: datetime, timeout: float, where: str) -> dict[str, Any]:
    """Poll until ``count`` successful results are stored; return T -> last ``date_done``."""
    deadline = time.monotonic() + max(due.timestamp() - time.time(), 0) + timeout
    while True:
        done, last = execute_sql(
            f"SELECT count(*), max(date_done) FROM django_celery_results_taskresult WHERE {where}"
        )[0]
        if done >= count:
            seconds = (last - due).total_seconds()
            return {"recorded": done, "seconds": seconds, "per_second": count / seconds}
        if time.monotonic() > deadline:
            return {"recorded": done, "seconds": None, "per_second": None}
        time.sleep(POLL_SECONDS)


def _leader_gated(count: int, timeout: float, logs: Path) -> dict[str, Any]:
    from scheduler.models import Schedule

    _reset()
    beat = _start([CELERY, "-A", "project", "beat", "-l", "info", "--pidfile="], logs / "beat-ours.log")
    try:
        deadline = time.monotonic() + 60
        while not execute_sql("SELECT 1 FROM scheduler_lease WHERE holder <> '' AND expires_at > now()"):
            if beat.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the beat did not take the lease")
            time.sleep(0.05)
        (due,) = execute_sql(f"SELECT date_trunc('second', now()) + interval '{LEAD_SECONDS} seconds'")[0]
        insert_generated(
            Schedule,
            count,
            {
                "name": "'e2e-' || g",
                "task": "'bench.noop'",
                "interval": "3600",
                "start_at": f"'{due.isoformat()}'",
                "next_run_at": f"'{due.isoformat()}'",
                "created_at": "now()",
                "updated_at": "now()",
            },
        )
        result = _wait_until_recorded(count, due, timeout, "task_name = 'bench.noop' AND status = 'SUCCESS'")
    finally:
        stop_process(beat)
    rows, succeeded, keys = execute_sql(
        "SELECT count(*), count(*) FILTER (WHERE status = 'succeeded'), count(DISTINCT idempotency_key)"
        " FROM scheduler_execution"
    )[0]
    return {
        "kind": "leader-gated beat",
        "tasks": count,
        **result,
        "executions": rows,
        "succeeded": succeeded,
        "duplicates": rows - keys,
    }


def _plain(count: int, timeout: float, logs: Path) -> dict[str, Any]:
    _reset()
    (now,) = execute_sql("SELECT now()")[0]
    due = (now + timedelta(seconds=PLAIN_LEAD_SECONDS + 60)).replace(second=0, microsecond=0)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.plain_settings",
        "BENCH_PLAIN_TASKS": str(count),
        "BENCH_PLAIN_DUE": due.isoformat(),
    }
    beat = _start(
        [CELERY, "-A", "project", "beat", "-l", "info", "--pidfile=", f"--schedule={logs / 'plain-beat-schedule'}"],
        logs / "beat-plain.log",
        env,
    )
    try:
        result = _wait_until_recorded(count, due, timeout, "task_name = 'bench.noop_plain' AND status = 'SUCCESS'")
    finally:
        stop_process(beat)
    return {"kind": "plain Celery beat (PersistentScheduler)", "tasks": count, **result}


def _child(count: int, concurrency: int, timeout: float, logs: Path) -> dict[str, Any]:
    import django

    django.setup()
    _reset()
    workers = _start_workers(concurrency, logs)
    try:
        runs = []
        for measure in (_leader_gated, _plain):
            print(f"{measure.__name__.strip('_')}: {count:,} tasks...", file=sys.stderr, flush=True)
            runs.append(measure(count, timeout, logs))
    finally:
        for worker in workers:
            stop_process(worker)
    return {"runs": runs}


# --- the orchestrator ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000, help="tasks due at the same instant (default 10000)")
    parser.add_argument("--concurrency", type=int, default=1, help="prefork processes per worker (default 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take (default 600)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--logs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.concurrency < 1 or args.timeout <= 0:
        parser.error("--tasks, --concurrency and --timeout must be positive")
    if args.child:
        print(json.dumps(_child(args.tasks, args.concurrency, args.timeout, Path(args.logs)), default=str), flush=True)
        return 0

    started = time.monotonic()
    result = measure_in_child("bench.end_to_end", tasks=args.tasks, concurrency=args.concurrency, timeout=args.timeout)
    runs = result["runs"]
    print()
    print(
        table(
            ["beat", "tasks", "recorded", "due -> last recorded s", "executions/s"],
            [
                [
                    run["kind"],
                    run["tasks"],
                    run["recorded"],
                    run["seconds"] or "did not finish",
                    run["per_second"] or "-",
                ]
                for run in runs
            ],
        )
    )
    ours, plain = runs
    if ours["per_second"] and plain["per_second"]:
        print(
            f"\nleader-gated / plain: {ours['per_second'] / plain['per_second']:.2f} "
            f"({WORKERS} workers x {args.concurrency} process(es); duplicates: {ours['duplicates']})"
        )
    print(f"ran in {time.monotonic() - started:.0f}s")
    write_results(
        "end_to_end",
        {
            "database": "PostgreSQL (benchmark cluster, fsync off)",
            "broker": "Redis (benchmark instance)",
            "workers": WORKERS,
            "concurrency": args.concurrency,
            **result,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
