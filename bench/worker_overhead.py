"""Worker overhead: no-op tasks per second with the execution guard vs plain Celery.

One worker (prefork, 2 processes) serves both kinds of task in the same run.
For each round and kind, N messages wait in a queue the worker does not
consume yet; the clock starts when the worker is told to consume it and stops
when the last result is stored. Each round runs every kind, starting with the
next one each round (when plain tasks always ran first, their first round
was their fastest in each of four runs). Kinds:

- ``plain``: a task on Celery's own ``Task`` base (the baseline),
- ``guarded``: executions recorded first (as the beat and ``submit()`` do),
  each claimed and finished by the guard,
- ``guarded ad-hoc``: a guarded task sent the plain Celery way, so the worker
  also records the Execution row.

Run: ``python -m bench.worker_overhead [--tasks 2000] [--rounds 2] [--databases postgresql,sqlite]``
(it starts its own PostgreSQL and Redis). Writes ``bench/results/worker_overhead.json``.

``--profile`` runs each kind on a worker of its own whose pool children time
where each task goes (``bench.profiling``), and measures the CPU each
process used per task (worker, pool children, PostgreSQL, Redis). It prints
the breakdown and writes ``bench/results/worker_overhead_profile.json``
instead; its rates are slowed a little by the timers, so they are not the
benchmark's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import profiling
from bench.common import (
    ROOT,
    add_databases_option,
    child_command,
    cpu_seconds,
    execute_sql,
    migrated_databases,
    run_child,
    stop_process,
    table,
    write_results,
)
from tests.support.processes import worker_argv

KINDS = ("plain", "guarded", "guarded ad-hoc")
WORKER_NAME = "bench-worker"
#: Each guarded kind's goal, as a ratio to plain Celery's rate in the same run, on every database.
GOALS = {"guarded": 0.9, "guarded ad-hoc": 0.8}


# --- inside one database's child process ------------------------------------------------


def _measure_database(tasks: int, rounds: int, profile_dir: str | None) -> dict[str, Any]:
    """Run every kind ``rounds`` times on one worker; with ``profile_dir``, one profiled worker per kind."""
    import django

    django.setup()
    from django.db import connection

    from project.celery import app

    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    result: dict[str, Any] = {"vendor": connection.vendor, "tasks_per_round": tasks, "rounds": rounds}
    if profile_dir is None:
        with _worker(app) as (_, destination):
            for round_number in range(rounds):
                for kind in _rotated(KINDS, round_number):
                    samples[kind].append(_run_kind(app, destination, kind, tasks, round_number))
    else:
        result["profile"] = {}
        for kind in KINDS:
            directory = Path(profile_dir) / kind.replace(" ", "-")
            directory.mkdir(parents=True)
            with _worker(app, profile_dir=directory) as (process, destination):
                cpu = _CpuMeter(process.pid)
                for round_number in range(rounds):
                    samples[kind].append(_run_kind(app, destination, kind, tasks, round_number))
                cpu_seconds = cpu.used()
            result["profile"][kind] = {
                "children": [json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))],
                "cpu_seconds": cpu_seconds,
            }
    result["tasks_per_second"] = samples
    return result


def _rotated(kinds: tuple[str, ...], by: int) -> tuple[str, ...]:
    """``kinds`` starting at the ``by``-th: each round begins with another, so none always runs first or after one."""
    by %= len(kinds)
    return kinds[by:] + kinds[:by]


@contextmanager
def _worker(app: Any, *, profile_dir: Path | None = None) -> Iterator[tuple[subprocess.Popen[bytes], list[str]]]:
    """Run the benchmark's worker (prefork, 2 processes); yield it and its name for control commands."""
    env = os.environ.copy()
    include = "bench.tasks"
    if profile_dir is not None:
        env[profiling.DIRECTORY_VARIABLE] = str(profile_dir)
        include += ",bench.profiling"
    worker = subprocess.Popen(
        worker_argv(WORKER_NAME, concurrency=2, queues="bench.idle", tasks=include, log_level="warning"),
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        yield worker, _wait_for_worker(app)
    finally:
        # A warm shutdown: each pool child exits through its exit hook (the profile is written there).
        stop_process(worker, timeout=60)


def _run_kind(app: Any, destination: list[str], kind: str, tasks: int, round_number: int) -> float:
    """Queue ``tasks`` messages of ``kind``, let the worker consume them; return tasks per second."""
    from django.db import connection
    from django_celery_results.models import TaskResult

    from scheduler import dbclock, outbox
    from scheduler.models import Execution
    from scheduler.owners import executions

    queue = f"bench.{round_number}.{kind.replace(' ', '-')}"
    TaskResult.objects.all().delete()
    Execution.objects.all().delete()
    if kind == "guarded":
        rows = Execution.objects.bulk_create(
            Execution(
                idempotency_key=f"bench:{uuid.uuid4()}",
                task="bench.noop",
                queue=queue,
                scheduled_for=dbclock.now(),
                celery_task_id=str(uuid.uuid4()),
            )
            for _ in range(tasks)
        )
        if connection.vendor != "postgresql":  # bulk_create returns ids on PostgreSQL only
            rows = list(Execution.objects.all())
        outbox.publish(app, [executions.message_row(r) for r in rows], now=dbclock.now())
    else:
        name = "bench.noop_plain" if kind == "plain" else "bench.noop"
        with app.producer_or_acquire() as producer:
            for _ in range(tasks):
                app.send_task(name, queue=queue, producer=producer)
    started = time.monotonic()
    app.control.add_consumer(queue, destination=destination, reply=True, timeout=10)
    _wait_for_results(TaskResult, tasks)
    rate = tasks / (time.monotonic() - started)
    app.control.cancel_consumer(queue, destination=destination, reply=True, timeout=10)
    return rate


class _CpuMeter:
    """CPU seconds used, from now on, by the worker, its pool children, the database server and Redis."""

    def __init__(self, worker_pid: int) -> None:
        self._worker_pid = worker_pid
        self._start = self._read()

    def used(self) -> dict[str, float]:
        end = self._read()
        return {
            group: sum(seconds - self._start.get(group, {}).get(pid, 0.0) for pid, seconds in pids.items())
            for group, pids in end.items()
        }

    def _read(self) -> dict[str, dict[int, float]]:
        from django.db import connection

        children = Path(f"/proc/{self._worker_pid}/task/{self._worker_pid}/children").read_text().split()
        groups = {
            "worker main process": [self._worker_pid],
            "pool children": [int(pid) for pid in children],
            "redis-server": [int(_redis().info("server")["process_id"])],
        }
        if connection.vendor == "postgresql":
            # Every process of this cluster but the benchmark's own backend (which polls for results).
            pids = [pid for (pid,) in execute_sql("SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid()")]
            groups["postgresql server"] = pids
        return {group: {pid: _cpu(pid) for pid in pids} for group, pids in groups.items()}


def _cpu(pid: int) -> float:
    try:
        return cpu_seconds(pid)
    except OSError:  # exited meanwhile
        return 0.0


def _redis() -> Any:
    import redis

    return redis.Redis.from_url(os.environ["REDIS_URL"])


def _wait_for_worker(app: Any) -> list[str]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        replies = app.control.ping(timeout=1.0)
        names = [name for reply in replies for name in reply if name.startswith(WORKER_NAME)]
        if names:
            return names
    raise SystemExit("the benchmark worker did not answer a ping within 60 s")


def _wait_for_results(task_result_model: Any, expected: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while task_result_model.objects.filter(status="SUCCESS").count() < expected:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {task_result_model.objects.count()} of {expected} tasks finished in {timeout}s")
        time.sleep(0.02)


# --- the orchestrator -------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000, help="messages per kind and round (default 2000)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; kinds alternate within each (default 2)")
    add_databases_option(parser)
    parser.add_argument("--profile", action="store_true", help="break each task's time down (bench.profiling)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.rounds < 1:
        parser.error("--tasks and --rounds must be at least 1")

    if args.child:
        print(json.dumps(_measure_database(args.tasks, args.rounds, args.profile_dir)), flush=True)
        return 0

    results = []
    load_before = os.getloadavg()
    # Production settings, as a deployed worker runs: DEBUG's query log
    # costs every statement extra work (on SQLite, one more query each).
    with migrated_databases(args.databases, debug=False) as services:
        for database, env in services.environments.items():
            print(
                f"measuring on {database} ({args.tasks} tasks x {len(KINDS)} kinds x {args.rounds} rounds)...",
                flush=True,
            )
            command = child_command(
                "bench.worker_overhead",
                tasks=args.tasks,
                rounds=args.rounds,
                profile_dir=services.scratch / database / "profile" if args.profile else None,
            )
            results.append(run_child(command, env))

    rows, summary = [], []
    for result in results:
        baseline = statistics.median(result["tasks_per_second"]["plain"])
        for kind in KINDS:
            rate = statistics.median(result["tasks_per_second"][kind])
            ratio = rate / baseline
            rows.append([result["vendor"], kind, result["tasks_per_round"] * result["rounds"], rate, ratio])
            summary.append(
                {
                    "database": result["vendor"],
                    "kind": kind,
                    "median_tasks_per_second": rate,
                    "ratio_to_plain": ratio,
                    "samples": result["tasks_per_second"][kind],
                }
            )
    print()
    print(table(["database", "tasks", "runs", "tasks/s (median)", "ratio to plain"], rows))
    # The machine may be shared: the ratios are what count, the load says how far to trust them.
    load_after = os.getloadavg()
    print(f"\nload average (1, 5, 15 min): before {load_before}, after {load_after}")
    goals_met = {}
    for kind, goal in GOALS.items():
        lowest = min(row["ratio_to_plain"] for row in summary if row["kind"] == kind)
        goals_met[kind] = lowest >= goal
        print(f"goal: {kind} / plain >= {goal}; lowest {lowest:.2f} -> {'met' if goals_met[kind] else 'NOT met'}")
    payload = {
        "worker": "celery prefork, concurrency 2, Redis broker, django-db results",
        "goals": GOALS,
        "goals_met": goals_met,
        "results": summary,
        "load_average": {"before": load_before, "after": load_after},
    }
    if args.profile:
        payload["profile"] = _profile_summary(results)
    write_results("worker_overhead_profile" if args.profile else "worker_overhead", payload)
    return 0


def _profile_summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Print and return, per database and kind, milliseconds per task: where the pool child spends them, and CPU."""
    summary = []
    for result in results:
        for kind in KINDS:
            profile = result["profile"][kind]
            children = profile["children"]
            tasks = sum(child["tasks"] for child in children)
            buckets: dict[str, list[float]] = {}
            for child in children:
                for name, seconds in child["seconds"].items():
                    entry = buckets.setdefault(name, [0.0, 0.0, 0.0])
                    entry[0] += seconds
                    entry[1] += child["db_seconds"].get(name, 0.0)
                    entry[2] += child["queries"].get(name, 0)
            between = sum(child["window_seconds"] - child["in_tasks_seconds"] for child in children)
            buckets["between tasks (pool: receive, reply, wait)"] = [between, 0.0, 0.0]
            wall = {name: round(seconds / tasks * 1000, 3) for name, (seconds, _, _) in buckets.items()}
            rows = sorted(
                (
                    [name, seconds / tasks * 1000, db / tasks * 1000, queries / tasks]
                    for name, (seconds, db, queries) in buckets.items()
                ),
                key=lambda row: -row[1],
            )
            rows.append(
                [
                    "total (pool child, per task)",
                    sum(row[1] for row in rows),
                    sum(row[2] for row in rows),
                    sum(row[3] for row in rows),
                ]
            )
            cpu = {group: round(seconds / tasks * 1000, 3) for group, seconds in profile["cpu_seconds"].items()}
            print(f"\n{result['vendor']}, {kind}: {tasks} tasks over {len(children)} pool children")
            print(table(["wall ms per task, by bucket", "ms", "of which in queries", "queries"], rows))
            print(
                "CPU ms per task: "
                + ", ".join(f"{group} {ms:.3f}" for group, ms in cpu.items())
                + f"; total {sum(cpu.values()):.3f}"
            )
            summary.append(
                {
                    "database": result["vendor"],
                    "kind": kind,
                    "tasks": tasks,
                    "wall_ms_per_task": wall,
                    "query_ms_per_task": {
                        name: round(db / tasks * 1000, 3) for name, (_, db, _) in buckets.items() if db
                    },
                    "queries_per_task": {name: round(q / tasks, 3) for name, (_, _, q) in buckets.items() if q},
                    "cpu_ms_per_task": cpu,
                }
            )
    return summary


if __name__ == "__main__":
    sys.exit(main())
