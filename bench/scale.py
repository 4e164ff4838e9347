"""Tick cost vs total schedules: leader CPU, peak RSS, queries per tick and dispatch lag, 1k to 1M schedules.

For each size N, N enabled schedules are loaded server side
(``generate_series``) into the benchmark's own PostgreSQL: 50 fire every
second (``interval=1``), the other N - 50 once a week with their next slot at
least a week away. One real ``celery -A project beat`` (the leader) runs
against it and the benchmark's own Redis; no worker runs, so every message
stays in the Redis queue. Once its first message is in Redis and after a
2 s warm-up, a window of ``--window`` seconds measures:

- CPU s/min: user + system CPU of the beat process (``/proc/<pid>/stat``)
  over the window, per minute;
- peak RSS: ``VmHWM`` of the beat process at the end of the window;
- DB xacts/s: transactions committed or rolled back in the database over the
  window (``pg_stat_database``); the beat is its only client then;
- msgs/s: messages added to the Redis queue over the window;
- lag p50/p99/max, over the slots due in the window: ``enqueued_at -
  scheduled_for`` of their Execution rows (``enqueued_at`` is the database
  clock read just before the batch is sent); a slot still unsent at the
  window's end counts with its lag so far (a lower bound; "unsent at end").
  The JSON also has, per slot, how late its rows were built (``created_at``,
  set when the leader builds the row in memory) and the five slowest slots;
- queries/tick and tick ms: after the beat stopped, in this benchmark's own
  process, ticks of a ``LeaderScheduler`` that each dispatch the 50 slots of
  one second (no lease renewal or heartbeat in them, nor the sleep until the
  next slot that a PostgreSQL leader spends inside its tick), counted with
  Django's ``CaptureQueriesContext``; median of 5.

The beat runs with the project's defaults: it logs every fire at INFO (to a
file) and runs its reconcile pass every 60 s, which falls inside a 60 s window.

The same sizes run with django-celery-beat's ``DatabaseScheduler`` on the same
PostgreSQL and Redis, from ``bench/.venv-peers``: ``PeriodicTask`` rows loaded
the same way (50 with an every-second interval, the others every 7 days, all
last run at load time). Its lag comes from its log: celery beat logs "Sending
due task" (millisecond timestamps) right before it sends, and an interval
entry is due one interval after its previous send (celery sets
``last_run_at`` when it sends), so lag = gap between two sends of an entry
minus 1 s (the first send after loading counts from the loaded ``last_run_at``;
an entry due and unsent at the window's end counts with its lag so far).
Its queries per tick are not counted (a tick in process would read
every row again); DB xacts/s stands in. A run whose first message is not out
within ``--cap`` seconds (the peer's startup reads every row) is reported as
did not finish, with the memory it had reached.

Run: ``python -m bench.scale [--sizes 1000,100000,1000000] [--window 60] [--skip-peers] [--cap 300]``.
Writes ``bench/results/scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    cpu_seconds,
    execute_sql,
    insert_generated,
    log_to_file,
    migrate,
    migrated_services,
    peak_rss_mib,
    peers_python,
    percentile,
    progress,
    run_child,
    stop_process,
    table,
    write_results,
)

SIZES = (1_000, 100_000, 1_000_000)
DUE_PER_SECOND = 50
WARMUP_SECONDS = 2.0
GOAL_P99_MS = 250.0
#: Largest CPU-per-minute ratio between the biggest and the smallest size still called flat.
FLAT_RATIO = 1.5
QUEUE = "celery"
TASK = "bench.noop"
WEEK = 7 * 86400
KINDS = ("ours", "peer")
LABELS = {"ours": "this project (LeaderScheduler)", "peer": "django-celery-beat (DatabaseScheduler)"}


# --- inside a child process (Django configured) -----------------------------------------


def _load_ours(total: int) -> None:
    from scheduler.models import Schedule

    far = f"to_timestamp((floor(extract(epoch from now()) / {WEEK}) + 2) * {WEEK})"  # a weekly slot, >= 1 week away
    for prefix, count, interval in (("idle", total - DUE_PER_SECOND, WEEK), ("due", DUE_PER_SECOND, 1)):
        insert_generated(
            Schedule,
            count,
            {
                "name": f"'{prefix}-' || g",
                "task": f"'{TASK}'",
                "interval": str(interval),
                "next_run_at": far,
                "created_at": "now()",
                "updated_at": "now()",
            },
        )
    execute_sql("VACUUM ANALYZE scheduler_schedule")


def _arm_ours() -> None:
    """Make the every-second schedules due from the next whole second on."""
    execute_sql(
        "UPDATE scheduler_schedule SET next_run_at = date_trunc('second', now()) + interval '1 second', "
        "created_at = date_trunc('second', now()) WHERE name LIKE 'due-%'"
    )


def _load_peer(total: int) -> float:
    """Load the peer's rows; return when the every-second ones last ran (Unix time)."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every = {
        "idle": IntervalSchedule.objects.create(every=7, period=IntervalSchedule.DAYS),
        "due": IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS),
    }
    for prefix, count in (("idle", total - DUE_PER_SECOND), ("due", DUE_PER_SECOND)):
        insert_generated(
            PeriodicTask,
            count,
            {
                "name": f"'{prefix}-' || g",
                "task": f"'{TASK}'",
                "interval_id": str(every[prefix].pk),
                "last_run_at": "now()",
                "date_changed": "now()",
            },
        )
    execute_sql("VACUUM ANALYZE django_celery_beat_periodictask")
    return PeriodicTask.objects.get(name="due-1").last_run_at.timestamp()


def _db_xacts() -> int:
    return int(
        execute_sql("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()")[0][0]
    )


def _run_beat(command: list[str], log: Path, *, window: float, cap: float) -> dict[str, Any]:
    """Run one beat process; measure it over the window that starts after its first message."""
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.flushdb()
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, env=os.environ.copy(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    launched_at = time.time()
    try:
        launched = time.monotonic()
        while client.llen(QUEUE) == 0:
            if process.poll() is not None:
                raise SystemExit(
                    f"the beat exited with {process.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
                )
            if time.monotonic() - launched > cap:
                return {
                    "finished": False,
                    "cap_seconds": cap,
                    "peak_rss_mib": peak_rss_mib(process.pid),
                    "cpu_seconds_until_cap": cpu_seconds(process.pid),
                }
            time.sleep(0.02)
        startup = time.monotonic() - launched
        time.sleep(WARMUP_SECONDS)
        samples = []
        for pause in (window, 0):
            samples.append((time.time(), cpu_seconds(process.pid), client.llen(QUEUE), _db_xacts()))
            time.sleep(pause)
        time.sleep(1.0)  # the window's last slots go out
        rss = peak_rss_mib(process.pid)
    finally:
        stop_process(process)
    (t0, cpu0, queued0, xacts0), (t1, cpu1, queued1, xacts1) = samples
    return {
        "finished": True,
        "launched_at": launched_at,
        "startup_seconds": startup,
        "window": (t0, t1),
        "cpu_seconds_per_minute": (cpu1 - cpu0) / (t1 - t0) * 60,
        "peak_rss_mib": rss,
        "messages_per_second": (queued1 - queued0) / (t1 - t0),
        "db_xacts_per_second": (xacts1 - xacts0) / (t1 - t0),
    }


def _lag_summary(lags_ms: list[float], *, overdue_ms: list[float] = ()) -> dict[str, Any]:
    """Summarise lags; ``overdue_ms`` are lower bounds (still unsent at the window's end) and count as lags."""
    every = [*lags_ms, *overdue_ms]
    return {
        "lag_samples": len(every),
        "lag_overdue_at_end": len(overdue_ms),
        "lag_p50_ms": percentile(every, 50),
        "lag_p99_ms": percentile(every, 99),
        "lag_max_ms": max(every) if every else None,
    }


def _lags_ours(launched_at: float, t0: float, t1: float) -> dict[str, Any]:
    from scheduler.models import Execution

    rows = list(
        Execution.objects.filter(
            scheduled_for__gte=datetime.fromtimestamp(t0, timezone.utc),
            scheduled_for__lt=datetime.fromtimestamp(t1, timezone.utc),
        ).values_list("scheduled_for", "enqueued_at", "created_at")
    )
    lags = [(sent - slot).total_seconds() * 1000 for slot, sent, _ in rows if sent is not None]
    overdue = [(t1 - slot.timestamp()) * 1000 for slot, sent, _ in rows if sent is None]
    built = [(created - slot).total_seconds() * 1000 for slot, _, created in rows]
    worst: dict[datetime, float] = defaultdict(float)
    for slot, sent, _ in rows:
        if sent is not None:
            worst[slot] = max(worst[slot], (sent - slot).total_seconds() * 1000)
    slowest = sorted(worst.items(), key=lambda item: item[1], reverse=True)[:5]
    return {
        **_lag_summary(lags, overdue_ms=overdue),
        "slots": len(rows),
        "built_p50_ms": percentile(built, 50),
        "built_p99_ms": percentile(built, 99),
        "slowest_slots": [
            {"slot": slot.isoformat(), "seconds_after_beat_start": slot.timestamp() - launched_at, "lag_ms": lag}
            for slot, lag in slowest
        ],
    }


_SEND = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): INFO/MainProcess\] Scheduler: Sending due task (due-\d+) "
)


def _lags_peer(log: Path, last_run_at: float, t0: float, t1: float) -> dict[str, Any]:
    """Lag of each send in the window after the entry's due time (its previous send, or ``last_run_at``, + 1 s).

    An entry due before the window's end and not sent by then counts with
    its lag so far (a lower bound).
    """
    sends: dict[str, list[float]] = defaultdict(list)
    for line in log.read_text(errors="replace").splitlines():
        if match := _SEND.match(line):
            sends[match.group(2)].append(datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    lags, overdue = [], []
    for number in range(1, DUE_PER_SECOND + 1):
        previous = last_run_at
        for sent in sends.get(f"due-{number}", []):
            if sent >= t1:
                break
            if sent >= t0:
                lags.append((sent - previous - 1.0) * 1000)
            previous = sent
        if previous + 1.0 < t1:
            overdue.append((t1 - previous - 1.0) * 1000)
    return {**_lag_summary(lags, overdue_ms=overdue), "sends": len(lags)}


def _sleep_past_next_second() -> None:
    time.sleep(1.05 - time.time() % 1)


def _measure_ticks(count: int = 5) -> dict[str, Any]:
    """Count the queries of in-process ticks that each dispatch one second's due slots."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from project.celery import app
    from scheduler.beat import LeaderScheduler
    from scheduler.models import Execution

    scheduler = LeaderScheduler(app, lazy=True)
    samples = []
    try:
        scheduler.tick()  # takes the lease; fires what came due since the beat stopped
        # The tick's own work: on PostgreSQL the leader spends its sleep inside tick() (woken by NOTIFY).
        scheduler.leadership.wait = lambda seconds: seconds  # type: ignore[method-assign]
        for _ in range(count):
            _sleep_past_next_second()
            scheduler.leadership._last_renew = scheduler._last_heartbeat = time.monotonic()  # type: ignore[attr-defined]
            before = Execution.objects.count()
            started = time.perf_counter()
            with CaptureQueriesContext(connection) as queries:
                scheduler.tick()
            samples.append((len(queries), (time.perf_counter() - started) * 1000, Execution.objects.count() - before))
    finally:
        scheduler.close()
    return {
        "queries_per_tick": statistics.median(q for q, _, _ in samples),
        "tick_ms": statistics.median(ms for _, ms, _ in samples),
        "fired_per_tick": statistics.median(f for _, _, f in samples),
        "tick_samples": [{"queries": q, "ms": ms, "fired": f} for q, ms, f in samples],
    }


def _child(kind: str, size: int, window: float, cap: float, logs: Path) -> dict[str, Any]:
    import django

    django.setup()
    log_to_file(logs / f"{kind}-{size}-in-process.log")
    result: dict[str, Any] = {"kind": kind, "schedules": size}
    started = time.monotonic()
    last_run_at = (_load_ours if kind == "ours" else _load_peer)(size)
    result["load_seconds"] = time.monotonic() - started
    progress(f"  loaded in {result['load_seconds']:.0f}s; beat running...")
    celery = str(Path(sys.executable).with_name("celery"))
    log = logs / f"{kind}-{size}.log"
    try:
        if kind == "ours":
            _arm_ours()
        else:
            from importlib.metadata import version

            result["version"] = version("django-celery-beat")
        result.update(
            _run_beat([celery, "-A", "project", "beat", "-l", "info", "--pidfile="], log, window=window, cap=cap)
        )
        if result["finished"] and kind == "ours":
            result.update(_lags_ours(result["launched_at"], *result["window"]))
            result.update(_measure_ticks())
        elif result["finished"]:
            result.update(_lags_peer(log, last_run_at, *result["window"]))
    finally:
        execute_sql("TRUNCATE scheduler_execution, scheduler_schedule, scheduler_instance CASCADE")
        if kind == "peer":
            execute_sql("TRUNCATE django_celery_beat_periodictask, django_celery_beat_intervalschedule CASCADE")
    return result


# --- the orchestrator -------------------------------------------------------------------


def _row(result: dict[str, Any]) -> list[Any]:
    label = LABELS[result["kind"]] + (f" {result['version']}" if result.get("version") else "")
    if not result["finished"]:
        return [
            label,
            result["schedules"],
            result["load_seconds"],
            f"did not finish in {result['cap_seconds']:g} s",
            "-",
            result["peak_rss_mib"],
            "-",
            "-",
            "-",
            "-",
            "-",
            "-",
            "-",
            "-",
        ]
    return [
        label,
        result["schedules"],
        result["load_seconds"],
        result["startup_seconds"],
        result["cpu_seconds_per_minute"],
        result["peak_rss_mib"],
        result.get("queries_per_tick", "-"),
        result.get("tick_ms", "-"),
        result["db_xacts_per_second"],
        result["messages_per_second"],
        *("-" if result[key] is None else result[key] for key in ("lag_p50_ms", "lag_p99_ms", "lag_max_ms")),
        result["lag_overdue_at_end"],
    ]


def _verdict(results: list[dict[str, Any]]) -> dict[str, Any]:
    ours = sorted((r for r in results if r["kind"] == "ours" and r["finished"]), key=lambda r: r["schedules"])
    if not ours:
        return {"met": False}
    small, large = ours[0], ours[-1]
    cpu_ratio = large["cpu_seconds_per_minute"] / max(small["cpu_seconds_per_minute"], 1e-9)
    flat = cpu_ratio <= FLAT_RATIO and large["queries_per_tick"] == small["queries_per_tick"]
    p99 = large["lag_p99_ms"]
    lag_ok = p99 is not None and p99 <= GOAL_P99_MS and not large["lag_overdue_at_end"]
    return {
        "largest": large["schedules"],
        "cpu_ratio_largest_to_smallest": cpu_ratio,
        "flat": flat,
        "p99_ms_at_largest": p99,
        "p99_met": lag_ok,
        "met": flat and lag_ok,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="comma-separated schedule counts")
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured per run (default 60)")
    parser.add_argument("--skip-peers", action="store_true", help="run this project's beat only")
    parser.add_argument(
        "--cap",
        type=float,
        default=300.0,
        help="seconds a beat may take to send its first message, else it did not finish (default 300)",
    )
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--logs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    except ValueError:
        parser.error("--sizes takes comma-separated whole numbers")
    if not sizes or min(sizes) <= DUE_PER_SECOND or args.window <= 0 or args.cap <= 0:
        parser.error(f"--sizes must each be above {DUE_PER_SECOND}; --window and --cap must be positive")

    if args.child:
        result = _child(args.child, sizes[0], args.window, args.cap, Path(args.logs))
        print(json.dumps(result), flush=True)
        return 0

    kinds = {"ours": Path(sys.executable)}
    if not args.skip_peers:
        kinds["peer"] = peers_python()
    results = []
    started = time.monotonic()
    with migrated_services() as (env, tmp):
        if "peer" in kinds:
            migrate({**env, "DJANGO_SETTINGS_MODULE": "bench.peer_settings"}, kinds["peer"])
        for size in sizes:
            for kind, python in kinds.items():
                progress(f"{LABELS[kind]}: {size:,} schedules, {DUE_PER_SECOND} due every second...")
                results.append(
                    run_child(
                        [
                            str(python),
                            "-m",
                            "bench.scale",
                            f"--child={kind}",
                            f"--sizes={size}",
                            f"--window={args.window}",
                            f"--cap={args.cap}",
                            f"--logs={tmp}",
                        ],
                        {
                            **env,
                            "DJANGO_SETTINGS_MODULE": "project.settings" if kind == "ours" else "bench.peer_settings",
                        },
                    )
                )

    print()
    print(
        table(
            [
                "scheduler",
                "schedules",
                "load s",
                "startup s",
                "CPU s/min",
                "peak RSS MiB",
                "queries/tick",
                "tick ms",
                "DB xacts/s",
                "msgs/s",
                "lag p50 ms",
                "lag p99 ms",
                "lag max ms",
                "unsent at end",
            ],
            [_row(result) for result in results],
        )
    )
    verdict = _verdict(results)
    if verdict.get("largest"):
        print(
            f"\ngoal: cost flat in the number of schedules (same queries/tick, CPU/min within {FLAT_RATIO}x) and "
            f"p99 lag <= {GOAL_P99_MS:.0f} ms at {verdict['largest']:,}: CPU ratio {verdict['cpu_ratio_largest_to_smallest']:.2f}, "
            f"p99 {verdict['p99_ms_at_largest']:.0f} ms -> {'met' if verdict['met'] else 'NOT met'}"
        )
    print(f"ran in {time.monotonic() - started:.0f}s")
    write_results(
        "scale",
        {
            "database": "PostgreSQL (benchmark cluster, fsync off)",
            "broker": "Redis (benchmark instance, no worker)",
            "due_per_second": DUE_PER_SECOND,
            "window_seconds": args.window,
            "cap_seconds": args.cap,
            "goal": {"p99_lag_ms": GOAL_P99_MS, "flat_cpu_ratio": FLAT_RATIO},
            "verdict": verdict,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
