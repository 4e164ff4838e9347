"""A ``/metrics`` scrape with 1M schedules and 10M executions: every query indexed and bounded.

Loads the rows into the benchmark's own PostgreSQL with ``generate_series``
(server side) with the execution tally trigger off, then counts the loaded
rows into the tallies the way migration 0012 does (one increment per row in
one huge transaction would make the load take hours: every increment of a
tally row adds a row version the next one must step over until the
transaction ends). Then ``VACUUM ANALYZE``, then it scrapes
``/metrics`` through Django's test client several times and reports the
median, the slowest, and each query's time in the slowest scrape.

The rows are shaped to make each query work: a twentieth of a second
between slots (so the last hour holds more scheduled sends than the lag
sample reads), 3,000 executions pending, queued or running over five
queues, schedules whose last success is older than their cadence (overdue),
and more schedules than ``SCHEDULER_METRICS_PER_SCHEDULE_LIMIT``.

Run: ``python -m bench.scrape [--schedules 1000000] [--executions 10000000] [--repeat 10]``.
Writes ``bench/results/scrape.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from importlib import import_module
from typing import Any

from bench.common import (
    add_scale_arguments,
    insert_scale_executions,
    insert_scale_schedules,
    measure_at_scale,
    table,
    write_results,
)

GOAL_SECONDS = 0.2
#: Executions still in flight (pending, queued, running), the newest ones.
IN_FLIGHT = 3000


def _load(schedules: int, executions: int) -> dict[str, float]:
    from django.db import connection

    schedule_columns = {
        "paused_reason": "CASE WHEN g % 50 = 1 THEN 'maintenance' ELSE '' END",
        "cadence": "2 * (60 + (g % 600))",
        "last_success_at": "now() - make_interval(secs => g % 2400)",
        # Overdue when the last success is older than the cadence: most of them, the worst case for counting.
        "overdue_at": "now() - make_interval(secs => g % 2400) + make_interval(secs => 2 * (60 + (g % 600)))",
    }
    timings = {"load_schedules_seconds": insert_scale_schedules(schedules, schedule_columns)}
    started = time.monotonic()
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE scheduler_execution DISABLE TRIGGER USER")
    slot = "now() - make_interval(secs => g / 20.0)"
    insert_scale_executions(
        executions,
        schedules,
        {
            "queue": "'queue-' || (g % 5)",
            "trigger": "(ARRAY['scheduled','scheduled','scheduled','scheduled','backfill','manual'])[1 + g % 6]",
            "scheduled_for": slot,
            "status": f"CASE WHEN g <= {IN_FLIGHT} THEN (ARRAY['pending','queued','running'])[1 + g % 3] "
            "ELSE (ARRAY['succeeded','succeeded','succeeded','failed','missed','skipped'])[1 + g % 6] END",
            "enqueued_at": f"{slot} + make_interval(secs => (g % 300) / 100.0)",
            "started_at": f"CASE WHEN g <= {IN_FLIGHT} AND g % 3 <> 2 THEN NULL ELSE {slot} + interval '3 seconds' END",
            "finished_at": f"CASE WHEN g <= {IN_FLIGHT} THEN NULL ELSE {slot} + make_interval(secs => 3 + g % 40) END",
            "created_at": slot,
        },
    )
    with connection.cursor() as cursor:
        for sql in import_module("scheduler.migrations.0012_observability")._seed_sql("postgresql"):
            cursor.execute(sql)
        cursor.execute("ALTER TABLE scheduler_execution ENABLE TRIGGER USER")
    timings["load_executions_seconds"] = time.monotonic() - started
    started = time.monotonic()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")
    timings["vacuum_analyze_seconds"] = time.monotonic() - started
    return timings


def _measure(repeat: int) -> dict[str, Any]:
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    client = Client()
    client.get("/metrics")  # warm the connection and the caches, as a running web process has them
    scrapes = []
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as captured:
            started = time.perf_counter()
            response = client.get("/metrics")
            elapsed = time.perf_counter() - started
        assert response.status_code == 200, response.status_code
        scrapes.append(
            {
                "seconds": elapsed,
                "bytes": len(response.content),
                "queries": [{"seconds": float(q["time"]), "sql": q["sql"][:300]} for q in captured.captured_queries],
            }
        )
    text = response.content.decode()
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    slowest = max(scrapes, key=lambda s: s["seconds"])
    return {
        "median_seconds": statistics.median(s["seconds"] for s in scrapes),
        "max_seconds": slowest["seconds"],
        "samples": [s["seconds"] for s in scrapes],
        "queries_per_scrape": len(slowest["queries"]),
        "slowest_scrape_queries": sorted(slowest["queries"], key=lambda q: -q["seconds"]),
        "series": len(samples),
        "overdue": next((line for line in samples if line.startswith("scheduler_schedules_overdue ")), ""),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_scale_arguments(parser, repeat=10, repeat_help="scrapes measured (median reported)")
    args = parser.parse_args(argv)
    if min(args.schedules, args.executions, args.repeat) < 1 or args.executions <= IN_FLIGHT:
        parser.error(f"--schedules and --repeat must be at least 1, --executions more than {IN_FLIGHT}")

    if args.child:
        import django

        django.setup()
        loading = _load(args.schedules, args.executions)
        print(json.dumps({"loading": loading, **_measure(args.repeat)}), flush=True)
        return 0

    load_before = os.getloadavg()
    result = measure_at_scale("bench.scrape", args.schedules, args.executions, args.repeat)
    load_after = os.getloadavg()
    rows = [[f"{q['seconds'] * 1000:.1f}", q["sql"][:110]] for q in result["slowest_scrape_queries"]]
    print()
    print(table(["ms", "query (slowest scrape)"], rows))
    loading = result["loading"]
    met = result["median_seconds"] < GOAL_SECONDS
    print(
        f"\nloaded in {loading['load_schedules_seconds']:.0f}s + {loading['load_executions_seconds']:.0f}s "
        f"(+ {loading['vacuum_analyze_seconds']:.0f}s VACUUM ANALYZE); load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after\n{result['queries_per_scrape']} queries, {result['series']} series; "
        f"scrape median {result['median_seconds'] * 1000:.1f} ms, max {result['max_seconds'] * 1000:.1f} ms; "
        f"goal under {GOAL_SECONDS * 1000:.0f} ms -> {'met' if met else 'NOT met'}"
    )
    write_results(
        "scrape",
        {
            "schedules": args.schedules,
            "executions": args.executions,
            "database": "PostgreSQL 15 (benchmark cluster, fsync off)",
            "goal_seconds": GOAL_SECONDS,
            "load_average_before": load_before,
            "load_average_after": load_after,
            **result,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
