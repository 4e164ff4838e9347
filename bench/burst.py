"""Burst: 10,000 schedules due in the same second, until every execution is committed and published.

One real ``celery -A project beat`` (the leader) runs against the benchmark's
own PostgreSQL and Redis; no worker runs, so every message stays in Redis.
Once it holds the lease, N schedules due at the whole second T are inserted
(server side, about 2 s before T): hourly interval schedules (``interval``)
or one-off schedules whose ``run_at`` is T (``oneoff``: each turns itself
off as it fires). From T on,
this process reads the length of the Redis queue every 20 ms, and how many
Execution rows are committed and how many are ``queued`` every 100 ms and at
every read once Redis holds every message (counting the rows scans the
table the beat writes to, on the cores the beat and PostgreSQL share: every
20 ms that cost them a measurable share of the machine). Measured per
``SCHEDULER_DISPATCH_BATCH_SIZE`` (500, the default, and 2,000) and per
number of beat replicas (1, and 2: the follower publishes pending rows
while the leader commits):

- committed s: T -> all 10,000 Execution rows committed (to 100 ms);
- published s: T -> all 10,000 messages in Redis and all rows ``queued``;
- executions/s: 10,000 / published s (goal: >= 5,000 on 2 cores);
- leader CPU s: user + system CPU of the leading beat process over the
  burst, and per execution (steadier than the rate on a shared machine).

The machine's ceilings, measured in the same run against the same services:
``redis-benchmark -t lpush -n 100000 -q`` (its default 50 connections, and one
connection as the beat uses), and a bulk ``INSERT ... SELECT generate_series``
of 10,000 rows into a scratch copy of ``scheduler_execution`` (same columns,
indexes and constraints; best of 3). The fraction is executions/s over the
lower of the Redis (50 connections) and PostgreSQL ceilings. For reference,
Celery's own cost of sending is measured too: ``send_task`` of 10,000
messages on one producer, as the leader sent them before, and the
publisher's fast path (``scheduler.fastpath.publisher``: Celery's messages pushed in
one Redis pipeline per batch), as it sends them now. The load average is
recorded before and after: on a shared machine it says how far to trust
the rates.

When the goal is missed (or with ``--profile``), the same burst is dispatched
in this process by a ``LeaderScheduler`` under cProfile, and the functions
with the most own time are reported (cProfile slows Python code down, so the
profiled rate is lower than the real one).

Each replica count runs once per ``SCHEDULER_SHARDS`` value too (``--shards``,
default 1 and 4): with N > 1 every replica commits (and publishes) its own
shards' schedules, so the commit, the bound of one leader, is spread over
processes.

``--repeat N`` runs every configuration N times and prints min / median /
max of its rate, and in how many runs all were published within
``GOAL_SECONDS``. The goals: one leader publishes 10,000 within 2 s in
every run, and two sharded replicas reach 10,000/s in their median run.

Run: ``python -m bench.burst [--kind interval,oneoff] [--schedules 10000,100000] [--batch-sizes 500,2000]
[--replicas 1,2] [--shards 1,4] [--repeat 5] [--profile]``.
Writes ``bench/results/burst.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from bench.common import (
    CELERY,
    ROOT,
    cpu_seconds,
    execute_sql,
    insert_generated,
    log_to_file,
    measure_in_child,
    peak_rss_mib,
    stop_process,
    table,
    whole_numbers,
    write_results,
)

#: One leader's goal: every run of 10,000 published within this.
GOAL_SECONDS = 2.0
#: Two sharded replicas' goal, in their median run.
SHARDED_GOAL_PER_SECOND = 10000.0
QUEUE = "celery"
TASK = "bench.noop"
#: How often Redis's queue length is read; the Execution rows are counted every DB_POLL_SECONDS.
POLL_SECONDS = 0.02
DB_POLL_SECONDS = 0.1
LEAD_SECONDS = 2
HOTSPOTS = 15
KINDS = ("interval", "oneoff")


# --- inside the child process (Django configured) ----------------------------------------


def _reset() -> Any:
    import redis

    execute_sql("TRUNCATE scheduler_execution, scheduler_schedule, scheduler_instance CASCADE")
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.flushdb()
    return client


def _load_burst(kind: str, count: int, due: str) -> None:
    """Insert ``count`` schedules of ``kind`` due at ``due`` (an SQL timestamp expression).

    ``interval``: hourly, first slot ``due``; ``oneoff``: ``run_at`` = ``due``.
    """
    from scheduler.models import Schedule

    timing = {"interval": "3600", "start_at": due} if kind == "interval" else {"run_at": due}
    insert_generated(
        Schedule,
        count,
        {
            "name": "'burst-' || g",
            "task": f"'{TASK}'",
            **timing,
            "next_run_at": due,
            "created_at": "now()",
            "updated_at": "now()",
        },
    )


def _wait_for_leader(processes: list[subprocess.Popen[Any]], shards: int, timeout: float = 60) -> None:
    """Wait until the lease is held, or with shards until every shard is held and spread over the replicas."""
    deadline = time.monotonic() + timeout
    holders = min(len(processes), shards) if shards > 1 else 1
    while True:
        held, spread = execute_sql(
            "SELECT count(*), count(DISTINCT holder) FROM scheduler_lease WHERE holder <> '' AND expires_at > now()"
        )[0]
        if (held, spread) == (shards, holders):
            time.sleep(1.0 if shards > 1 else 0)  # let a last voluntary release settle
            return
        if any(process.poll() is not None for process in processes) or time.monotonic() > deadline:
            raise SystemExit("the beats did not take the lease(s)")
        time.sleep(0.05)


def _leader_pid(processes: list[subprocess.Popen[Any]], timeout: float = 30) -> int:
    """Return the pid of the replica holding the lease, or the most shards (from its heartbeat row)."""
    deadline = time.monotonic() + timeout
    pids = {process.pid for process in processes}
    while time.monotonic() < deadline:
        rows = execute_sql(
            "SELECT i.pid FROM scheduler_lease l JOIN scheduler_instance i ON i.instance_id = l.holder "
            "GROUP BY i.pid ORDER BY count(*) DESC"
        )
        if rows and rows[0][0] in pids:
            return rows[0][0]
        time.sleep(0.05)
    raise SystemExit("no replica's heartbeat names the lease holder")


def _burst(
    kind: str, count: int, batch_size: int, replicas: int, shards: int, timeout: float, log: Path
) -> dict[str, Any]:
    """Time one burst through ``replicas`` real beat processes.

    With one shard one leads and, on PostgreSQL, the others publish too;
    with ``shards`` > 1 every replica commits its own shards' schedules.
    """
    client = _reset()
    # The stored shard count too: the replicas then store this run's SCHEDULER_SHARDS.
    execute_sql("TRUNCATE scheduler_lease, scheduler_shardlayout")
    env = {**os.environ, "SCHEDULER_DISPATCH_BATCH_SIZE": str(batch_size), "SCHEDULER_SHARDS": str(shards)}
    processes = []
    with log.open("wb") as out:
        for _ in range(replicas):
            processes.append(
                subprocess.Popen(
                    [CELERY, "-A", "project", "beat", "-l", "info", "--pidfile="],
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    try:
        _wait_for_leader(processes, shards)
        leader = _leader_pid(processes)
        (due,) = execute_sql(f"SELECT date_trunc('second', now()) + interval '{LEAD_SECONDS} seconds'")[0]
        _load_burst(kind, count, f"'{due.isoformat()}'::timestamptz")
        if shards > 1:
            execute_sql("UPDATE scheduler_schedule SET shard = id %% %s", [shards])
        start = due.timestamp()
        time.sleep(max(start - time.time(), 0))
        cpu0 = {process.pid: cpu_seconds(process.pid) for process in processes}
        committed = published = None
        read_rows_at = 0.0
        while published is None and time.time() < start + timeout:
            in_redis = client.llen(QUEUE)
            now = time.time()
            # Counting the rows scans the table the beat writes to, on the cores it shares:
            # read it every DB_POLL_SECONDS, and at every poll once Redis holds every message.
            if in_redis >= count or now >= read_rows_at:
                rows, queued = execute_sql(
                    "SELECT count(*), count(*) FILTER (WHERE status = 'queued') FROM scheduler_execution"
                )[0]
                read_rows_at = now + DB_POLL_SECONDS
                if committed is None and rows >= count:
                    committed = now - start
                if queued >= count and in_redis >= count:
                    published = now - start
            time.sleep(POLL_SECONDS)
        cpu = {pid: cpu_seconds(pid) - before for pid, before in cpu0.items()}
        rss = peak_rss_mib(leader)
    finally:
        for process in processes:
            stop_process(process)
    rows, keys = execute_sql("SELECT count(*), count(DISTINCT idempotency_key) FROM scheduler_execution")[0]
    return {
        "kind": kind,
        "batch_size": batch_size,
        "replicas": replicas,
        "shards": shards,
        "schedules": count,
        "executions": rows,
        "duplicates": rows - keys,
        "committed_seconds": committed,
        "published_seconds": published,
        "per_second": count / published if published else None,
        "leader_cpu_seconds": cpu[leader],
        "replicas_cpu_seconds": sum(cpu.values()),
        "peak_rss_mib": rss,
    }


def _redis_ceiling(*options: str) -> dict[str, Any]:
    from tests.support.services import find_redis_server

    binary = shutil.which("redis-benchmark") or str(Path(find_redis_server()).with_name("redis-benchmark"))
    url = urlparse(os.environ["REDIS_URL"])
    command = [binary, "-h", url.hostname, "-p", str(url.port), "-t", "lpush", "-n", "100000", "-q", *options]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rate = float(re.findall(r"LPUSH: ([\d.]+) requests per second", output)[-1])
    return {
        "what": f"Redis LPUSH: redis-benchmark -t lpush -n 100000 -q {' '.join(options)}".rstrip(),
        "per_second": rate,
    }


def _insert_ceiling(count: int, repeat: int = 3) -> dict[str, Any]:
    from scheduler.models import Execution

    execute_sql("DROP TABLE IF EXISTS bench_insert_ceiling")
    execute_sql("CREATE TABLE bench_insert_ceiling (LIKE scheduler_execution INCLUDING ALL)")
    best = float("inf")
    try:
        for _ in range(repeat):
            execute_sql("TRUNCATE bench_insert_ceiling")
            started = time.perf_counter()
            insert_generated(
                Execution,
                count,
                {
                    "idempotency_key": "'ceiling:' || g",
                    "task": f"'{TASK}'",
                    "scheduled_for": "now()",
                    "celery_task_id": "gen_random_uuid()::text",
                    "lease_token": "1",
                    "created_at": "now()",
                },
                table="bench_insert_ceiling",
            )
            best = min(best, time.perf_counter() - started)
    finally:
        execute_sql("DROP TABLE bench_insert_ceiling")
    return {
        "what": f"PostgreSQL: INSERT ... SELECT generate_series, {count:,} execution rows",
        "per_second": count / best,
    }


def _send_task_ceiling(count: int) -> dict[str, Any]:
    """Send ``count`` messages the way the leader does (one producer, one ``send_task`` each)."""
    import uuid

    from project.celery import app

    client = _reset()
    with app.producer_or_acquire() as producer:
        started = time.perf_counter()
        for number in range(count):
            app.send_task(
                TASK,
                args=[],
                kwargs={},
                task_id=str(uuid.uuid4()),
                headers={"execution_id": number},
                producer=producer,
                retry=False,
            )
        elapsed = time.perf_counter() - started
    client.delete(QUEUE)
    return {"what": f"Celery: send_task on one producer, {count:,} messages", "per_second": count / elapsed}


def _publisher_ceiling(count: int) -> dict[str, Any]:
    """Send ``count`` messages the way the leader does now (``scheduler.fastpath.publisher``, one pipeline per batch)."""
    from datetime import datetime, timezone

    from project.celery import app
    from scheduler import outbox
    from scheduler.outbox import PUBLISH_BATCH

    client = _reset()
    now = datetime.now(timezone.utc)
    rows = [
        {
            "id": number,
            "task": TASK,
            "args": [],
            "kwargs": {},
            "queue": "",
            "priority": None,
            "celery_task_id": "",
            "timeout": None,
            "scheduled_for": now,
        }
        for number in range(count)
    ]
    with outbox.connect(app) as sender:
        started = time.perf_counter()
        for start in range(0, count, PUBLISH_BATCH):
            sender.send(rows[start : start + PUBLISH_BATCH], now=now)
        elapsed = time.perf_counter() - started
    client.delete(QUEUE)
    return {
        "what": f"scheduler.fastpath.publisher: one pipeline per {PUBLISH_BATCH} messages, {count:,} messages",
        "per_second": count / elapsed,
    }


def _where(code: tuple[str, int, str]) -> str:
    filename, line, name = code
    for prefix in (f"{ROOT}/.venv/lib/python3.11/site-packages/", f"{ROOT}/"):
        filename = filename.removeprefix(prefix)
    return f"{filename}:{line}({name})"


def _profile(kind: str, count: int) -> dict[str, Any]:
    """Dispatch one burst in process under cProfile; return the top functions by own and by cumulative time."""
    from project.celery import app
    from scheduler.beat import LeaderScheduler
    from scheduler.models import Execution

    _reset()
    # One leader in process: the shard count the last burst stored would leave it waiting for replicas that are gone.
    execute_sql("TRUNCATE scheduler_lease, scheduler_shardlayout")
    scheduler = LeaderScheduler(app, lazy=True)
    profiler = cProfile.Profile()
    try:
        scheduler.tick()  # takes the lease
        # Ticks end when nothing is due: on PostgreSQL the leader would spend its sleep inside tick() instead.
        scheduler.leadership.wait = lambda seconds: seconds  # type: ignore[method-assign]
        _load_burst(kind, count, "date_trunc('second', now())")
        scheduler.leadership._last_renew = scheduler._last_heartbeat = time.monotonic()  # type: ignore[attr-defined]
        started = time.perf_counter()
        profiler.enable()
        while scheduler.tick() == 0.0:
            pass
        profiler.disable()
        elapsed = time.perf_counter() - started
    finally:
        scheduler.close()
    published = Execution.objects.filter(status=Execution.Status.QUEUED).count()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(tottime for _, _, tottime, _, _ in stats.values())

    def top(index: int) -> list[dict[str, Any]]:
        ranked = sorted(stats.items(), key=lambda item: item[1][index], reverse=True)[:HOTSPOTS]
        return [
            {
                "function": _where(code),
                "calls": calls,
                "own_seconds": own,
                "cumulative_seconds": cumulative,
                "own_share": own / total,
            }
            for code, (_, calls, own, cumulative, _) in ranked
        ]

    return {
        "kind": kind,
        "schedules": count,
        "published": published,
        "seconds": elapsed,
        "per_second": published / elapsed,
        "by_own_time": top(2),
        "by_cumulative_time": top(3),
    }


def _child(
    kinds: list[str],
    counts: list[int],
    batch_sizes: list[int],
    replica_counts: list[int],
    shard_counts: list[int],
    timeout: float,
    profile: bool,
    logs: Path,
    repeat: int = 1,
) -> dict[str, Any]:
    import django

    django.setup()
    log_to_file(logs / "in-process.log")
    load_before = os.getloadavg()
    runs = []
    for count in counts:
        for kind in kinds:
            for batch_size in batch_sizes:
                for replicas in replica_counts:
                    for shards in shard_counts:
                        for attempt in range(1, repeat + 1):
                            print(
                                f"burst of {count:,} {kind} schedules, batch size {batch_size:,}, "
                                f"{replicas} replica(s), {shards} shard(s), run {attempt}/{repeat}...",
                                file=sys.stderr,
                                flush=True,
                            )
                            run = _burst(
                                kind,
                                count,
                                batch_size,
                                replicas,
                                shards,
                                timeout,
                                logs / f"beat-{kind}-{count}-{batch_size}-{replicas}-{shards}-{attempt}.log",
                            )
                            runs.append({**run, "run": attempt})
    ceilings = {
        "redis": _redis_ceiling(),
        "redis_one_connection": _redis_ceiling("-c", "1"),
        "insert": _insert_ceiling(counts[0]),
        "send_task": _send_task_ceiling(counts[0]),
        "publisher": _publisher_ceiling(counts[0]),
    }
    result: dict[str, Any] = {"runs": runs, "ceilings": ceilings, "load_average_before": load_before}
    profiles = []
    for kind in kinds:
        if profile or any(not _within_goal(run) for run in runs if run["kind"] == kind and run["replicas"] == 1):
            print(f"profiling the leader in process ({kind})...", file=sys.stderr, flush=True)
            profiles.append(_profile(kind, counts[0]))
    result["profiles"] = profiles
    result["load_average_after"] = os.getloadavg()
    _reset()
    return result


# --- the orchestrator ---------------------------------------------------------------------


def _by_configuration(runs: list[dict[str, Any]]) -> dict[tuple[str, int, int, int, int], list[dict[str, Any]]]:
    """The runs grouped by (kind, schedules, batch size, replicas, shards), in the order they ran."""
    grouped: dict[tuple[str, int, int, int, int], list[dict[str, Any]]] = {}
    for run in runs:
        configuration = (run["kind"], run["schedules"], run["batch_size"], run["replicas"], run["shards"])
        grouped.setdefault(configuration, []).append(run)
    return grouped


def _within_goal(run: dict[str, Any]) -> bool:
    return run["published_seconds"] is not None and run["published_seconds"] <= GOAL_SECONDS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--kind", default=",".join(KINDS), help="schedule kinds, one burst each: interval,oneoff (default both)"
    )
    parser.add_argument(
        "--schedules", default="10000", help="schedules due in the same second, one burst each (default 10000)"
    )
    parser.add_argument("--batch-sizes", default="500,2000", help="SCHEDULER_DISPATCH_BATCH_SIZE values, one run each")
    parser.add_argument(
        "--replicas", default="1,2", help="beat replicas, one run each (default 1,2: the follower publishes)"
    )
    parser.add_argument(
        "--shards",
        default="1,4",
        help="SCHEDULER_SHARDS values, one run each (default 1,4: one leader, then every replica commits)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a burst may take (default 300)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every configuration (default 1)")
    parser.add_argument("--profile", action="store_true", help="profile the leader even when the goal is met")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--logs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        batch_sizes, counts, replica_counts = (
            whole_numbers(args.batch_sizes),
            whole_numbers(args.schedules),
            whole_numbers(args.replicas),
        )
        shard_counts = whole_numbers(args.shards)
    except ValueError:
        parser.error("--schedules, --batch-sizes, --replicas and --shards take comma-separated whole numbers")
    kinds = [kind.strip() for kind in args.kind.split(",") if kind.strip()]
    if not kinds or not set(kinds) <= set(KINDS):
        parser.error(f"--kind takes {' and/or '.join(KINDS)}, comma-separated")
    if (
        not counts
        or min(counts) < 1
        or not batch_sizes
        or min(batch_sizes) < 1
        or not replica_counts
        or min(replica_counts) < 1
        or not shard_counts
        or min(shard_counts) < 1
        or args.timeout <= 0
        or args.repeat < 1
    ):
        parser.error("--schedules, --batch-sizes, --replicas, --shards, --timeout and --repeat must be positive")

    if args.child:
        result = _child(
            kinds,
            counts,
            batch_sizes,
            replica_counts,
            shard_counts,
            args.timeout,
            args.profile,
            Path(args.logs),
            args.repeat,
        )
        print(json.dumps(result), flush=True)
        return 0

    started = time.monotonic()
    result = measure_in_child(
        "bench.burst",
        kind=args.kind,
        schedules=args.schedules,
        batch_sizes=args.batch_sizes,
        replicas=args.replicas,
        shards=args.shards,
        timeout=args.timeout,
        repeat=args.repeat,
        profile=args.profile,
    )

    limit = min(result["ceilings"]["redis"]["per_second"], result["ceilings"]["insert"]["per_second"])
    configurations = _by_configuration(result["runs"])
    rows = []
    for (kind, count, batch_size, replicas, shards), runs in configurations.items():
        rates = sorted(run["per_second"] or 0.0 for run in runs)
        shown = f", {shards} shards" if shards > 1 else ""
        rows.append(
            [
                f"{replicas} replica(s){shown}, {kind} x {count:,}, batch {batch_size:,}",
                len(runs),
                sum(run["duplicates"] for run in runs),
                " / ".join(f"{rate:,.0f}" for rate in (rates[0], statistics.median(rates), rates[-1])),
                max((run["published_seconds"] or float("inf")) for run in runs),
                f"{sum(1 for run in runs if _within_goal(run))}/{len(runs)}",
                statistics.median(run["leader_cpu_seconds"] * 1000 / max(run["executions"], 1) for run in runs),
                f"{statistics.median(rates) / limit:.1%}",
            ]
        )
    for ceiling in result["ceilings"].values():
        rows.append([ceiling["what"], "-", "-", f"{ceiling['per_second']:,.0f}", "-", "-", "-", "-"])
    print()
    print(
        table(
            [
                "what",
                "runs",
                "duplicates",
                "per second min / median / max",
                "slowest published s",
                f"within {GOAL_SECONDS:g} s",
                "CPU ms/execution (median)",
                "median of ceiling",
            ],
            rows,
        )
    )
    met = True
    for (kind, count, batch_size, replicas, shards), runs in configurations.items():
        if count != 10_000 or replicas > 2:
            continue
        if replicas == 1:
            ok = all(_within_goal(run) for run in runs)
            goal = f"every run published within {GOAL_SECONDS:g} s"
        elif shards > 1:
            ok = statistics.median(run["per_second"] or 0.0 for run in runs) >= SHARDED_GOAL_PER_SECOND
            goal = f"median >= {SHARDED_GOAL_PER_SECOND:,.0f}/s"
        else:
            continue
        met = met and ok
        print(
            f"goal, {replicas} replica(s), {shards} shard(s), {kind}, batch {batch_size:,}: {goal} -> "
            f"{'met' if ok else 'NOT met'}"
        )
    print(f"(ceiling {limit:,.0f}/s: the lower of Redis LPUSH and the PostgreSQL bulk INSERT)")
    print(
        f"load average (1, 5, 15 min): {result['load_average_before']} before, {result['load_average_after']} after "
        f"on {os.cpu_count()} CPUs"
    )
    for profile in result["profiles"]:
        print(
            f"\nhotspots, {profile['kind']} (cProfile, in process: {profile['published']:,} published in "
            f"{profile['seconds']:.2f}s = {profile['per_second']:,.0f}/s under the profiler), by own time:"
        )
        print(
            table(
                ["function", "calls", "own s", "share", "cumulative s"],
                [
                    [h["function"], h["calls"], h["own_seconds"], f"{h['own_share']:.1%}", h["cumulative_seconds"]]
                    for h in profile["by_own_time"]
                ],
            )
        )
        print("\nby cumulative time:")
        print(
            table(
                ["function", "calls", "cumulative s"],
                [[h["function"], h["calls"], h["cumulative_seconds"]] for h in profile["by_cumulative_time"]],
            )
        )
    print(f"\nran in {time.monotonic() - started:.0f}s")
    write_results(
        "burst",
        {
            "database": "PostgreSQL (benchmark cluster, fsync off)",
            "broker": "Redis (benchmark instance, no worker)",
            "goal_seconds": GOAL_SECONDS,
            "sharded_goal_per_second": SHARDED_GOAL_PER_SECOND,
            "ceiling_per_second": limit,
            "met": met,
            **result,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
