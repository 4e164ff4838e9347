"""Tick cost vs backlog depth: one dispatch pass for 500 minute crons 1 hour, 1 day and 30 days behind.

For each depth, 500 ``* * * * *`` schedules (default catch-up window 300 s,
``misfire=run_all``) are loaded server side into the benchmark's own
PostgreSQL with ``next_run_at`` that far in the past. A lease is taken and
``dispatch.dispatch_due`` runs in this process, as the leader's tick runs it:

- first pass: CPU ms of this process (``time.process_time``), SQL
  statements (``CaptureQueriesContext``), the longest transaction it held
  (the lease row stays locked that long; the beat's PostgreSQL sessions are
  ended after one lease TTL, 10 s, idle in a transaction), the schedules it
  committed and the execution rows it wrote;
- drain: passes until no schedule is due any more, their total CPU and the
  longest transaction over all of them.

Each pass plans at most ``dispatch.PLAN_BUDGET`` slot computations for
backlog schedules and records at most 100 ``missed`` rows per schedule
(the rest are counted), so a pass costs the same however far behind.

Run: ``python -m bench.tick_backlog [--schedules 500]``. Writes ``bench/results/tick_backlog.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    execute_sql,
    insert_generated,
    log_to_file,
    measure_in_child,
    table,
    write_results,
)

DEPTHS = (("1 hour", 3600), ("1 day", 86_400), ("30 days", 30 * 86_400))
#: Largest ratio of a first-pass measure (CPU, statements, longest transaction) between the deepest
#: and the shallowest backlog still called flat.
FLAT_RATIO = 1.5
TASK = "bench.noop"


# --- inside the child process (Django configured) ----------------------------------------


def _load(count: int, seconds_behind: int) -> None:
    from scheduler.models import Schedule

    execute_sql("TRUNCATE scheduler_execution, scheduler_schedule, scheduler_lease CASCADE")
    behind = f"date_trunc('minute', now()) - interval '{seconds_behind} seconds'"
    insert_generated(
        Schedule,
        count,
        {
            "name": "'behind-' || g",
            "task": f"'{TASK}'",
            "cron": "'* * * * *'",
            "next_run_at": behind,
            "created_at": "now()",
            "updated_at": "now()",
        },
    )
    execute_sql("VACUUM ANALYZE scheduler_schedule")


def _pass(lease: Any) -> dict[str, Any]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from scheduler.beat import dispatch
    from scheduler.models import Execution

    rows_before = Execution.objects.count()
    cpu, wall = time.process_time(), time.perf_counter()
    with CaptureQueriesContext(connection) as queries:
        report = dispatch.dispatch_due(lease)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {
        "cpu_ms": cpu * 1000,
        "wall_ms": wall * 1000,
        "statements": len(queries),
        "transactions": report.transactions,
        "longest_transaction_ms": report.longest_transaction_seconds * 1000,
        "schedules": report.schedules,
        "rows": Execution.objects.count() - rows_before,
        "more": report.more,
    }


def _depth(label: str, seconds_behind: int, count: int) -> dict[str, Any]:
    from scheduler import dbclock
    from scheduler.models import Schedule
    from scheduler.owners import leases

    _load(count, seconds_behind)
    lease = leases.acquire("beat", "bench", ttl=60)
    assert lease is not None
    passes = [_pass(lease)]
    while Schedule.objects.due(now=dbclock.now()).exists() and len(passes) < 1000:
        passes.append(_pass(lease))
    missed = sum(Schedule.objects.values_list("total_missed", flat=True))
    return {
        "depth": label,
        "seconds_behind": seconds_behind,
        "schedules": count,
        "first_pass": passes[0],
        "drain_passes": len(passes),
        "drain_cpu_seconds": sum(p["cpu_ms"] for p in passes) / 1000,
        "drain_longest_transaction_ms": max(p["longest_transaction_ms"] for p in passes),
        "drain_statements": sum(p["statements"] for p in passes),
        "total_missed": missed,
    }


def _child(count: int, logs: Path) -> dict[str, Any]:
    import django

    django.setup()
    log_to_file(logs / "in-process.log")
    runs = []
    for label, seconds in DEPTHS:
        print(f"{count:,} schedules {label} behind...", file=sys.stderr, flush=True)
        runs.append(_depth(label, seconds, count))
    return {"runs": runs}


# --- the orchestrator ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=500, help="minute crons behind (default 500)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--logs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.schedules < 1:
        parser.error("--schedules must be positive")

    if args.child:
        print(json.dumps(_child(args.schedules, Path(args.logs))), flush=True)
        return 0

    started = time.monotonic()
    result = measure_in_child("bench.tick_backlog", schedules=args.schedules)

    rows = []
    for run in result["runs"]:
        first = run["first_pass"]
        rows.append(
            [
                run["depth"],
                first["schedules"],
                first["cpu_ms"],
                first["cpu_ms"] / max(first["schedules"], 1),
                first["statements"],
                first["longest_transaction_ms"],
                first["rows"],
                run["drain_passes"],
                run["drain_cpu_seconds"],
                run["drain_longest_transaction_ms"],
                run["total_missed"],
            ]
        )
    print()
    print(
        table(
            [
                "behind",
                "schedules/pass",
                "pass CPU ms",
                "CPU ms/schedule",
                "statements",
                "longest tx ms",
                "rows/pass",
                "passes to drain",
                "drain CPU s",
                "drain longest tx ms",
                "missed counted",
            ],
            rows,
        )
    )
    first, deepest = result["runs"][0]["first_pass"], result["runs"][-1]["first_pass"]
    measures = ("cpu_ms", "statements", "longest_transaction_ms")
    flat = all(deepest[measure] <= FLAT_RATIO * first[measure] for measure in measures)
    print(
        f"\none pass {DEPTHS[-1][0]} behind vs {DEPTHS[0][0]} behind: {deepest['cpu_ms']:,.0f} vs {first['cpu_ms']:,.0f} "
        f"CPU ms, {deepest['statements']} vs {first['statements']} statements, longest transaction "
        f"{deepest['longest_transaction_ms']:,.0f} vs {first['longest_transaction_ms']:,.0f} ms "
        f"-> {'flat' if flat else 'NOT flat'} (none more than {FLAT_RATIO}x)"
    )
    print(f"\nran in {time.monotonic() - started:.0f}s")
    write_results(
        "tick_backlog",
        {
            "database": "PostgreSQL (benchmark cluster, fsync off)",
            "flat_ratio": FLAT_RATIO,
            "flat": flat,
            **result,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
