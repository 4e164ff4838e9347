"""Failover gap: how long dispatch stops when the beat leader is killed, and which slots it costs.

Three ``celery -A project beat`` replicas run one every-second schedule
(``interval=1``) on PostgreSQL and, separately, on SQLite; no worker runs,
because the leader commits an Execution row for every slot before sending it.
The leader (the pid in ``leases.current("beat").holder``) is killed with
SIGKILL, then with SIGTERM, ``--kills`` times each. For each kill:

- takeover: ``acquired_at`` of the lease under a newer token (database
  clock, same machine), minus the moment of the kill (seconds of wall time);
- gap: ``created_at`` of the first Execution row committed under a newer
  lease token, minus the moment of the kill. It also waits for the next
  one-second slot to come due, so even an instant takeover leaves a gap of
  half a second on average: the takeover is the figure for the lease itself;
- after the takeover the killed replica is restarted, so three always run,
  and the next kill waits for a few seconds of steady state.

After each (database, signal) run, every one-second slot between the run's
first and last slot must have exactly one row: a slot with two rows is a
duplicate, a slot with none (or recorded ``missed``/``skipped``) a miss.

Peer: celery-redbeat, two replicas of ``bench.redbeat_app`` in the
benchmark's own virtualenv ``bench/.venv-peers`` (created on first use from
``requirements.txt`` and ``bench/requirements-peers.txt``). The leader is the
replica that logged ``beat: Acquired lock``; sends are timed from its
``Sending due task`` log lines. Two configurations:

- lock 10 s: ``redbeat_lock_timeout=10`` with ``--max-interval 1`` (the lock
  must outlive a loop), killed like the project's replicas;
- default lock: RedBeat's defaults (loop interval 300 s, lock 5 × that). A
  takeover can take many minutes, so each kill starts a fresh pair of
  replicas, waits at most ``PEER_DEFAULT_WAIT`` seconds and runs only
  ``--default-lock-kills`` kills per signal.

RedBeat records nothing per slot, so its slots are inferred from the gaps
between consecutive sends (all replicas' logs merged, up to the moment the
replicas are stopped): a gap of n seconds holds n - 1 missed slots, and two
sends less than half a second apart are a duplicate.

Run: ``python -m bench.failover [--kills 10] [--skip-peers] [--databases postgresql,sqlite]``
(it starts its own PostgreSQL and Redis). Writes ``bench/results/failover.json``:
each result carries the previous run's figures for the same system and
signal under ``before`` (printed beside the new ones), and the previous
results of systems not measured this time are kept as they were.
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
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    LEASE_ENV,
    RESULTS_DIR,
    add_databases_option,
    child_command,
    dash_if_none,
    migrated_databases,
    peers_python,
    progress,
    run_child,
    table,
    write_results,
)
from tests.support.processes import CeleryProcess, beat_argv, pid_of, wait_until

SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
REPLICAS = 3
PEER_REPLICAS = 2
#: Lease settings of the project's replicas (its documented defaults).
TAKEOVER_WAIT = 40.0  # seconds a follower has to dispatch after a kill
STARTUP_WAIT = 60.0  # seconds a replica has to start
STEADY_SECONDS = 3.0  # between a takeover (and restart) and the next kill, plus up to 1 s at random
PEER_LOCK_TIMEOUT = 10  # seconds, the tuned RedBeat configuration
PEER_DEFAULT_WAIT = 120.0  # seconds a RedBeat standby has to take over with the default lock
PEER_SEND = re.compile(r"^\[(\d+\.\d+): \w+/[^\]]*\] Scheduler: Sending due task", re.MULTILINE)
PEER_LOCK = re.compile(r"lock -> `[^`]*` .*\((\d+(?:\.\d+)?)s\)")


# --- the kill loop, shared by the project and the peer -------------------------------------


class Cluster:
    """Beat replicas of one implementation: start, find the leader, time the first dispatch."""

    #: Log line a replica writes once it is up and contending for leadership.
    ready = r"beat: Starting\.\.\."
    #: Whether ``takeover_after`` can tell when the lease changed hands.
    measures_takeover = False

    def __init__(self, start: Callable[[int], CeleryProcess], size: int) -> None:
        self._start = start
        self._started = 0
        self.replicas = [self.start() for _ in range(size)]

    def start(self) -> CeleryProcess:
        self._started += 1
        return self._start(self._started)

    def leader(self) -> tuple[CeleryProcess, Any] | None:
        """Return (the leading replica, a marker of its term), or None while nobody leads."""
        raise NotImplementedError

    def steady(self, marker: Any) -> bool:
        """Return whether the leader of this term has dispatched a few slots already."""
        raise NotImplementedError

    def first_dispatch_after(self, marker: Any, killed: CeleryProcess, killed_at: float) -> float | None:
        """Return the Unix time of the first dispatch of a later term, or None."""
        raise NotImplementedError

    def takeover_after(self, marker: Any) -> float | None:
        """Return the Unix time a later term began (the lease changed hands), or None."""
        raise NotImplementedError

    def describe_kill(self, marker: Any) -> dict[str, Any]:
        return {}

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()


def _wait_ready(cluster: Cluster) -> None:
    for replica in cluster.replicas:
        if not wait_until(lambda r=replica: re.search(cluster.ready, r.log()), timeout=STARTUP_WAIT, interval=0.2):
            raise SystemExit(
                f"{replica.name} did not start within {STARTUP_WAIT:.0f}s; log tail:\n{replica.log()[-3000:]}"
            )


def kill_leaders(cluster: Cluster, sig: int, kills: int, *, wait: float, rng: random.Random) -> list[dict[str, Any]]:
    """Kill the leader ``kills`` times with ``sig``; return one sample per kill.

    Each sample has the gap in seconds from the kill to the first dispatch of
    the next leader (None when nobody dispatched within ``wait``) and, where
    the cluster tells, the takeover: from the kill to the new term. The
    killed replica is restarted once the takeover happened (or the wait ran out).
    """
    samples = []
    _wait_ready(cluster)
    for number in range(kills):
        found = wait_until(cluster.leader, timeout=STARTUP_WAIT, interval=0.1)
        if not found:
            raise SystemExit(f"no leader within {STARTUP_WAIT:.0f}s before kill {number + 1}")
        leader, marker = found
        if not wait_until(lambda: cluster.steady(marker), timeout=STARTUP_WAIT, interval=0.1):
            raise SystemExit(f"the leader dispatched nothing within {STARTUP_WAIT:.0f}s before kill {number + 1}")
        time.sleep(rng.uniform(0.0, 1.0))  # kill at a random point of the one-second cycle
        details = cluster.describe_kill(marker)
        killed_at = time.time()
        os.kill(leader.pid, sig)
        took = (
            wait_until(lambda: cluster.takeover_after(marker), timeout=wait, interval=0.01)
            if cluster.measures_takeover
            else None
        )
        dispatched = wait_until(
            lambda: cluster.first_dispatch_after(marker, leader, killed_at), timeout=wait, interval=0.05
        )
        gap = None if dispatched is None else dispatched - killed_at
        takeover = None if took is None else took - killed_at
        samples.append(
            {"pid": leader.pid, "killed_at": killed_at, "takeover_seconds": takeover, "gap_seconds": gap, **details}
        )
        progress(
            f"  kill {number + 1}/{kills} ({signal.Signals(sig).name}): "
            + (f"takeover {takeover:.3f}s, " if takeover is not None else "")
            + (f"gap {gap:.2f}s" if gap is not None else f"no takeover within {wait:.0f}s")
        )
        leader.stop()
        index = cluster.replicas.index(leader)
        cluster.replicas[index] = cluster.start()
        _wait_ready(cluster)
        time.sleep(STEADY_SECONDS)
    return samples


def gap_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    gaps = [s["gap_seconds"] for s in samples if s["gap_seconds"] is not None]
    takeovers = [s["takeover_seconds"] for s in samples if s.get("takeover_seconds") is not None]
    return {
        "kills": len(samples),
        "takeovers": len(gaps),
        "takeover_median_seconds": statistics.median(takeovers) if takeovers else None,
        "takeover_p90_seconds": p90(takeovers),
        "takeover_max_seconds": max(takeovers) if takeovers else None,
        "gap_min_seconds": min(gaps) if gaps else None,
        "gap_median_seconds": statistics.median(gaps) if gaps else None,
        "gap_p90_seconds": p90(gaps),
        "gap_max_seconds": max(gaps) if gaps else None,
    }


def p90(values: list[float]) -> float | None:
    """The 90th percentile (interpolated between samples), or None without samples."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


# --- the project's beat, inside one database's child process -----------------------------


def _measure_database(kills: int, logs: Path) -> list[dict[str, Any]]:
    """Run the kill loop per signal against this process's DATABASE_URL; return one result per signal."""
    import django

    django.setup()
    from django.db import connection

    from scheduler.models import Execution, Schedule
    from scheduler.owners import leases, schedules

    env = {**os.environ, **LEASE_ENV}

    class ProjectCluster(Cluster):
        ready = r"beat replica \S+ started"
        measures_takeover = True

        def __init__(self, schedule: Schedule, tag: str) -> None:
            self.schedule = schedule
            super().__init__(
                lambda n: CeleryProcess(f"beat{n}", beat_argv(), env, logs / f"{tag}-beat{n}.log").start(), REPLICAS
            )

        def leader(self) -> tuple[CeleryProcess, int] | None:
            state = leases.current("beat")
            if not state.is_held:
                return None
            pid = pid_of(state.holder)
            leader = next((r for r in self.replicas if r.pid == pid and r.alive()), None)
            return (leader, state.token) if leader else None

        def rows(self) -> Any:
            return Execution.objects.filter(schedule=self.schedule)

        def steady(self, token: int) -> bool:
            return self.rows().filter(lease_token=token).count() >= 3

        def first_dispatch_after(self, token: int, killed: CeleryProcess, killed_at: float) -> float | None:
            first = self.rows().filter(lease_token__gt=token).order_by("created_at").first()
            return None if first is None else first.created_at.timestamp()

        def takeover_after(self, token: int) -> float | None:
            state = leases.current("beat")
            return state.acquired_at.timestamp() if state.token > token and state.acquired_at else None

        def describe_kill(self, token: int) -> dict[str, Any]:
            return {"token": token}

    rng = random.Random(0)
    results = []
    for name, sig in SIGNALS.items():
        schedule = Schedule(name=f"failover-{name.lower()}", task="bench.noop", interval=1)
        schedule.full_clean()
        schedules.save(schedule)
        progress(f"{connection.vendor}, {name}: {REPLICAS} replicas, {kills} kills")
        cluster = ProjectCluster(schedule, name.lower())
        try:
            samples = kill_leaders(cluster, sig, kills, wait=TAKEOVER_WAIT, rng=rng)
        finally:
            cluster.stop()
            Schedule.objects.filter(pk=schedule.pk).update(enabled=False)
        for sample in samples:
            newer = cluster.rows().filter(lease_token__gt=sample["token"]).order_by("created_at").first()
            sample["new_token"] = newer.lease_token if newer else None
        results.append(
            {
                "system": connection.vendor,
                "signal": name,
                "replicas": REPLICAS,
                **gap_summary(samples),
                **_slot_counts(list(cluster.rows().values_list("scheduled_for", "status"))),
                "samples": samples,
            }
        )
    return results


def _slot_counts(rows: list[tuple[Any, str]]) -> dict[str, int]:
    """Count the one-second slots between the first and last row, duplicated and missed ones."""
    if not rows:
        return {"slots": 0, "rows": 0, "duplicates": 0, "misses": 0}
    per_slot = Counter(slot for slot, _ in rows)
    slots = int((max(per_slot) - min(per_slot)).total_seconds()) + 1
    not_run = sum(1 for _, status in rows if status in ("missed", "skipped"))
    return {
        "slots": slots,
        "rows": len(rows),
        "duplicates": sum(count - 1 for count in per_slot.values()),
        "misses": slots - len(per_slot) + not_run,
    }


# --- the RedBeat peer ----------------------------------------------------------------------


class RedBeatCluster(Cluster):
    """RedBeat replicas; the leader is the live replica whose log says it acquired the lock."""

    #: RedBeat's lock key with its default key prefix.
    lock_key = "redbeat::lock"

    def __init__(
        self, celery: Path, redis_url: str, client: Any, logs: Path, tag: str, *, lock_timeout: int | None
    ) -> None:
        self.client = client
        env = {key: value for key, value in os.environ.items() if not key.startswith(("SCHEDULER_", "REDBEAT_"))}
        env.update(REDIS_URL=redis_url, PYTHONUNBUFFERED="1")
        argv = [
            str(celery),
            "-A",
            "bench.redbeat_app",
            "beat",
            "-S",
            "redbeat.RedBeatScheduler",
            "-l",
            "info",
            "--pidfile=",
        ]
        if lock_timeout is not None:
            env["REDBEAT_LOCK_TIMEOUT"] = str(lock_timeout)
            argv += ["--max-interval", "1"]
        self.started: list[CeleryProcess] = []

        def start(n: int) -> CeleryProcess:
            process = CeleryProcess(f"redbeat{n}", argv, env, logs / f"{tag}-redbeat{n}.log").start()
            self.started.append(process)
            return process

        super().__init__(start, PEER_REPLICAS)

    def leader(self) -> tuple[CeleryProcess, CeleryProcess] | None:
        leader = next((r for r in self.replicas if r.alive() and "beat: Acquired lock" in r.log()), None)
        return (leader, leader) if leader else None

    def steady(self, leader: CeleryProcess) -> bool:
        return len(_sends(leader)) >= 3

    def first_dispatch_after(self, leader: CeleryProcess, killed: CeleryProcess, killed_at: float) -> float | None:
        later = [t for r in self.replicas if r is not killed for t in _sends(r) if t > killed_at]
        return min(later) if later else None

    def describe_kill(self, leader: CeleryProcess) -> dict[str, Any]:
        return {"lock_ttl_left_seconds": self.client.pttl(self.lock_key) / 1000}

    def lock_timeout(self) -> float | None:
        found = PEER_LOCK.search(self.replicas[0].log())
        return float(found.group(1)) if found else None

    def sends(self) -> list[float]:
        return sorted(t for process in self.started for t in _sends(process))


def _sends(process: CeleryProcess) -> list[float]:
    return [float(t) for t in PEER_SEND.findall(process.log())]


def _send_counts(sends: list[float], stopped_at: float) -> dict[str, int]:
    """Infer duplicated and missed one-second slots from send times (see the module docstring)."""
    if not sends:
        return {"sends": 0, "duplicates": 0, "misses": 0}
    steps = [b - a for a, b in zip(sends, sends[1:])]
    return {
        "sends": len(sends),
        "duplicates": sum(1 for step in steps if step < 0.5),
        "misses": sum(max(0, round(step) - 1) for step in steps) + max(0, int(stopped_at - sends[-1]) - 1),
    }


def _measure_redbeat(
    celery: Path, redis_url: str, logs: Path, kills: int, default_lock_kills: int
) -> list[dict[str, Any]]:
    """Kill the RedBeat leader with the tuned lock (one cluster per signal) and the default one (fresh per kill)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    rng = random.Random(0)
    results = []
    for label, lock_timeout, rounds, per_round, wait in (
        (f"redbeat, lock {PEER_LOCK_TIMEOUT} s", PEER_LOCK_TIMEOUT, 1, kills, TAKEOVER_WAIT),
        ("redbeat, default lock", None, default_lock_kills, 1, PEER_DEFAULT_WAIT),
    ):
        for name, sig in SIGNALS.items() if rounds else ():
            progress(f"{label}, {name}: {PEER_REPLICAS} replicas, {rounds * per_round} kills")
            samples: list[dict[str, Any]] = []
            counts: Counter[str] = Counter(sends=0, duplicates=0, misses=0)
            lock_seconds = None
            for round_number in range(rounds):
                client.flushdb()
                tag = f"{'tuned' if lock_timeout else 'default'}-{name.lower()}-{round_number}"
                cluster = RedBeatCluster(celery, redis_url, client, logs, tag, lock_timeout=lock_timeout)
                try:
                    samples += kill_leaders(cluster, sig, per_round, wait=wait, rng=rng)
                finally:
                    cluster.stop()
                stopped_at = time.time()
                counts.update(_send_counts(cluster.sends(), stopped_at))
                lock_seconds = cluster.lock_timeout()
            results.append(
                {
                    "system": label,
                    "signal": name,
                    "replicas": PEER_REPLICAS,
                    "lock_timeout_seconds": lock_seconds,
                    "takeover_wait_seconds": wait,
                    **gap_summary(samples),
                    **counts,
                    "samples": samples,
                }
            )
    client.close()
    return results


# --- the orchestrator ----------------------------------------------------------------------


def _previous_run() -> dict[str, Any]:
    """The last run's document, read before this run overwrites it (empty without one)."""
    path = RESULTS_DIR / "failover.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _with_before(results: list[dict[str, Any]], previous: dict[str, Any]) -> list[dict[str, Any]]:
    """Attach the previous run's figures to each new result; keep the previous results not measured again."""
    old = {(r["system"], r["signal"]): r for r in previous.get("results", [])}
    for r in results:
        was = old.pop((r["system"], r["signal"]), None)
        if was is not None:
            r["before"] = {
                "measured_at": was.get("measured_at", previous.get("measured_at")),
                **{k: v for k, v in gap_summary(was["samples"]).items() if k.endswith("_seconds") and v is not None},
            }
    kept = [{"measured_at": previous.get("measured_at"), **r} if "measured_at" not in r else r for r in old.values()]
    return results + kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="kills per signal and system (default 10)")
    add_databases_option(parser)
    parser.add_argument("--skip-peers", action="store_true", help="do not measure celery-redbeat")
    parser.add_argument(
        "--default-lock-kills",
        type=int,
        default=1,
        help=f"kills per signal for RedBeat's default lock, each waiting up to {PEER_DEFAULT_WAIT:.0f}s (default 1)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--logs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.kills < 1 or args.default_lock_kills < 0:
        parser.error("--kills must be at least 1 and --default-lock-kills at least 0")

    if args.child:
        print(json.dumps(_measure_database(args.kills, Path(args.logs))), flush=True)
        return 0

    previous = _previous_run()
    load_before = os.getloadavg()
    started = time.monotonic()
    celery = None if args.skip_peers else peers_python().with_name("celery")
    results: list[dict[str, Any]] = []
    with migrated_databases(args.databases, debug=True) as services:
        for env in services.environments.values():
            results += run_child(child_command("bench.failover", kills=args.kills, logs=services.scratch), env)
        if celery is not None:
            peer_redis = services.redis_url.rsplit("/", 1)[0] + "/1"
            results += _measure_redbeat(celery, peer_redis, services.scratch, args.kills, args.default_lock_kills)
    elapsed = time.monotonic() - started
    load = {"before": load_before, "after": os.getloadavg()}
    measured, results = results, _with_before(results, previous)

    rows = []
    for r in measured:
        before = r.get("before", {})
        rows.append(
            [
                r["system"],
                r["signal"],
                r["kills"],
                f"{r['takeovers']}/{r['kills']}",
                dash_if_none(r.get("takeover_median_seconds")),
                dash_if_none(r.get("takeover_p90_seconds")),
                dash_if_none(r["gap_median_seconds"]),
                dash_if_none(r.get("gap_p90_seconds")),
                dash_if_none(before.get("gap_median_seconds")),
                dash_if_none(before.get("gap_p90_seconds")),
                r["duplicates"],
                r["misses"],
            ]
        )
    print()
    print(
        table(
            [
                "system",
                "signal",
                "kills",
                "took over",
                "takeover median s",
                "takeover p90 s",
                "gap median s",
                "gap p90 s",
                "before: gap median s",
                "before: gap p90 s",
                "duplicates",
                "misses",
            ],
            rows,
        )
    )
    print(
        "takeover: kill -> the lease under a new token; gap: kill -> first row committed under it (waits for the"
        " next one-second slot too). The previous run measured only the gap."
    )
    print(f"load average (1/5/15 min) before {load['before']}, after {load['after']} on {os.cpu_count()} cpus")
    for r in measured:
        if r["takeovers"] < r["kills"]:
            print(
                f"{r['system']} ({r['signal']}): no takeover within {r.get('takeover_wait_seconds', TAKEOVER_WAIT):.0f}s "
                f"in {r['kills'] - r['takeovers']} of {r['kills']} kills"
                + (f" (lock timeout {r['lock_timeout_seconds']:.0f}s)" if r.get("lock_timeout_seconds") else "")
            )
    print(f"\ntook {elapsed / 60:.1f} min")
    write_results(
        "failover",
        {
            "settings": {
                "project": {
                    "replicas": REPLICAS,
                    **{name: float(value) for name, value in LEASE_ENV.items()},
                    "schedule_interval_seconds": 1,
                    "takeover_wait_seconds": TAKEOVER_WAIT,
                },
                "redbeat": {
                    "replicas": PEER_REPLICAS,
                    "tuned_lock_timeout_seconds": PEER_LOCK_TIMEOUT,
                    "tuned_max_interval_seconds": 1,
                    "default_lock_wait_seconds": PEER_DEFAULT_WAIT,
                    "default_lock_kills_per_signal": args.default_lock_kills,
                    "skipped": args.skip_peers,
                },
                "kills_per_signal": args.kills,
                "steady_seconds_between_kills": STEADY_SECONDS,
            },
            "elapsed_seconds": elapsed,
            "load_average": load,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
