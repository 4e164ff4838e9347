"""Chaos soak: beats, workers and the broker fail at random; nothing is lost or run twice.

Three beat replicas and two workers run 30 every-second schedules and 5 long
tasks with timeouts, on the test database and a broker of the test's own.
Every few seconds a seeded random fault hits: the leader is SIGKILLed,
frozen past its lease (SIGSTOP, then SIGCONT) or stopped (SIGTERM); a worker
is SIGKILLed mid-task; the broker restarts (losing its queues). Killed
processes are started again. At the end the test waits for quiescence, runs
``reconcile`` and checks the guarantees on the rows and on the side-effect
log the tasks write to a Redis of their own (which never restarts).

``CHAOS_DURATION`` (seconds, default 60) and ``CHAOS_SEED`` pick the run;
``make chaos DURATION=600`` runs the long one. The summary line is printed.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

from scheduler import leases
from scheduler.models import Execution, Schedule
from tests import tasks as test_tasks
from tests.processes import ROOT, CeleryProcess, wait_until
from tests.services import find_redis_server, free_port

pytestmark = pytest.mark.django_db(transaction=True)

DURATION = float(os.environ.get("CHAOS_DURATION", "60"))
SEED = int(os.environ.get("CHAOS_SEED", "20261125"))
#: Short leases and thresholds so recovery happens within the run.
SETTINGS = {
    "lease_ttl_seconds": 3,
    "lease_renew_seconds": 1,
    "claim_seconds": 3,
    "claim_renew_seconds": 1,
    "reconcile_interval_seconds": 2,
    "reconcile_pending_after_seconds": 3,
    "reconcile_queued_after_seconds": 8,
}
FAULTS = ("leader_sigkill", "leader_freeze", "leader_sigterm", "worker_sigkill", "broker_restart")


class Broker:
    """A redis-server on a fixed port that can be restarted (without persistence: queues are lost)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="chaos-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [find_redis_server(), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir),
             "--save", "", "--appendonly", "no", "--logfile", str(self.dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        assert wait_until(lambda: _pings(client), timeout=10), "the chaos broker did not start"
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture
def broker() -> Iterator[Broker]:
    server = Broker()
    server.start()
    yield server
    server.stop()


def _leader(beats: list[CeleryProcess]) -> CeleryProcess | None:
    state = leases.current("beat")
    if not state.is_held:
        return None
    pid = int(state.holder.rsplit("-", 2)[1])
    return next((beat for beat in beats if beat.pid == pid and beat.alive()), None)


@pytest.mark.timeout(DURATION + 600)
def test_chaos_soak__every_slot_once_nothing_run_twice_nothing_lost(
    celery_processes: Callable[..., CeleryProcess], process_env: dict[str, str], redis_url: str,
    redis_client: redis.Redis, broker: Broker,
) -> None:
    rng = random.Random(SEED)
    # Tasks log to the suite's Redis, which never restarts; the broker is the chaos one.
    process_env.update(REDIS_URL=broker.url, CELERY_BROKER_URL=broker.url, TEST_RUNS_REDIS_URL=redis_url)
    every_second = [
        Schedule(name=f"tick-{n:02d}", task="tests.record", interval=1, kwargs={"label": f"tick-{n:02d}"}, max_retries=5)
        for n in range(30)
    ]
    long = [
        Schedule(name=f"long-{n}", task="tests.record", interval=10, timeout=6, max_retries=5,
                 kwargs={"label": f"long-{n}", "seconds": 4})
        for n in range(5)
    ]
    for schedule in [*every_second, *long]:
        schedule.full_clean()
        schedule.save()

    def start(kind: str, name: str) -> CeleryProcess:
        return celery_processes(kind, name, concurrency=4, **SETTINGS)

    workers = [start("worker", f"w{n}") for n in (1, 2)]
    for worker in workers:
        worker.wait_for_log(r"ready\.")
    beats = [start("beat", f"beat{n}") for n in (1, 2, 3)]
    started_at = leases.db_now()
    injected: Counter[str] = Counter()
    crashed: Counter[str] = Counter()  # processes that exited by themselves (restarted too)
    restarts = 0

    pending_faults: list[str] = []
    deadline = time.monotonic() + DURATION
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(3, 6))
        if not pending_faults:  # every kind once per round, in a random order
            pending_faults = rng.sample(FAULTS, len(FAULTS))
        fault = pending_faults.pop()
        leader = _leader(beats)
        victim: CeleryProcess | None = None
        if fault.startswith("leader") and leader is None:
            continue  # a takeover is under way; the next fault will find a leader
        if fault == "leader_sigkill":
            victim = leader
            leader.kill_group(signal.SIGKILL)
        elif fault == "leader_sigterm":
            victim = leader
            leader.send(signal.SIGTERM)
        elif fault == "leader_freeze":
            leader.send(signal.SIGSTOP)
            time.sleep(SETTINGS["lease_ttl_seconds"] + 2)  # frozen past its lease: a zombie when resumed
            leader.send(signal.SIGCONT)
        elif fault == "worker_sigkill":
            victim = rng.choice(workers)
            victim.kill_group(signal.SIGKILL)
        else:
            broker.stop()
            time.sleep(1)
            broker.start()
        injected[fault] += 1
        if victim is not None:
            assert wait_until(lambda v=victim: not v.alive(), timeout=20), f"{victim.name} did not stop"
        # Act as the supervisor (systemd, Kubernetes, compose's restart policy):
        # start again whatever is not running, whether a fault or a crash stopped it.
        time.sleep(0.5)
        for group, kind in ((beats, "beat"), (workers, "worker")):
            for index, process in enumerate(group):
                if process.alive():
                    continue
                if process is not victim:
                    crashed[kind] += 1
                process.stop(timeout=1)
                restarts += 1
                group[index] = start(kind, f"{kind}-restart-{restarts}")
    ended_at = leases.db_now()

    # Quiescence: stop dispatching, then reconcile (as an operator would) until
    # every execution a fault left behind is re-sent, retried or failed.
    Schedule.objects.update(enabled=False)
    settle_deadline = time.monotonic() + 120
    while Execution.objects.exclude(status__in=Execution.FINAL_STATUSES).exists() and time.monotonic() < settle_deadline:
        subprocess.run(
            [sys.executable, "manage.py", "reconcile"], cwd=ROOT, env={**process_env, **_as_env(SETTINGS)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, check=False,
        )
        time.sleep(2)
    settled = not Execution.objects.exclude(status__in=Execution.FINAL_STATUSES).exists()
    open_rows = Counter(Execution.objects.exclude(status__in=Execution.FINAL_STATUSES).values_list("status", flat=True))
    executions = list(Execution.objects.filter(created_at__gte=started_at - timedelta(seconds=5)))

    # 1. every slot of every every-second schedule has exactly one execution
    by_schedule: dict[int, list[Any]] = defaultdict(list)
    for execution in executions:
        by_schedule[execution.schedule_id].append(execution.scheduled_for)
    gaps, doubles = 0, 0
    for schedule in every_second:
        slots = sorted(by_schedule[schedule.pk])
        doubles += len(slots) - len(set(slots))
        first, last = slots[0], slots[-1]
        gaps += int((last - first).total_seconds()) + 1 - len(set(slots))
    # 2. no execution ran twice: each claim (attempt) ran its body at most once, and
    #    no two bodies of one execution overlapped. A body interrupted after its side
    #    effect (its process killed before the outcome was recorded) is run again as
    #    a new attempt; that is counted, not failed (tasks dedupe on current_execution()).
    events = test_tasks.events(redis_client)
    starts = Counter((event["execution_id"], event["attempt"]) for event in events if event["event"] == "start")
    ran_twice = {key: n for key, n in starts.items() if n > 1}
    concurrent = _overlapping_runs(events)
    stops = Counter(event["execution_id"] for event in events if event["event"] == "stop")
    rerun_after_interruption = sum(1 for n in stops.values() if n > 1)
    # 3. no slot inside the catch-up window was lost
    missed = sum(1 for e in executions if e.status == Execution.Status.MISSED)
    # 4. every execution is in a final state
    statuses = Counter(e.status for e in executions)
    summary = {
        "seed": SEED, "duration_s": DURATION, "faults": dict(injected), "restarts": restarts, "crashed": dict(crashed),
        "executions_checked": len(executions), "statuses": dict(statuses), "duplicates": doubles + len(ran_twice), "rerun_after_interruption": rerun_after_interruption,
        "lost": gaps + missed, "concurrent_runs": len(concurrent), "not_final": dict(open_rows),
        "window": [started_at.isoformat(), ended_at.isoformat()],
    }
    print("\nchaos summary: " + json.dumps(summary))
    Path(os.environ.get("CHAOS_SUMMARY", tempfile.gettempdir() + "/chaos-summary.json")).write_text(json.dumps(summary, indent=2))

    assert sum(injected.values()) >= DURATION // 8 and set(injected) == set(FAULTS), summary
    assert doubles == 0 and gaps == 0, summary
    assert not ran_twice and not concurrent, summary
    assert missed == 0, summary
    assert settled and not open_rows, summary
    succeeded = {e.pk for e in executions if e.status == Execution.Status.SUCCEEDED}
    assert succeeded <= set(stops), "an execution recorded succeeded never finished its body"


def _as_env(settings: dict[str, Any]) -> dict[str, str]:
    return {f"SCHEDULER_{key.upper()}": str(value) for key, value in settings.items()}


def _overlapping_runs(events: list[dict[str, Any]]) -> list[int]:
    """Execution ids whose bodies ran at the same time in two processes."""
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    open_starts: dict[tuple[int, int], float] = {}
    for event in events:
        key = (event["execution_id"], event["pid"])
        if event["event"] == "start":
            open_starts[key] = event["at"]
        elif key in open_starts:
            spans[event["execution_id"]].append((open_starts.pop(key), event["at"]))
    overlapping = []
    for execution_id, runs in spans.items():
        runs.sort()
        if any(later[0] < earlier[1] for earlier, later in zip(runs, runs[1:])):
            overlapping.append(execution_id)
    return overlapping
