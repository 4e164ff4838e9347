"""Commit cost: what the leader's dispatch transaction costs per execution, by kind of schedule.

In this process (no beat, no broker), ``dispatch.dispatch_due`` commits N
schedules that are all due at one instant, pass after pass until none is
left, on each database. Kinds:

- ``interval``: hourly schedules; each advances to its next slot,
- ``one-off``: ``run_at`` schedules; each fires once and turns itself off,
- ``max_runs``: hourly schedules with ``max_runs=1``; each turns itself off too.

Reported per kind and database: the wall time of all passes and, per
execution, the wall time and this process's CPU time (µs; the database
server's own CPU is not in it). Only the commit is measured: nothing is
published. ``--profile`` also prints, for each kind, the functions with the
most own time and the project's own functions with the most time including
what they call (the profiler inflates both times: compare runs without it).

Run: ``python -m bench.commit_cost [--schedules 10000] [--databases postgresql,sqlite]
[--kinds interval,one-off,max_runs] [--profile]`` (it starts its own PostgreSQL).
Writes ``bench/results/commit_cost.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from datetime import timedelta
from typing import Any

from bench.common import (
    ROOT,
    add_databases_option,
    child_command,
    migrated_databases,
    print_load,
    run_child,
    table,
    write_results,
)

KINDS = ("interval", "one-off", "max_runs")
HOTSPOTS = 12


# --- inside one database's child process ------------------------------------------------


def _load(kind: str, count: int) -> None:
    """Insert ``count`` schedules of ``kind``, all due one second ago (database clock)."""
    from scheduler import dbclock
    from scheduler.models import Execution, Schedule

    Execution.objects.all().delete()
    Schedule.objects.all().delete()
    due = dbclock.now() - timedelta(seconds=1)
    # Interval slots are start_at + k * interval: starting at ``due`` makes ``due`` a slot.
    timing: dict[str, Any] = {"run_at": due} if kind == "one-off" else {"interval": 3600, "start_at": due}
    if kind == "max_runs":
        timing["max_runs"] = 1
    # bulk_create skips save(): next_run_at is set here, as save() would.
    Schedule.objects.bulk_create(
        (
            Schedule(name=f"bench-{kind}-{number}", task="bench.noop", next_run_at=due, **timing)
            for number in range(count)
        ),
        batch_size=1000,
    )


def _measure_kind(kind: str, count: int, *, profile: bool) -> dict[str, Any]:
    from scheduler.beat import dispatch
    from scheduler.models import Execution
    from scheduler.owners import leases

    _load(kind, count)
    lease = leases.acquire("beat", "bench-commit", ttl=600)
    assert lease is not None
    profiler = cProfile.Profile() if profile else None
    passes = 0
    started, cpu_started = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    while True:
        report = dispatch.dispatch_due(lease)
        passes += 1
        if not report.more:
            break
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    leases.release(lease)
    executions = Execution.objects.count()
    if executions != count:
        raise SystemExit(f"{kind}: {executions} executions committed for {count} due schedules")
    result: dict[str, Any] = {
        "kind": kind,
        "executions": executions,
        "passes": passes,
        "seconds": seconds,
        "us_per_execution": seconds / executions * 1e6,
        "cpu_us_per_execution": cpu_seconds / executions * 1e6,
    }
    if profiler:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(HOTSPOTS)
        stats.sort_stats("cumulative").print_stats(str(ROOT / "scheduler"), HOTSPOTS)
        result["profile"] = out.getvalue()
    return result


def _measure_database(count: int, kinds: list[str], profile: bool) -> dict[str, Any]:
    import django

    django.setup()
    from django.db import connection

    return {"vendor": connection.vendor, "kinds": [_measure_kind(kind, count, profile=profile) for kind in kinds]}


# --- the orchestrator -------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=10_000, help="due schedules per kind (default 10000)")
    add_databases_option(parser)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated: {', '.join(KINDS)}")
    parser.add_argument("--profile", action="store_true", help="print the hot spots of each kind")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.schedules < 1:
        parser.error("--schedules must be at least 1")
    kinds = [name.strip() for name in args.kinds.split(",") if name.strip()]
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds takes {', '.join(KINDS)}")

    if args.child:
        print(json.dumps(_measure_database(args.schedules, kinds, args.profile)), flush=True)
        return 0

    results = []
    # The production settings: no query log, as a deployed beat runs.
    with migrated_databases(args.databases, broker=False, debug=False) as services:
        for database, env in services.environments.items():
            print(f"measuring on {database} ({args.schedules} due schedules x {len(kinds)} kinds)...", flush=True)
            command = child_command(
                "bench.commit_cost", schedules=args.schedules, kinds=",".join(kinds), profile=args.profile
            )
            results.append(run_child(command, env))

    rows = []
    for result in results:
        for kind in result["kinds"]:
            rows.append(
                [
                    result["vendor"],
                    kind["kind"],
                    kind["executions"],
                    kind["passes"],
                    kind["seconds"],
                    kind["us_per_execution"],
                    kind["cpu_us_per_execution"],
                ]
            )
            if "profile" in kind:
                print(f"\n--- {result['vendor']}, {kind['kind']}: most own time ---\n{kind.pop('profile')}")
    print()
    print(table(["database", "kind", "executions", "passes", "seconds", "µs/execution", "CPU µs/execution"], rows))
    load = print_load()
    write_results("commit_cost", {"load_average": load, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
