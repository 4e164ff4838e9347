"""Admin at scale: list, filter, search and change pages with 1M schedules and 10M executions.

Loads the rows into the benchmark's own PostgreSQL with ``generate_series``
(server side, so loading takes minutes, not hours), runs ``VACUUM ANALYZE``,
then renders each admin page through Django's test client as a logged-in
superuser and reports the median of several renders.

Run: ``python -m bench.admin_scale [--schedules 1000000] [--executions 10000000] [--repeat 5]``.
Writes ``bench/results/admin_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from bench.common import (
    add_scale_arguments,
    insert_scale_executions,
    insert_scale_schedules,
    measure_at_scale,
    table,
    write_results,
)

GOAL_SECONDS = 1.0


def _load(schedules: int, executions: int) -> dict[str, float]:
    from django.db import connection

    timings = {"load_schedules_seconds": insert_scale_schedules(schedules, {"tenant": "'tenant-' || (g % 100)"})}
    started = time.monotonic()
    insert_scale_executions(
        executions,
        schedules,
        {
            "scheduled_for": "now() - make_interval(secs => g)",
            "status": "(ARRAY['succeeded','succeeded','succeeded','failed','missed','skipped'])[1 + g % 6]",
            "started_at": "now() - make_interval(secs => g)",
            "finished_at": "now() - make_interval(secs => g) + interval '1 second'",
            "created_at": "now() - make_interval(secs => g)",
        },
    )
    timings["load_executions_seconds"] = time.monotonic() - started
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")
    return timings


def _measure(repeat: int) -> list[dict[str, Any]]:
    from django.contrib.auth import get_user_model
    from django.db import connection, reset_queries
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from scheduler.models import Execution, Schedule
    from scheduler.web.admin import ScheduleAdmin

    # The admin's ?o= counts the list's columns from 0, its action checkbox first.
    column = {name: 1 + index for index, name in enumerate(ScheduleAdmin.list_display)}
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("bench", "bench@example.invalid", "pw"))
    schedule = Schedule.objects.order_by("id")[Schedule.objects.count() // 2]
    execution = (
        Execution.objects.filter(schedule=schedule).order_by("-scheduled_for").first() or Execution.objects.first()
    )
    pages = {
        "overview (the scheduler section)": "/admin/scheduler/",
        "schedule list": "/admin/scheduler/schedule/",
        "schedule list, page 100": "/admin/scheduler/schedule/?p=100",
        "schedule list, sorted by next run": f"/admin/scheduler/schedule/?o={column['next_run']}",
        "schedule list, sorted by time zone": f"/admin/scheduler/schedule/?o={column['timezone']}",
        "schedule filter: state=paused": "/admin/scheduler/schedule/?state=paused",
        "schedule filter: last status=failed": "/admin/scheduler/schedule/?last_status=failed",
        "schedule filter: task": "/admin/scheduler/schedule/?task=app.task_7",
        "schedule search: name": f"/admin/scheduler/schedule/?q={schedule.name}",
        "schedule change page": f"/admin/scheduler/schedule/{schedule.pk}/change/",
        "execution list": "/admin/scheduler/execution/",
        "execution filter: status=failed": "/admin/scheduler/execution/?status__exact=failed",
        "execution filter: schedule": f"/admin/scheduler/execution/?schedule__id__exact={schedule.pk}",
        "execution filter: past 7 days": "/admin/scheduler/execution/?scheduled_for__gte="
        + time.strftime("%Y-%m-%dT00:00:00%%2B00:00", time.gmtime(time.time() - 7 * 86400)),
        "execution search: idempotency key": f"/admin/scheduler/execution/?q=bench:{execution.idempotency_key.split(':')[-1] if execution else 1}",
        "execution change page": f"/admin/scheduler/execution/{execution.pk}/change/",
        "cluster page": "/admin/scheduler/lease/",
    }
    results = []
    for label, url in pages.items():
        samples = []
        status = 0
        queries = 0
        for _ in range(repeat):
            reset_queries()
            with CaptureQueriesContext(connection) as captured:
                started = time.perf_counter()
                response = client.get(url)
                samples.append(time.perf_counter() - started)
            status, queries = response.status_code, len(captured)
        results.append(
            {
                "page": label,
                "url": url,
                "status": status,
                "queries": queries,
                "median_seconds": statistics.median(samples),
                "max_seconds": max(samples),
                "samples": samples,
            }
        )
        print(f"  {label}: {statistics.median(samples):.3f}s", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_scale_arguments(parser, repeat=5, repeat_help="renders per page (median reported)")
    args = parser.parse_args(argv)
    if min(args.schedules, args.executions, args.repeat) < 1:
        parser.error("--schedules, --executions and --repeat must be at least 1")

    if args.child:
        import django

        django.setup()
        loading = _load(args.schedules, args.executions)
        print(json.dumps({"loading": loading, "pages": _measure(args.repeat)}), flush=True)
        return 0

    result = measure_at_scale("bench.admin_scale", args.schedules, args.executions, args.repeat)
    rows = [[p["page"], p["status"], p["queries"], p["median_seconds"], p["max_seconds"]] for p in result["pages"]]
    print()
    print(table(["page", "status", "queries", "median s", "max s"], rows))
    slowest = max(p["median_seconds"] for p in result["pages"])
    if any(p["status"] != 200 for p in result["pages"]):
        print("\nsome pages did not answer 200; see the status column")
    print(
        f"\nloaded in {result['loading']['load_schedules_seconds']:.0f}s + {result['loading']['load_executions_seconds']:.0f}s; "
        f"goal: every page well under {GOAL_SECONDS:.0f}s; slowest median {slowest:.3f}s -> "
        f"{'met' if slowest < GOAL_SECONDS and all(p['status'] == 200 for p in result['pages']) else 'NOT met'}"
    )
    write_results(
        "admin_scale",
        {
            "schedules": args.schedules,
            "executions": args.executions,
            "database": "PostgreSQL 15 (benchmark cluster, fsync off)",
            "goal_seconds": GOAL_SECONDS,
            "slowest_median_seconds": slowest,
            **result,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
