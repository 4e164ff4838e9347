"""Tally cost: what counting every final execution for ``/metrics`` adds to the worker's outcome write.

A trigger on the execution table appends one ``TallyIncrement`` row in the
statement that makes an execution final (``scheduler.models.tally``). In
this process (no worker, no broker), ``executions.finish`` records the
success of N running executions, one statement each as a worker's guard
does, in blocks of ``--executions``: with the triggers, then with them
off (PostgreSQL: ``DISABLE TRIGGER``; SQLite, which cannot: dropped and
created again from their own SQL), alternating for ``--rounds`` rounds,
on each database.

Reported per database: the median wall time of one outcome write with and
without the tally, the median of each round's difference between the two,
and the same for this process's CPU (on
PostgreSQL the trigger runs in the server: its cost is in the wall time,
not this process's CPU).

Run: ``python -m bench.tally_cost [--executions 2000] [--rounds 5] [--databases postgresql,sqlite]``
(it starts its own PostgreSQL). Writes ``bench/results/tally_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from typing import Any

from bench.common import (
    add_databases_option,
    child_command,
    execute_sql,
    migrated_databases,
    print_load,
    run_child,
    table,
    write_results,
)

TRIGGERS = ("scheduler_execution_tally_insert", "scheduler_execution_tally_update")
VARIANTS = ("with the tally", "without")


# --- inside one database's child process ------------------------------------------------


def _running(count: int) -> list[Any]:
    """Insert ``count`` ad-hoc executions already running (attempt 1); return their claims."""
    from django.db import connection

    from scheduler import dbclock
    from scheduler.models import Execution
    from scheduler.owners.executions import Claim

    Execution.objects.all().delete()
    now = dbclock.now()
    Execution.objects.bulk_create(
        (
            Execution(
                idempotency_key=f"bench:{uuid.uuid4()}",
                task="bench.noop",
                scheduled_for=now,
                celery_task_id=str(uuid.uuid4()),
                status=Execution.Status.RUNNING,
                attempt=1,
                started_at=now,
            )
            for _ in range(count)
        ),
        batch_size=1000,
    )
    if connection.vendor == "postgresql":
        # Each block starts from the same state: the last one's dead rows are
        # not left for an autovacuum to meet in the middle of a timed block.
        execute_sql("VACUUM ANALYZE scheduler_execution")
        execute_sql("VACUUM ANALYZE scheduler_tallyincrement")
    return [Claim(pk, 1, None, now) for pk in Execution.objects.values_list("pk", flat=True)]


def _triggers_off(vendor: str) -> list[str]:
    """Turn the tally triggers off; return the statements that turn them on again."""
    if vendor == "postgresql":
        for name in TRIGGERS:
            execute_sql(f"ALTER TABLE scheduler_execution DISABLE TRIGGER {name}")
        return [f"ALTER TABLE scheduler_execution ENABLE TRIGGER {name}" for name in TRIGGERS]
    placeholders = ", ".join("%s" for _ in TRIGGERS)
    creates = [sql for (sql,) in execute_sql(f"SELECT sql FROM sqlite_master WHERE name IN ({placeholders})", TRIGGERS)]
    if len(creates) != len(TRIGGERS):
        raise SystemExit(f"expected the triggers {TRIGGERS} on scheduler_execution, found {len(creates)}")
    for name in TRIGGERS:
        execute_sql(f"DROP TRIGGER {name}")
    return creates


def _block(count: int, tallied: bool, vendor: str) -> tuple[float, float]:
    """Finish ``count`` running executions one by one; return (wall µs, CPU µs) per outcome write."""
    from scheduler.models import Execution
    from scheduler.models.tally import TallyIncrement
    from scheduler.owners import executions

    claims = _running(count)
    increments = TallyIncrement.objects.count()
    restore = [] if tallied else _triggers_off(vendor)
    try:
        started, cpu_started = time.perf_counter(), time.process_time()
        for claim in claims:
            executions.finish(claim, status=Execution.Status.SUCCEEDED)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    finally:
        for sql in restore:
            execute_sql(sql)
    counted = TallyIncrement.objects.count() - increments
    if counted != (count if tallied else 0):
        raise SystemExit(
            f"{counted} increments appended for {count} outcomes {'with' if tallied else 'without'} the tally"
        )
    return wall / count * 1e6, cpu / count * 1e6


def _measure_database(count: int, rounds: int) -> dict[str, Any]:
    import django

    django.setup()
    from django.db import connection

    _block(min(count, 200), True, connection.vendor)  # warm: connection, compiled statements, caches
    samples: dict[str, dict[str, list[float]]] = {variant: {"wall_us": [], "cpu_us": []} for variant in VARIANTS}
    for round_number in range(rounds):
        order = VARIANTS if round_number % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            wall, cpu = _block(count, variant == VARIANTS[0], connection.vendor)
            samples[variant]["wall_us"].append(wall)
            samples[variant]["cpu_us"].append(cpu)
    return {"vendor": connection.vendor, "executions_per_block": count, "rounds": rounds, "samples": samples}


# --- the orchestrator -------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--executions", type=int, default=2000, help="outcome writes per block (default 2000)")
    parser.add_argument("--rounds", type=int, default=5, help="blocks of each variant, alternating (default 5)")
    add_databases_option(parser)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.executions < 1 or args.rounds < 1:
        parser.error("--executions and --rounds must be at least 1")

    if args.child:
        print(json.dumps(_measure_database(args.executions, args.rounds)), flush=True)
        return 0

    results = []
    # The production settings: no query log, as a deployed worker runs.
    with migrated_databases(args.databases, broker=False, debug=False) as services:
        for database, env in services.environments.items():
            print(
                f"measuring on {database} ({args.rounds} rounds of {args.executions} outcomes each way)...", flush=True
            )
            command = child_command("bench.tally_cost", executions=args.executions, rounds=args.rounds)
            results.append(run_child(command, env))

    rows = []
    for result in results:
        result["medians"] = {}
        for measure, label in (("wall_us", "wall µs"), ("cpu_us", "CPU µs (this process)")):
            tallied, plain = (result["samples"][variant][measure] for variant in VARIANTS)
            # Each round's two blocks ran back to back: their difference is
            # the tally's, whatever the machine did between rounds.
            extra = statistics.median(with_ - without for with_, without in zip(tallied, plain, strict=True))
            medians = statistics.median(tallied), statistics.median(plain)
            result["medians"][measure] = {"with": medians[0], "without": medians[1], "tally_adds": extra}
            rows.append([result["vendor"], label, *medians, extra, extra / medians[1] * 100])
    print()
    print(table(["database", "per outcome write", *VARIANTS, "tally adds (paired)", "%"], rows))
    load = print_load()
    write_results("tally_cost", {"load_average": load, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
