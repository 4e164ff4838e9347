"""Chaos soak: beats, workers and the broker fail at random; nothing is lost, failed or run twice.

Three beat replicas and two workers run 30 every-second schedules and 5 long
tasks (3 of them with timeouts), all with the default settings
(``max_retries=0``), on the test database and a broker of the test's own.
Every few seconds a seeded random fault hits: the leader is SIGKILLed,
frozen past its lease (SIGSTOP, then SIGCONT) or stopped (SIGTERM); a worker
is SIGKILLed mid-task; a worker's pool child running a long body without a
timeout is frozen past its claim, then resumed; a worker's database sessions are terminated (PostgreSQL's
``pg_terminate_backend``); the broker restarts (losing its queues). Killed
processes are started again. At the end the test waits for quiescence, runs
``reconcile`` and checks the guarantees on the rows and on the side-effect
log the tasks write to a Redis of their own (which never restarts): every
slot from the schedules' creation to the end of the faults (database clock)
has exactly one execution, every execution succeeded (these tasks never
raise), no claim ran its body twice, no body completed after its claim
moved on, and no two bodies of one execution overlapped.

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
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from django.db import connection

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
#: A frozen pool child stays stopped past its claim, and long enough for a
#: reconcile pass to find the claim expired and let a successor take it.
FREEZE_SECONDS = SETTINGS["claim_seconds"] + SETTINGS["reconcile_interval_seconds"] + 1
LONG_INTERVAL_SECONDS = 10
LONG_BODY_SECONDS = 4
#: Long bodies work in steps (see ``tests.record``), so a frozen one resumes
#: with work left: its claim's loss must stop it before it completes.
LONG_STEP_SECONDS = 0.1
#: Well above the body, so no time limit fires in a healthy run. Only long
#: bodies without a timeout are frozen: the claim on one with a timeout holds
#: until its hard limit, which kills a body frozen that long (``timed_out``, rightly).
LONG_TIMEOUT_SECONDS = 10
LONG_WITH_TIMEOUT = 3
FAULTS = (
    "leader_sigkill", "leader_freeze", "leader_sigterm", "worker_sigkill", "worker_freeze", "worker_db_cut",
    "broker_restart",
)
#: Each process's database sessions carry this prefix and its name, so the test can cut them.
APPLICATION_NAME_PREFIX = "chaos-"


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
    # A database connection can be cut on PostgreSQL only (SQLite has none).
    faults = FAULTS if connection.vendor == "postgresql" else tuple(f for f in FAULTS if f != "worker_db_cut")
    # Tasks log to the suite's Redis, which never restarts; the broker is the chaos one.
    process_env.update(REDIS_URL=broker.url, CELERY_BROKER_URL=broker.url, TEST_RUNS_REDIS_URL=redis_url)
    database_url = process_env["DATABASE_URL"]
    # The run starts when the schedules are created (database clock): from
    # then on every slot is owed (misfire run_all, in the catch-up window).
    started_at = leases.db_now()
    every_second = [
        Schedule(name=f"tick-{n:02d}", task="tests.record", interval=1, kwargs={"label": f"tick-{n:02d}"})
        for n in range(30)
    ]
    long = [
        Schedule(name=f"long-{n}", task="tests.record", interval=LONG_INTERVAL_SECONDS,
                 timeout=LONG_TIMEOUT_SECONDS if n < LONG_WITH_TIMEOUT else None,
                 kwargs={"label": f"long-{n}", "seconds": LONG_BODY_SECONDS, "step": LONG_STEP_SECONDS})
        for n in range(5)
    ]
    schedules = [*every_second, *long]
    for schedule in schedules:
        schedule.full_clean()
        schedule.save(now=started_at)

    def start(kind: str, name: str) -> CeleryProcess:
        # celery_processes copies process_env at each start: this process's sessions carry its name.
        process_env["DATABASE_URL"] = _with_application_name(database_url, name)
        return celery_processes(kind, name, concurrency=4, **SETTINGS)

    workers = [start("worker", f"w{n}") for n in (1, 2)]
    for worker in workers:
        worker.wait_for_log(r"ready\.")
    beats = [start("beat", f"beat{n}") for n in (1, 2, 3)]
    injected: Counter[str] = Counter()
    crashed: Counter[str] = Counter()  # processes that exited by themselves (restarted too)
    restarts = 0
    frozen: list[tuple[int, int]] = []  # (execution id, attempt) of each body frozen past its claim
    sessions_cut = 0
    timeline: list[str] = []  # "<database time once done> <fault> <target>", to read rows and logs against

    pending_faults: list[str] = []
    deadline = time.monotonic() + DURATION
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(3, 6))
        if not pending_faults:  # every kind once per round, in a random order
            pending_faults = rng.sample(faults, len(faults))
        fault = pending_faults.pop()
        leader = _leader(beats)
        victim: CeleryProcess | None = None
        target = leader.name if fault.startswith("leader") and leader else ""
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
        elif fault == "worker_freeze":
            claim = _freeze_a_long_body(workers, [schedule.pk for schedule in long])
            if claim is None:
                continue  # no long body found running on a live worker; the next round tries again
            frozen.append(claim)
            target = f"execution {claim[0]} attempt {claim[1]}"
        elif fault == "worker_db_cut":
            cut = rng.choice(workers)
            sessions_cut += _cut_database_sessions(cut)
            target = cut.name
        else:
            broker.stop()
            time.sleep(1)
            broker.start()
        injected[fault] += 1
        timeline.append(f"{leases.db_now():%H:%M:%S} {fault} {victim.name if victim else target}")
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
    process_env["DATABASE_URL"] = database_url

    # Every slot up to the end is owed, and a fault may just have hit the
    # leader: let the beat send them before dispatching stops.
    wait_until(lambda: not Schedule.objects.filter(next_run_at__lte=ended_at).exists(), timeout=60, interval=0.5)
    # Quiescence: stop dispatching, then reconcile (as an operator would) until
    # every execution a fault left behind is re-sent, retried or failed.
    Schedule.objects.update(enabled=False)
    # Generous: on a loaded machine the workers may still be draining a backlog.
    settle_deadline = time.monotonic() + 300
    while Execution.objects.exclude(status__in=Execution.FINAL_STATUSES).exists() and time.monotonic() < settle_deadline:
        subprocess.run(
            [sys.executable, "manage.py", "reconcile"], cwd=ROOT, env={**process_env, **_as_env(SETTINGS)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, check=False,
        )
        time.sleep(2)
    settled = not Execution.objects.exclude(status__in=Execution.FINAL_STATUSES).exists()
    open_rows = Counter(Execution.objects.exclude(status__in=Execution.FINAL_STATUSES).values_list("status", flat=True))
    executions = list(Execution.objects.all())

    # 1. every slot of the run, to both of its ends, has exactly one execution
    slots_by_schedule: dict[int, list[datetime]] = defaultdict(list)
    for execution in executions:
        slots_by_schedule[execution.schedule_id].append(execution.scheduled_for)
    gaps, doubles = 0, 0
    for schedule in schedules:
        slots = slots_by_schedule[schedule.pk]
        doubles += len(slots) - len(set(slots))
        gaps += len(_owed_slots(schedule, started_at, ended_at) - set(slots))
    # 2. no execution ran twice: each claim (attempt) ran its body at most once,
    #    no body completed after its claim moved on (a frozen body resumed), and
    #    no two bodies of one execution overlapped. A body interrupted after its
    #    side effect (its process killed before the outcome was recorded) is
    #    run again as a new attempt; that is counted, not failed (tasks dedupe
    #    on current_execution()).
    events = test_tasks.events(redis_client)
    starts = Counter((event["execution_id"], event["attempt"]) for event in events if event["event"] == "start")
    ran_twice = {key: n for key, n in starts.items() if n > 1}
    stale = _completed_after_claim_moved_on(events, executions)
    concurrent = _overlapping_runs(events)
    stops = Counter(event["execution_id"] for event in events if event["event"] == "stop")
    rerun_after_interruption = sum(1 for n in stops.values() if n > 1)
    # 3. every execution succeeded (these tasks never raise; nothing is missed,
    #    skipped, failed, timed out or cancelled), with the outcome of a body
    #    that ran to its end under the attempt recorded
    statuses = Counter(e.status for e in executions)
    finished_bodies = {(e["execution_id"], e["attempt"]) for e in events if e["event"] == "stop"}
    without_body = [
        e.pk for e in executions if e.status == Execution.Status.SUCCEEDED and (e.pk, e.attempt) not in finished_bodies
    ]
    names = {schedule.pk: schedule.name for schedule in schedules}
    frozen_ids = {execution_id for execution_id, _ in frozen}
    unsuccessful = [
        {"id": e.pk, "schedule": names.get(e.schedule_id), "status": e.status, "attempt": e.attempt,
         "frozen": e.pk in frozen_ids, "error": e.error[:120], "worker": e.worker, "celery_task_id": e.celery_task_id,
         "started_at": _iso(e.started_at), "claim_expires_at": _iso(e.lease_expires_at)}
        for e in executions if e.status != Execution.Status.SUCCEEDED
    ]
    unsuccessful.sort(key=lambda row: (row["status"] not in Execution.FINAL_STATUSES, row["id"]))  # final ones first
    summary = {
        "seed": SEED, "duration_s": DURATION, "faults": dict(injected), "restarts": restarts, "crashed": dict(crashed),
        "db_sessions_cut": sessions_cut, "frozen_bodies": frozen,
        "executions_checked": len(executions), "statuses": dict(statuses), "duplicates": doubles + len(ran_twice),
        "gaps": gaps, "completed_after_claim_moved_on": stale, "concurrent_runs": len(concurrent),
        "succeeded_without_body": without_body, "rerun_after_interruption": rerun_after_interruption,
        "not_final": dict(open_rows), "window": [started_at.isoformat(), ended_at.isoformat()],
        "unsuccessful": unsuccessful[:40], "timeline": timeline,
    }
    print("\nchaos summary: " + json.dumps(summary))
    Path(os.environ.get("CHAOS_SUMMARY", tempfile.gettempdir() + "/chaos-summary.json")).write_text(json.dumps(summary, indent=2))

    # A fault every 3-6 s, plus what each takes (a frozen body: finding one, then the freeze).
    assert sum(injected.values()) >= DURATION // 10 and set(injected) == set(faults), summary
    assert doubles == 0 and gaps == 0, summary
    assert not ran_twice and not stale and not concurrent, summary
    assert settled and not open_rows, summary
    assert statuses == {Execution.Status.SUCCEEDED: len(executions)}, summary
    assert not without_body, summary


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def _as_env(settings: dict[str, Any]) -> dict[str, str]:
    return {f"SCHEDULER_{key.upper()}": str(value) for key, value in settings.items()}


def _with_application_name(database_url: str, name: str) -> str:
    """Return ``database_url`` naming its PostgreSQL sessions after process ``name`` (dj-database-url passes it on)."""
    if not database_url.startswith("postgres"):
        return database_url
    return f"{database_url}?application_name={quote(APPLICATION_NAME_PREFIX + name)}"


def _cut_database_sessions(worker: CeleryProcess) -> int:
    """Terminate every database session of ``worker`` (main process and pool children); return how many."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            [APPLICATION_NAME_PREFIX + worker.name],
        )
        return sum(1 for (terminated,) in cursor.fetchall() if terminated)


def _freeze_a_long_body(workers: list[CeleryProcess], long_ids: list[int]) -> tuple[int, int] | None:
    """SIGSTOP the pool child running a long body (no timeout) that just started, past its claim, then SIGCONT it.

    Return the (execution id, attempt) frozen, or None if no such body
    started on a live worker within one interval of the long schedules.
    """
    deadline = time.monotonic() + LONG_INTERVAL_SECONDS + 2
    while time.monotonic() < deadline:
        # Started within the last second: most of the body is still to run when the child resumes.
        recent = Execution.objects.filter(
            schedule_id__in=long_ids, timeout=None, status=Execution.Status.RUNNING,
            started_at__gte=leases.db_now() - timedelta(seconds=1),
        )
        for execution in recent:
            pid = _pool_child(execution.worker, workers)
            if pid is None:
                continue
            os.kill(pid, signal.SIGSTOP)
            try:
                claimed = Execution.objects.filter(
                    pk=execution.pk, attempt=execution.attempt, worker=execution.worker, status=Execution.Status.RUNNING
                )
                still_running = claimed.exists()  # else its body ended before the stop: not this one
                if still_running:
                    time.sleep(FREEZE_SECONDS)
            finally:
                os.kill(pid, signal.SIGCONT)
            if still_running:
                return execution.pk, execution.attempt
        time.sleep(0.2)
    return None


def _pool_child(claimed_by: str, workers: list[CeleryProcess]) -> int | None:
    """Return the pid in ``Execution.worker`` (``<name>@<host>:<pid>``) if it is a pool child of a live worker."""
    node, _, pid_text = claimed_by.rpartition(":")
    for worker in workers:
        if node.startswith(f"{worker.name}@") and worker.alive() and _parent_pid(int(pid_text)) == worker.pid:
            return int(pid_text)
    return None


def _parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])  # the field after the state


def _owed_slots(schedule: Schedule, started_at: datetime, ended_at: datetime) -> set[datetime]:
    """Return the slots of ``schedule`` after ``started_at`` up to ``ended_at``."""
    count = int((ended_at - started_at).total_seconds() // schedule.interval) + 2
    return {slot for slot in schedule.next_fire_times(count, after=started_at) if slot <= ended_at}


def _completed_after_claim_moved_on(events: list[dict[str, Any]], executions: list[Execution]) -> list[list[int]]:
    """Return [execution id, attempt] of each body that logged its end after its claim had moved on.

    A claim has moved on once a later attempt of its execution started, or
    once someone else finished the execution on that attempt (reconcile
    recording a lost one ``failed``). The workers' clock and the database's
    are this machine's.
    """
    first_start: dict[int, dict[int, float]] = defaultdict(dict)
    for event in events:
        if event["event"] == "start":
            attempts = first_start[event["execution_id"]]
            attempts[event["attempt"]] = min(event["at"], attempts.get(event["attempt"], event["at"]))
    rows = {execution.pk: execution for execution in executions}
    stale = []
    for event in events:
        if event["event"] != "stop":
            continue
        execution_id, attempt = event["execution_id"], event["attempt"]
        moved_on = [at for later, at in first_start[execution_id].items() if later > attempt]
        row = rows.get(execution_id)
        if row and row.attempt == attempt and row.status != Execution.Status.SUCCEEDED and row.finished_at:
            moved_on.append(row.finished_at.timestamp())
        if moved_on and event["at"] > min(moved_on):
            stale.append([execution_id, attempt])
    return stale


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
