"""Worker overhead: no-op tasks per second with the execution guard vs plain Celery.

One worker (prefork, 2 processes) serves both kinds of task in the same run.
For each round and kind, N messages wait in a queue the worker does not
consume yet; the clock starts when the worker is told to consume it and stops
when the last result is stored. Kinds:

- ``plain``: a task on Celery's own ``Task`` base (the baseline),
- ``guarded``: executions recorded first (as the beat and ``submit()`` do),
  each claimed and finished by the guard,
- ``guarded ad-hoc``: a guarded task sent the plain Celery way, so the worker
  also records the Execution row.

Run: ``python -m bench.worker_overhead [--tasks 2000] [--rounds 2] [--databases postgresql,sqlite]``
(it starts its own PostgreSQL and Redis). Writes ``bench/results/worker_overhead.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import ROOT, django_env, migrate, table, write_results

KINDS = ("plain", "guarded", "guarded ad-hoc")
WORKER_NAME = "bench-worker"
GOAL_RATIO = 0.8


# --- inside one database's child process ------------------------------------------------


def _measure_database(tasks: int, rounds: int) -> dict[str, Any]:
    import django

    django.setup()
    from django.db import connection
    from django_celery_results.models import TaskResult

    from project.celery import app
    from scheduler import dispatch, executions, leases
    from scheduler.models import Execution

    worker = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("celery")), "-A", "project", "worker", "-P", "prefork", "-c", "2",
            "-n", f"{WORKER_NAME}@%h", "-Q", "bench.idle", "--include", "bench.tasks", "-l", "warning",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ],
        cwd=ROOT,
        env=os.environ.copy(),
        start_new_session=True,
    )
    try:
        destination = _wait_for_worker(app)
        samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for round_number in range(rounds):
            for kind in KINDS:
                queue = f"bench.{round_number}.{kind.replace(' ', '-')}"
                TaskResult.objects.all().delete()
                Execution.objects.all().delete()
                if kind == "guarded":
                    rows = Execution.objects.bulk_create(
                        Execution(
                            idempotency_key=f"bench:{uuid.uuid4()}", task="bench.noop", queue=queue,
                            scheduled_for=leases.db_now(), celery_task_id=str(uuid.uuid4()),
                        )
                        for _ in range(tasks)
                    )
                    if connection.vendor != "postgresql":  # bulk_create returns ids on PostgreSQL only
                        rows = list(Execution.objects.all())
                    dispatch.publish(app, [executions.message_row(r) for r in rows], now=leases.db_now())
                else:
                    name = "bench.noop_plain" if kind == "plain" else "bench.noop"
                    with app.producer_or_acquire() as producer:
                        for _ in range(tasks):
                            app.send_task(name, queue=queue, producer=producer)
                started = time.monotonic()
                app.control.add_consumer(queue, destination=destination, reply=True, timeout=10)
                _wait_for_results(TaskResult, tasks)
                samples[kind].append(tasks / (time.monotonic() - started))
                app.control.cancel_consumer(queue, destination=destination, reply=True, timeout=10)
        return {"vendor": connection.vendor, "tasks_per_round": tasks, "rounds": rounds, "tasks_per_second": samples}
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, 9)


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
    parser.add_argument("--databases", default="postgresql,sqlite", help="comma-separated: postgresql, sqlite")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.rounds < 1:
        parser.error("--tasks and --rounds must be at least 1")
    databases = [name.strip() for name in args.databases.split(",") if name.strip()]
    if not databases or set(databases) - {"postgresql", "sqlite"}:
        parser.error("--databases takes postgresql and/or sqlite")

    if args.child:
        print(json.dumps(_measure_database(args.tasks, args.rounds)), flush=True)
        return 0

    from tests.services import postgres_cluster, redis_server

    results = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp, redis_server() as redis_url, postgres_cluster() as pg_url:
        for database in databases:
            var_dir = Path(tmp) / database
            url = pg_url if database == "postgresql" else f"sqlite:///{var_dir / 'bench.sqlite3'}"
            env = django_env(url, redis_url, var_dir)
            migrate(env)
            print(f"measuring on {database} ({args.tasks} tasks x {len(KINDS)} kinds x {args.rounds} rounds)...", flush=True)
            child = subprocess.run(
                [sys.executable, "-m", "bench.worker_overhead", "--child", f"--tasks={args.tasks}", f"--rounds={args.rounds}"],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, check=True,
            )
            results.append(json.loads(child.stdout.strip().splitlines()[-1]))

    rows, summary = [], []
    for result in results:
        baseline = statistics.median(result["tasks_per_second"]["plain"])
        for kind in KINDS:
            rate = statistics.median(result["tasks_per_second"][kind])
            ratio = rate / baseline
            rows.append([result["vendor"], kind, result["tasks_per_round"] * result["rounds"], rate, ratio])
            summary.append({"database": result["vendor"], "kind": kind, "median_tasks_per_second": rate,
                            "ratio_to_plain": ratio, "samples": result["tasks_per_second"][kind]})
    print()
    print(table(["database", "tasks", "runs", "tasks/s (median)", "ratio to plain"], rows))
    guarded = [row for row in summary if row["kind"] != "plain"]
    worst = min(row["ratio_to_plain"] for row in guarded)
    # The machine may be shared: the ratios are what count, the load says how far to trust them.
    load_after = os.getloadavg()
    print(f"\nload average (1, 5, 15 min): before {load_before}, after {load_after}")
    print(f"goal: guarded / plain >= {GOAL_RATIO}; lowest measured ratio {worst:.2f} -> {'met' if worst >= GOAL_RATIO else 'NOT met'}")
    path = write_results(
        "worker_overhead",
        {"worker": "celery prefork, concurrency 2, Redis broker, django-db results",
         "goal_ratio": GOAL_RATIO, "lowest_ratio": worst, "results": summary,
         "load_average": {"before": load_before, "after": load_after}},
    )
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
