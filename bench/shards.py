"""Sharded beat: balance, leader CPU per execution and failover per shard, for 1, 3 and 5 replicas.

On 2 cores this shows the spread, not a speed-up: all replicas share two
cores with PostgreSQL (and Redis, and this process), so more replicas divide
the same CPU among more processes. What it shows is how evenly the shards
and the dispatches spread, what one execution costs the beats, and how fast
a dead replica's shards are taken over.

``celery -A project beat`` replicas run with ``SCHEDULER_SHARDS=N`` (64 by
default) and the documented lease settings (TTL 10 s, renew 2 s) against
``--schedules`` every-second schedules, on PostgreSQL and, separately, on
SQLite. No worker runs: the replicas commit an Execution row for every slot
and publish it to Redis (whose queue this process empties every few seconds,
so it does not grow for the whole run). For each database and replica count,
in one run:

- balance: once every shard is held, the loads are even and the start's
  catch-up is dispatched, a steady window of ``--seconds``: shards per
  replica (lease rows ``beat:<k>``) and dispatches per replica (the
  window's slots, each counted once however late it was committed, by the
  Execution row's ``dispatcher``): min / max / mean and the largest
  deviation from the mean in %; and how many shards changed hands in the
  window (should be none);
- leader CPU per execution: user + system CPU of every beat process over
  the window (``/proc/<pid>/stat``) divided by the executions committed in
  it (by ``created_at``), in total and per replica (its CPU over the rows it
  committed). Shard 0's holder also runs the reconcile pass and, on SQLite,
  publishes for every replica, so its share is the highest;
- failover per shard (2 replicas or more): a random replica is killed with
  SIGKILL ``--kills`` times, then with SIGTERM ``--kills`` times; each time
  it is started again and the shards must be even again before the next
  kill. For each of the killed replica's shards: seconds from the kill to
  ``acquired_at`` of that shard's lease under a newer token held by another
  replica (database clock, converted with a reading of the database clock
  taken at the kill); median / p90 / max per signal;
- slots: every one-second slot of every schedule, from its first row to its
  last, over the whole run of that replica count (kills included), must have
  exactly one row: a slot with two is a duplicate, a slot with none (or
  recorded ``missed``/``skipped``) a gap.

Run: ``python -m bench.shards [--replicas 1,3,5] [--shards 64] [--schedules 1000]
[--seconds 30] [--kills 3] [--databases postgresql,sqlite]``
(it starts its own PostgreSQL and Redis). Writes ``bench/results/shards.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import (
    LEASE_ENV,
    add_databases_option,
    child_command,
    cpu_seconds,
    dash_if_none,
    migrated_databases,
    percentile,
    progress,
    run_child,
    table,
    whole_numbers,
    write_results,
)
from scheduler import dbclock
from tests.support.processes import CeleryProcess, beat_argv, pid_of, wait_until

SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
#: Lease settings of the replicas (the documented defaults, as ``bench.failover``).
STARTUP_WAIT = 60.0  # seconds a replica has to start
BALANCE_WAIT = 60.0  # seconds the shards have to spread evenly over the live replicas
TAKEOVER_WAIT = 40.0  # seconds the others have to take every shard of a killed replica
CAUGHT_UP_SECONDS = 1.5  # the steady window starts once no schedule is due longer ago than this
DRAIN_SECONDS = 3.0  # how often the Redis queue (no worker) is emptied
QUEUE = "celery"
READY = r"beat replica \S+ started"


def spread(counts: list[int]) -> dict[str, Any]:
    """min / max / mean of ``counts`` and the largest deviation from the mean, in % of it."""
    mean = sum(counts) / len(counts)
    deviation = max(abs(count - mean) for count in counts) / mean * 100 if mean else None
    return {"per_replica": counts, "min": min(counts), "max": max(counts), "mean": mean, "max_deviation_pct": deviation}


def gap_summary(gaps: list[float]) -> dict[str, Any]:
    return {
        "median_seconds": statistics.median(gaps) if gaps else None,
        "p90_seconds": percentile(gaps, 90),
        "max_seconds": max(gaps) if gaps else None,
    }


# --- inside one database's child process (Django configured) --------------------------------


def _pid(instance_id: str) -> int:
    """The pid inside an instance id ``hostname-pid-random``."""
    return pid_of(instance_id)


class Replicas:
    """The beat replicas of one run: started, replaced after a kill, stopped."""

    def __init__(self, env: dict[str, str], logs: Path, tag: str) -> None:
        self.env, self.logs, self.tag = env, logs, tag
        self.started = 0
        self.live: list[CeleryProcess] = []

    def start(self) -> CeleryProcess:
        self.started += 1
        name = f"{self.tag}-beat{self.started}"
        process = CeleryProcess(name, beat_argv(), self.env, self.logs / f"{name}.log").start()
        self.live.append(process)
        return process

    def wait_ready(self) -> None:
        for process in self.live:
            if not wait_until(lambda p=process: re.search(READY, p.log()), timeout=STARTUP_WAIT, interval=0.2):
                raise SystemExit(f"{process.name} did not start within {STARTUP_WAIT:.0f}s")

    def replace(self, process: CeleryProcess) -> None:
        """Start a replica in place of ``process`` (killed), while that one is reaped."""
        self.live.remove(process)
        self.start()
        process.stop()
        self.wait_ready()

    def stop(self) -> None:
        for process in self.live:
            process.stop()


def _holders(count: int) -> dict[str, tuple[str, int]]:
    """{shard lease name: (holder, token)} of the shards held unexpired now (database clock)."""
    from scheduler import shards
    from scheduler.models import Lease

    now = dbclock.now()
    rows = Lease.objects.filter(name__in=shards.lease_names(count), expires_at__gt=now).exclude(holder="")
    return {row.name: (row.holder, row.token) for row in rows}


def _balanced(count: int, replicas: Replicas) -> dict[str, tuple[str, int]] | None:
    """The holders when every shard is held by a live replica and their loads differ by one at most."""
    held = _holders(count)
    loads = Counter(_pid(holder) for holder, _ in held.values())
    pids = {process.pid for process in replicas.live}
    if len(held) != count or set(loads) != pids or max(loads.values()) - min(loads.values()) > 1:
        return None
    return held


def _wait_balanced(count: int, replicas: Replicas, what: str) -> dict[str, tuple[str, int]]:
    held = wait_until(lambda: _balanced(count, replicas), timeout=BALANCE_WAIT, interval=0.1)
    if not held:
        loads = Counter(holder for holder, _ in _holders(count).values())
        raise SystemExit(
            f"the shards did not spread over the replicas within {BALANCE_WAIT:.0f}s {what}: {dict(loads)}"
        )
    return held


def _db_offset() -> float:
    """Database clock minus this machine's clock, in seconds (the query's midpoint)."""

    before = time.time()
    db_now = dbclock.now()
    return db_now.timestamp() - (before + time.time()) / 2


def _make_schedules(count: int) -> int:
    """Create ``count`` every-second schedules (``save`` puts each in its shard); return the first id."""
    from django.db import transaction

    from scheduler.models import Schedule
    from scheduler.owners import schedules

    first = None
    with transaction.atomic():
        for index in range(count):
            schedule = Schedule(name=f"shards-{time.time_ns()}-{index}", task="bench.noop", interval=1)
            schedules.save(schedule)
            first = first or schedule.pk
    assert first is not None
    return first


def _caught_up(first_id: int) -> bool:
    """Whether the start's catch-up is dispatched: no schedule of the run due longer ago than ``CAUGHT_UP_SECONDS``."""
    from datetime import timedelta

    from scheduler.models import Schedule

    behind = dbclock.now() - timedelta(seconds=CAUGHT_UP_SECONDS)
    return not Schedule.objects.filter(pk__gte=first_id, enabled=True, next_run_at__lt=behind).exists()


def _steady(count: int, replicas: Replicas, seconds: float, first_id: int) -> dict[str, Any]:
    """Balance and CPU per execution over a window of ``seconds`` with no change among the replicas."""
    from django.db.models import Count

    from scheduler.models import Execution

    before = _holders(count)
    cpu0 = {process.pid: cpu_seconds(process.pid) for process in replicas.live}
    started = dbclock.now()
    time.sleep(seconds)
    ended = dbclock.now()
    cpu = {pid: cpu_seconds(pid) - used for pid, used in cpu0.items()}
    after = _holders(count)
    wait_until(
        lambda: _caught_up(first_id), timeout=BALANCE_WAIT, interval=0.1
    )  # the window's last slots are committed too

    def per_replica(rows: Any) -> Counter[int]:
        by_dispatcher = rows.values_list("dispatcher").annotate(n=Count("id")).values_list("dispatcher", "n")
        return Counter({_pid(dispatcher): n for dispatcher, n in by_dispatcher if dispatcher})

    runs = Execution.objects.filter(schedule_id__gte=first_id)
    # Balance by slot (each slot of the window once, however late it was
    # committed); CPU by what was committed while it was measured.
    dispatches = per_replica(runs.filter(scheduled_for__gte=started, scheduled_for__lt=ended))
    committed = per_replica(runs.filter(created_at__gte=started, created_at__lt=ended))
    shards_held = Counter(_pid(holder) for holder, _ in before.values())
    pids = [process.pid for process in replicas.live]
    executions = sum(committed.values())
    return {
        "window_seconds": (ended - started).total_seconds(),
        "slots_dispatched": sum(dispatches.values()),
        "not_by_a_live_replica": sum(dispatches.values()) - sum(dispatches[pid] for pid in pids),
        "executions": executions,
        "executions_per_second": executions / (ended - started).total_seconds(),
        "shards_changed_hands": sum(1 for name in before.keys() | after.keys() if before.get(name) != after.get(name)),
        "shards": spread([shards_held[pid] for pid in pids]),
        "dispatches": spread([dispatches[pid] for pid in pids]),
        "executions_committed": spread([committed[pid] for pid in pids]),
        "cpu_seconds": sum(cpu.values()),
        "cpu_ms_per_execution": sum(cpu.values()) * 1000 / executions if executions else None,
        "cpu_ms_per_execution_per_replica": [
            cpu[pid] * 1000 / committed[pid] if committed[pid] else None for pid in pids
        ],
    }


def _kill_loop(count: int, replicas: Replicas, sig: int, kills: int, rng: random.Random) -> dict[str, Any]:
    """Kill a random replica ``kills`` times with ``sig``; time the takeover of each of its shards."""
    from scheduler.models import Lease

    samples, gaps, not_taken = [], [], 0
    for number in range(kills):
        _wait_balanced(count, replicas, f"before kill {number + 1}")
        time.sleep(rng.uniform(0.0, 1.0))  # kill at a random point of the one-second cycle
        held = _wait_balanced(count, replicas, f"before kill {number + 1}")
        victim = rng.choice(replicas.live)
        theirs = {name: token for name, (holder, token) in held.items() if _pid(holder) == victim.pid}
        offset = _db_offset()
        killed_at = time.time()
        os.kill(victim.pid, sig)
        killed_db = killed_at + offset
        taken: dict[str, float] = {}

        def all_taken() -> bool:
            rows = Lease.objects.filter(name__in=theirs.keys() - taken.keys()).values_list(
                "name", "holder", "token", "acquired_at"
            )
            for name, holder, token, acquired_at in rows:
                if token > theirs[name] and holder and _pid(holder) != victim.pid and acquired_at is not None:
                    taken[name] = acquired_at.timestamp() - killed_db
            return len(taken) == len(theirs)

        wait_until(all_taken, timeout=TAKEOVER_WAIT, interval=0.01)
        not_taken += len(theirs) - len(taken)
        gaps += taken.values()
        samples.append(
            {
                "pid": victim.pid,
                "killed_at": killed_at,
                "db_offset_seconds": offset,
                "shards": len(theirs),
                "takeover_seconds": dict(sorted(taken.items())),
                "not_taken": sorted(theirs.keys() - taken.keys()),
            }
        )
        summary = gap_summary(list(taken.values()))
        progress(
            f"    kill {number + 1}/{kills} ({signal.Signals(sig).name}): {len(taken)}/{len(theirs)} shards taken, "
            + (f"median {summary['median_seconds']:.3f}s, max {summary['max_seconds']:.3f}s" if taken else "none")
        )
        replicas.replace(victim)
    _wait_balanced(count, replicas, "after the last kill")
    return {
        "kills": kills,
        "shards": len(gaps) + not_taken,
        "not_taken": not_taken,
        **gap_summary(gaps),
        "samples": samples,
    }


def _slot_counts(first_id: int) -> dict[str, int]:
    """Over every schedule from ``first_id`` on: slots from its first row to its last, duplicates and gaps."""
    from django.db.models import Count, Max, Min, Q

    from scheduler.models import Execution

    not_run = [Execution.Status.MISSED, Execution.Status.SKIPPED]
    per_schedule = (
        Execution.objects.filter(schedule_id__gte=first_id)
        .values("schedule_id")
        .annotate(
            rows=Count("id"),
            slots=Count("scheduled_for", distinct=True),
            first=Min("scheduled_for"),
            last=Max("scheduled_for"),
            not_run=Count("id", filter=Q(status__in=not_run)),
        )
    )
    totals = Counter(schedules=0, slots=0, rows=0, duplicates=0, gaps=0)
    for row in per_schedule:
        expected = round((row["last"] - row["first"]).total_seconds()) + 1
        totals.update(
            schedules=1,
            slots=expected,
            rows=row["rows"],
            duplicates=row["rows"] - row["slots"],
            gaps=expected - row["slots"] + row["not_run"],
        )
    return dict(totals)


def _drain(redis_url: str, stop: threading.Event) -> None:
    """Empty the queue every few seconds: no worker consumes it, and it would grow for the whole run."""
    import redis

    client = redis.Redis.from_url(redis_url)
    while not stop.wait(DRAIN_SECONDS):
        client.delete(QUEUE)
    client.close()


def _measure_database(
    replica_counts: list[int], count: int, schedules: int, seconds: float, kills: int, logs: Path
) -> list[dict[str, Any]]:
    """Every replica count against this process's DATABASE_URL; return one result each."""
    import django

    django.setup()
    from django.db import connection

    from scheduler.models import Schedule

    env = {**os.environ, **LEASE_ENV}
    rng = random.Random(0)
    stop = threading.Event()
    threading.Thread(target=_drain, args=(os.environ["REDIS_URL"], stop), daemon=True).start()
    results = []
    for size in replica_counts:
        progress(f"{connection.vendor}: {size} replica(s), {count} shards, {schedules} every-second schedules")
        started = time.monotonic()
        first_id = _make_schedules(schedules)
        replicas = Replicas(env, logs, f"{connection.vendor}-{size}")
        try:
            for _ in range(size):
                replicas.start()
            replicas.wait_ready()
            _wait_balanced(count, replicas, "at start")
            if not wait_until(lambda: _caught_up(first_id), timeout=BALANCE_WAIT, interval=0.2):
                raise SystemExit(f"the replicas did not catch up with the schedules within {BALANCE_WAIT:.0f}s")
            steady = _steady(count, replicas, seconds, first_id)
            progress(
                f"  steady: {steady['executions']} executions in {steady['window_seconds']:.1f}s, "
                f"dispatches per replica {steady['dispatches']['per_replica']}, "
                f"{steady['cpu_ms_per_execution'] or 0:.3f} CPU ms per execution"
            )
            failover = {}
            if size >= 2 and kills:
                for name, sig in SIGNALS.items():
                    failover[name] = _kill_loop(count, replicas, sig, kills, rng)
        finally:
            replicas.stop()
            Schedule.objects.filter(pk__gte=first_id).update(enabled=False)
        results.append(
            {
                "system": connection.vendor,
                "replicas": size,
                "shards": count,
                "schedules": schedules,
                "steady": steady,
                "failover": failover,
                "slots": _slot_counts(first_id),
                "elapsed_seconds": time.monotonic() - started,
            }
        )
    stop.set()
    return results


# --- the orchestrator ---------------------------------------------------------------------


def _print_tables(results: list[dict[str, Any]]) -> None:
    rows = []
    for r in results:
        s = r["steady"]
        per_replica = [ms for ms in s["cpu_ms_per_execution_per_replica"] if ms is not None]
        rows.append(
            [
                r["system"],
                r["replicas"],
                f"{s['shards']['min']}-{s['shards']['max']}",
                s["shards_changed_hands"],
                s["executions"],
                s["executions_per_second"],
                f"{s['dispatches']['min']:,}-{s['dispatches']['max']:,}",
                s["dispatches"]["mean"],
                dash_if_none(s["dispatches"]["max_deviation_pct"]),
                s["cpu_seconds"],
                dash_if_none(s["cpu_ms_per_execution"]),
                f"{min(per_replica):.3f}-{max(per_replica):.3f}" if per_replica else "-",
            ]
        )
    print()
    print(
        table(
            [
                "database",
                "replicas",
                "shards/replica",
                "changed hands",
                "committed",
                "per s",
                "dispatches/replica",
                "mean",
                "max dev %",
                "beat CPU s",
                "CPU ms/exec",
                "per replica ms/exec",
            ],
            rows,
        )
    )
    rows = []
    for r in results:
        for name, f in r["failover"].items():
            rows.append(
                [
                    r["system"],
                    r["replicas"],
                    name,
                    f["kills"],
                    f"{f['shards'] - f['not_taken']}/{f['shards']}",
                    dash_if_none(f["median_seconds"]),
                    dash_if_none(f["p90_seconds"]),
                    dash_if_none(f["max_seconds"]),
                    r["slots"]["duplicates"],
                    r["slots"]["gaps"],
                ]
            )
        if not r["failover"]:
            rows.append(
                [r["system"], r["replicas"], "-", 0, "-", "-", "-", "-", r["slots"]["duplicates"], r["slots"]["gaps"]]
            )
    print()
    print(
        table(
            [
                "database",
                "replicas",
                "signal",
                "kills",
                "shards taken",
                "takeover median s",
                "p90 s",
                "max s",
                "duplicates (run)",
                "gaps (run)",
            ],
            rows,
        )
    )
    print(
        "takeover: kill -> acquired_at of each of the killed replica's shards under a newer token (database clock);"
        " duplicates and gaps: every slot of every schedule over the replica count's whole run.\n"
        "per replica ms/exec: a replica's CPU over the rows it committed in the window; shard 0's holder also reconciles and,"
        " on SQLite, publishes for all."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="1,3,5", help="beat replica counts, one run each (default 1,3,5)")
    parser.add_argument("--shards", type=int, default=64, help="SCHEDULER_SHARDS (default 64)")
    parser.add_argument("--schedules", type=int, default=1000, help="every-second schedules (default 1000)")
    parser.add_argument("--seconds", type=float, default=30.0, help="steady window per replica count (default 30)")
    parser.add_argument("--kills", type=int, default=3, help="kills per signal with 2 replicas or more (default 3)")
    add_databases_option(parser)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--logs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        replica_counts = whole_numbers(args.replicas)
    except ValueError:
        parser.error("--replicas takes comma-separated whole numbers, e.g. 1,3,5")
    if not replica_counts or min(replica_counts) < 1:
        parser.error("--replicas must be at least 1")
    if args.shards < 2 or args.schedules < 1 or args.seconds <= 0 or args.kills < 0:
        parser.error("--shards must be at least 2, --schedules at least 1, --seconds positive and --kills at least 0")

    if args.child:
        results = _measure_database(
            replica_counts, args.shards, args.schedules, args.seconds, args.kills, Path(args.logs)
        )
        print(json.dumps(results), flush=True)
        return 0

    load_before = os.getloadavg()
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    with migrated_databases(args.databases, debug=False) as services:
        for env in services.environments.values():
            command = child_command(
                "bench.shards",
                replicas=args.replicas,
                shards=args.shards,
                schedules=args.schedules,
                seconds=args.seconds,
                kills=args.kills,
                logs=services.scratch,
            )
            results += run_child(command, {**env, "SCHEDULER_SHARDS": str(args.shards)})
    elapsed = time.monotonic() - started
    load = {"before": load_before, "after": os.getloadavg()}

    _print_tables(results)
    print(
        f"load average (1/5/15 min) before {load['before']}, after {load['after']} on {os.cpu_count()} cpus;"
        " on 2 cores more replicas spread the work, they do not speed it up"
    )
    print(f"\ntook {elapsed / 60:.1f} min")
    write_results(
        "shards",
        {
            "settings": {
                "replicas": replica_counts,
                "SCHEDULER_SHARDS": args.shards,
                "schedules": args.schedules,
                "schedule_interval_seconds": 1,
                "steady_seconds": args.seconds,
                "kills_per_signal": args.kills,
                **{name: float(value) for name, value in LEASE_ENV.items()},
            },
            "note": "On 2 cores this shows the spread, not a speed-up: all replicas share two cores with PostgreSQL.",
            "elapsed_seconds": elapsed,
            "load_average": load,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
