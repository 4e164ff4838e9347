"""Fault exploration: each failpoint with each action, in a small real cluster, checked against the guarantees.

One scenario runs two beat replicas and two workers (prefork, two pool
children each) on the database Django is configured with and a Redis
broker, with short leases and claims (``SETTINGS``), and a handful of
schedules: four every-second ``tests.record`` ones and one every 3 s whose
body works for 2.5 s in steps, all ``misfire=run_all``; a scenario adds a
``fenced()``, ``checkpoint()`` or failing task where its failpoint needs
one. Every process gets ``SCHEDULER_FAILPOINTS="<point>=<action>@<hit>"``
and one shared ``SCHEDULER_FAILPOINTS_DIR`` (``scheduler.failpoints``), so
the point fires once in the whole cluster, on its first hit after the
harness arms it: once the schedules run, and, for some points, once a
precondition holds (a worker running a long body was SIGKILLed, so
reconcile has a lost execution to handle; the broker lost its messages; a
second replica joins and shards change hands). Processes that die are
started again after a second, as a supervisor would, with the same
environment (the shared count keeps the point from firing again).

The fault ends when the point fired (``crash``, ``error``) or
``FAULT_SECONDS`` later (``freeze``, ``delay``). The harness watches
``OBSERVE_SECONDS`` more, waits for every slot up to then to be committed,
turns the schedules off, and waits for every execution to reach a final
status, doing nothing itself (no reconcile by hand: the leader's own
reconcile is part of what is tested). Then it checks:

- ``slots``: every slot of every schedule from its creation to the end of
  the observation has exactly one Execution (no duplicate, no gap);
- ``final``: every execution is final, each within ``FINAL_BOUND_SECONDS``
  of the later of its slot and the end of the fault (``time_to_final`` is
  the largest such delay);
- ``claims``: no body completed after its claim moved on (a later attempt
  started, or someone else finished that attempt), no attempt ran its body
  twice, no two bodies of one execution overlapped (the run log the tasks
  write to Redis against the rows' attempts), and where a ``fenced()`` task
  runs, each succeeded execution committed its side effect exactly once and
  no other did;
- ``results``: Celery's result stored for each final execution's task id
  (django-celery-results) says what the row says: ``SUCCESS`` for a
  succeeded one, not ``SUCCESS`` for a failed or timed-out one (a late
  attempt whose claim moved on stores nothing over it);
- ``stall``: the largest gap between consecutive committed slots of an
  every-second schedule stays within 2 × the lease TTL (``max_gap``);
- ``leadership``: no lease's fencing token changes, unless the fault hit a
  beat replica and stopped its tick: a crash or freeze of the replica, or
  any action at a point of its tick thread (``Point.tick``); a fault in a
  worker, or in the leader's reconcile thread, must leave leadership alone.

The checks themselves are ``tests/support/invariants.py``, shared with the chaos soak.

SQLite has one writer for the whole database. A process frozen or stalled
inside a write transaction (``Point.in_write``) holds it, and every other
writer, the leader's renewal and the claims' included, waits until the
fault ends: there, the stall bound is the fault's length plus 2 × the TTL
(dispatch resumes promptly once it ends), and a lease may change hands.
PostgreSQL has row locks and bounded waits, and gets no such allowance.

A point that never fired is reported ``not reached``, not passed.

``bench/explore.py`` runs the whole matrix (``make explore``);
``tests/chaos/test_explore.py`` runs a fast subset in ``make test``.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from django.db import connection
from django.test.utils import override_settings
from django_celery_results.models import TaskResult

from scheduler import dbclock, failpoints, shards
from scheduler.models import Execution, Instance, Lease, Schedule
from scheduler.owners import leases, schedules
from tests.support import invariants
from tests.support import tasks as test_tasks
from tests.support.processes import CeleryProcess, beat_argv, wait_until, worker_argv

#: The beat's lease without shards (``SCHEDULER_LEASE_NAME`` is left at its default).
LEASE_NAME = "beat"
#: Short leases, claims and reconcile thresholds, so a scenario recovers within seconds.
SETTINGS = {
    "LEASE_TTL_SECONDS": 3,
    "LEASE_RENEW_SECONDS": 1,
    "FOLLOWER_RETRY_SECONDS": 1,
    "CLAIM_SECONDS": 3,
    "CLAIM_RENEW_SECONDS": 1,
    "RECONCILE_INTERVAL_SECONDS": 2,
    "RECONCILE_PENDING_AFTER_SECONDS": 3,
    "RECONCILE_QUEUED_AFTER_SECONDS": 6,
    "BROKER_CHECK_SECONDS": 2,
    "BUILTIN_SCHEDULES": 0,
}
#: How long ``freeze`` and ``delay`` last: past the lease TTL, the claim and a reconcile pass after it,
#: and past the stall bound, so a fault that stalls others for as long as it lasts shows as a stall.
FAULT_SECONDS = 8
ACTIONS = {"crash": "crash", "freeze": f"freeze {FAULT_SECONDS}", "error": "error", "delay": f"delay {FAULT_SECONDS}"}
#: An on-time every-second schedule may wait at most this long between two committed slots.
STALL_BOUND_SECONDS = 2 * SETTINGS["LEASE_TTL_SECONDS"]
#: Every execution is final within this long after the later of its slot and the end of the fault:
#: a claim running out (3 s), a reconcile pass (2 s), a retry's backoff (up to 2 s), a lost
#: message re-sent (6 s), a takeover (3 s), the long body (2.5 s), and slack for a loaded machine.
FINAL_BOUND_SECONDS = 20
#: Steady state before the point is armed.
WARMUP_SECONDS = 2.0
#: How long an armed point has to fire before the scenario is reported "not reached".
FIRE_WAIT_SECONDS = 20.0
#: How long the cluster is watched after the fault ended.
OBSERVE_SECONDS = 5.0
#: How long a supervisor waits before starting a dead process again.
RESTART_AFTER_SECONDS = 1.0
#: Shards in the scenarios of the shard leases' own failpoints.
SHARDS = 4
#: Redis database of the tasks' run log, beside the broker's (a broker flush leaves it alone).
RUNS_DB = 9
LONG_INTERVAL_SECONDS = 3
LONG_BODY_SECONDS = 2.5
INVARIANTS = ("slots", "final", "claims", "results", "stall", "leadership")


@dataclass(frozen=True)
class Point:
    """One failpoint as a scenario drives it."""

    name: str
    #: The process kind whose code holds it: "worker" or "beat".
    process: str
    #: It runs on the beat's tick thread: any action there stops the tick (lease renewals included).
    tick: bool = False
    #: It sits inside a write transaction. SQLite has one writer for the whole database, so a process
    #: frozen or stalled there stops every other writer (leases and claims too) for as long as it lasts.
    in_write: bool = False
    #: What the scenario adds or does before arming: "fenced", "checkpointed" and "failing" add a
    #: schedule running that task; "lost_worker" SIGKILLs a worker running a long body; "broker_flush"
    #: empties the broker; "sharded" runs ``SHARDS`` shards with the second replica joining once armed.
    needs: frozenset[str] = frozenset()

    @property
    def sharded(self) -> bool:
        return "sharded" in self.needs


def _point(name: str, process: str, *needs: str, tick: bool = False, in_write: bool = False) -> Point:
    return Point(name, process, tick, in_write, frozenset(needs))


#: Every failpoint of ``scheduler.failpoints``, in the order of its table.
POINTS = (
    _point("worker.claim.before", "worker"),
    _point("worker.claim.after", "worker"),
    _point("worker.renew", "worker"),
    _point("worker.after_body", "worker"),
    _point("worker.retry.send", "worker", "failing"),
    _point("outcome.in_transaction", "worker", in_write=True),
    _point("running.fenced", "worker", "fenced", in_write=True),
    _point("running.checkpoint", "worker", "checkpointed", in_write=True),
    _point("dispatch.commit.before_fence", "beat", tick=True, in_write=True),
    _point("dispatch.commit.after_fence", "beat", tick=True, in_write=True),
    _point("publish.holding_batch", "beat", tick=True),
    _point("publish.send", "beat", tick=True),
    _point("publish.before_mark_queued", "beat", tick=True),
    _point("publish.after_mark_queued", "beat", tick=True),
    _point("lease.acquire", "beat", "sharded", tick=True, in_write=True),
    _point("lease.release", "beat", "sharded", tick=True, in_write=True),
    _point("reconcile.after_mark_lost", "beat", "lost_worker"),
    _point("reconcile.resend", "beat", "lost_worker"),
    _point("broker.check", "beat", "broker_flush"),
)
POINTS_BY_NAME = {point.name: point for point in POINTS}
assert set(POINTS_BY_NAME) == set(failpoints.POINTS), "every failpoint needs a scenario"

#: The fast subset ``make test`` runs: one scenario per kind of process and step.
FAST = (
    ("worker.claim.after", "delay"),
    ("worker.after_body", "freeze"),
    ("dispatch.commit.after_fence", "crash"),
    ("publish.before_mark_queued", "crash"),
    ("reconcile.after_mark_lost", "crash"),
    ("lease.release", "crash"),
)


@dataclass
class Cluster:
    """The processes of one scenario, started and watched as a supervisor would."""

    env: dict[str, str]
    logs: Path
    beats: list[CeleryProcess] = field(default_factory=list)
    workers: list[CeleryProcess] = field(default_factory=list)
    #: pid -> "beat" | "worker", of every process started (a pool child is found by its parent).
    kinds: dict[int, str] = field(default_factory=dict)
    restarts: list[str] = field(default_factory=list)
    _dead_since: dict[str, float] = field(default_factory=dict)

    def start(self, kind: str, name: str) -> CeleryProcess:
        argv = beat_argv() if kind == "beat" else worker_argv(name, concurrency=2)
        process = CeleryProcess(name, argv, self.env, self.logs / f"{name}.log").start()
        self.kinds[process.pid] = kind
        (self.beats if kind == "beat" else self.workers).append(process)
        return process

    def supervise(self) -> None:
        """Start again, after ``RESTART_AFTER_SECONDS``, each process that is not running."""
        now = time.monotonic()
        for group, kind in ((self.beats, "beat"), (self.workers, "worker")):
            for index, process in enumerate(group):
                if process.alive():
                    self._dead_since.pop(process.name, None)
                    continue
                since = self._dead_since.setdefault(process.name, now)
                if now - since < RESTART_AFTER_SECONDS:
                    continue
                del self._dead_since[process.name]
                process.stop(timeout=1)
                argv = beat_argv() if kind == "beat" else worker_argv(process.name, concurrency=2)
                group[index] = CeleryProcess(process.name, argv, self.env, process.log_path).start()
                self.kinds[group[index].pid] = kind
                self.restarts.append(f"{process.name} (exit {process.popen.returncode if process.popen else None})")

    def kind_of(self, pid: int, ppid: int) -> str:
        """Which process kind ``pid`` (a pool child: its parent ``ppid``) was."""
        return self.kinds.get(pid) or self.kinds.get(ppid) or "unknown"

    def stop(self) -> None:
        """Kill every process group (SIGKILL): what the scenario left is read already, and nothing waits on a body."""
        processes = [*self.beats, *self.workers]
        for process in processes:
            process.kill_group(signal.SIGKILL)
        for process in processes:
            process.stop(timeout=1)


def run(point: Point, action: str, *, env: dict[str, str], workdir: Path) -> dict[str, Any]:
    """Run one scenario of ``point`` with ``action`` (a key of ``ACTIONS``); return its result.

    ``env`` is the environment of the processes: ``DATABASE_URL`` and
    ``REDIS_URL`` of the database and broker this process uses too.
    """
    started = time.monotonic()
    scenario = workdir / f"{point.name}-{action}"
    shared = scenario / "failpoints"
    shared.mkdir(parents=True)
    runs = redis.Redis.from_url(_runs_url(env["REDIS_URL"]))
    broker = redis.Redis.from_url(env["REDIS_URL"])
    _reset(runs, broker)
    process_env = {
        **{key: value for key, value in env.items() if not key.startswith("SCHEDULER_")},
        **{f"SCHEDULER_{key}": str(value) for key, value in SETTINGS.items()},
        "SCHEDULER_FAILPOINTS": f"{point.name}={ACTIONS[action]}@1",
        "SCHEDULER_FAILPOINTS_DIR": str(shared),
        "SCHEDULER_SHARDS": str(SHARDS if point.sharded else 1),
        "TEST_RUNS_REDIS_URL": _runs_url(env["REDIS_URL"]),
        "PYTHONUNBUFFERED": "1",
    }
    cluster = Cluster(process_env, scenario)
    fenced = "fenced" in point.needs
    if fenced:
        _side_effect_table(create=True)
    lease_log: list[tuple[float, str, str, int]] = []
    try:
        for name in ("w1", "w2"):
            cluster.start("worker", name)
        cluster.start("beat", "beat1")
        if not point.sharded:  # with shards the second replica joins once the point is armed
            cluster.start("beat", "beat2")
        for worker in cluster.workers:
            worker.wait_for_log(r"ready\.", timeout=60)
        lease_names = shards.lease_names(SHARDS) if point.sharded else [LEASE_NAME]
        if not wait_until(lambda: _all_held(lease_names), timeout=30):
            raise AssertionError(f"no replica held {lease_names}; log tail:\n{cluster.beats[0].log()[-3000:]}")
        with override_settings(SCHEDULER_SHARDS=SHARDS if point.sharded else 1):
            created_at = dbclock.now()
            schedules = _create_schedules(point, now=created_at)
        _watch(cluster, lease_log, lease_names, seconds=WARMUP_SECONDS)
        precondition = _precondition(point, cluster, broker, schedules, lease_log, lease_names)
        (shared / "armed").touch()
        armed_at = time.time()
        if point.sharded:
            cluster.start("beat", "beat2")
        fired = _watch(cluster, lease_log, lease_names, seconds=FIRE_WAIT_SECONDS, until=lambda: _fired(shared))
        fault_end = None
        if fired:
            fault_end = fired["at"] + (FAULT_SECONDS if action in ("freeze", "delay") else 0)
            _watch(cluster, lease_log, lease_names, seconds=max(0.0, fault_end + OBSERVE_SECONDS - time.time()))
        ended_at = dbclock.now()
        # Every slot up to the end is owed: let the beat commit them before turning the schedules off.
        committed = wait_until(
            lambda: (
                _watched(cluster, lease_log, lease_names)
                and not Schedule.objects.filter(next_run_at__lte=ended_at).exists()
            ),
            timeout=30,
            interval=0.2,
        )
        Schedule.objects.update(enabled=False)
        final_wait_started = time.time()
        settled = wait_until(
            lambda: (
                _watched(cluster, lease_log, lease_names)
                and not Execution.objects.exclude(status__in=Execution.FINAL_STATUSES).exists()
            ),
            timeout=FINAL_BOUND_SECONDS + 10,
            interval=0.2,
        )
        settle_seconds = time.time() - final_wait_started
        executions = list(Execution.objects.order_by("id"))
        results = dict(TaskResult.objects.values_list("task_id", "status"))
        events = test_tasks.events(runs)
        side_effects = test_tasks.side_effects() if fenced else []
    finally:
        cluster.stop()
        if fenced:
            _side_effect_table(create=False)
        runs.close()
        broker.close()
    result: dict[str, Any] = {
        "point": point.name,
        "action": action,
        "database": connection.vendor,
        "spec": process_env["SCHEDULER_FAILPOINTS"],
        "precondition": precondition,
        "fired": bool(fired),
        "fired_in": cluster.kind_of(fired["pid"], fired["ppid"]) if fired else None,
        "fired_after_arming_seconds": round(fired["at"] - armed_at, 2) if fired else None,
        "restarts": cluster.restarts,
        "executions": len(executions),
        "statuses": dict(Counter(execution.status for execution in executions)),
        "all_committed": bool(committed),
        "settled": bool(settled),
        "settle_seconds": round(settle_seconds, 1),
        "scenario_seconds": None,
        "logs": str(scenario),
    }
    if fired:
        assert fault_end is not None
        result.update(
            _check(
                point,
                action,
                fired_in=result["fired_in"],
                fault_end=fault_end,
                schedules=schedules,
                created_at=created_at,
                ended_at=ended_at,
                executions=executions,
                results=results,
                events=events,
                side_effects=side_effects if fenced else None,
                lease_log=lease_log,
            )
        )
    else:
        result.update({invariant: None for invariant in INVARIANTS}, passed=False, failures=["not reached"])
    result["scenario_seconds"] = round(time.monotonic() - started, 1)
    return result


# --- setting up -----------------------------------------------------------------------------------


def _runs_url(redis_url: str) -> str:
    return f"{redis_url.rsplit('/', 1)[0]}/{RUNS_DB}"


def _reset(runs: redis.Redis, broker: redis.Redis) -> None:
    """Start from an empty cluster: no executions, schedules, leases, instances, messages or run log."""
    Execution.objects.all().delete()
    Schedule.objects.all().delete()
    Lease.objects.all().delete()
    Instance.objects.all().delete()
    layout = getattr(shards, "LAYOUT_TABLE", None)  # the stored shard count, where there is one
    if layout and layout in connection.introspection.table_names():
        with connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {layout}")
    runs.flushdb()
    broker.flushdb()


def _side_effect_table(*, create: bool) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {test_tasks.SIDE_EFFECT_TABLE}")
        if create:
            cursor.execute(
                f"CREATE TABLE {test_tasks.SIDE_EFFECT_TABLE} (execution_id bigint, attempt integer, pid integer)"
            )


def _create_schedules(point: Point, *, now: datetime) -> list[Schedule]:
    every_second = [
        Schedule(name=f"tick-{n}", task="tests.record", interval=1, kwargs={"label": f"tick-{n}"}) for n in range(4)
    ]
    long = Schedule(
        name="long",
        task="tests.record",
        interval=LONG_INTERVAL_SECONDS,
        kwargs={"label": "long", "seconds": LONG_BODY_SECONDS, "step": 0.1},
    )
    created = [*every_second, long]
    if "fenced" in point.needs:
        created.append(Schedule(name="fenced", task="tests.fenced_invoice", interval=1))
    if "checkpointed" in point.needs:
        created.append(Schedule(name="checkpointed", task="tests.checkpointed", interval=1, args=[3]))
    if "failing" in point.needs:
        created.append(Schedule(name="failing", task="tests.fail", interval=2, max_retries=1, retry_backoff=1))
    for schedule in created:
        schedule.full_clean()
        schedules.save(schedule, now=now)
    return created


def _all_held(names: Iterable[str]) -> bool:
    return all(leases.current(name).is_held for name in names)


def _precondition(
    point: Point,
    cluster: Cluster,
    broker: redis.Redis,
    schedules: list[Schedule],
    lease_log: list[tuple[float, str, str, int]],
    lease_names: list[str],
) -> str:
    """Bring the cluster to the state the point needs before it is armed; return what was done."""
    if "lost_worker" in point.needs:
        # A worker SIGKILLed while running a long body: its claim runs out, reconcile marks it lost.
        long = next(schedule for schedule in schedules if schedule.name == "long")
        found: dict[str, Any] = {}

        def running_long() -> bool:
            _watched(cluster, lease_log, lease_names)
            row = Execution.objects.filter(schedule=long, status=Execution.Status.RUNNING).first()
            worker = row and next(
                (w for w in cluster.workers if row.worker.startswith(f"{w.name}@") and w.alive()), None
            )
            if worker:
                found.update(execution=row.pk, worker=worker)
            return bool(worker)

        if not wait_until(running_long, timeout=LONG_INTERVAL_SECONDS * 3, interval=0.1):
            return "no long body found running"
        found["worker"].kill_group(signal.SIGKILL)
        return f"SIGKILLed {found['worker'].name} running execution {found['execution']}"
    if "broker_flush" in point.needs:
        broker.flushdb()  # as a broker restarted without its data: every message and the leader's marker gone
        return "broker flushed"
    return ""


# --- watching -------------------------------------------------------------------------------------


def _watch(
    cluster: Cluster,
    lease_log: list[tuple[float, str, str, int]],
    lease_names: list[str],
    *,
    seconds: float,
    until: Callable[[], Any] | None = None,
) -> Any:
    """Supervise and log the leases for ``seconds``, or until ``until()`` returns something; return that."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _watched(cluster, lease_log, lease_names)
        if until is not None and (found := until()):
            return found
        time.sleep(0.1)
    return until() if until is not None else None


def _watched(cluster: Cluster, lease_log: list[tuple[float, str, str, int]], lease_names: list[str]) -> bool:
    """One round of watching: restart dead processes, log each change of a lease's holder or token."""
    cluster.supervise()
    last = {name: (holder, token) for _, name, holder, token in lease_log}
    for name, holder, token in Lease.objects.filter(name__in=lease_names).values_list("name", "holder", "token"):
        if last.get(name) != (holder, token):
            lease_log.append((time.time(), name, holder, int(token)))
    return True


def _fired(shared: Path) -> dict[str, Any] | None:
    path = shared / "fired.jsonl"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    return json.loads(lines[0]) if lines else None


# --- the invariants ---------------------------------------------------------------------------------


def _check(
    point: Point,
    action: str,
    *,
    fired_in: str,
    fault_end: float,
    schedules: list[Schedule],
    created_at: datetime,
    ended_at: datetime,
    executions: list[Execution],
    results: dict[str, str],
    events: list[dict[str, Any]],
    side_effects: list[tuple[int, int, int]] | None,
    lease_log: list[tuple[float, str, str, int]],
) -> dict[str, Any]:
    """Check the invariants on what the scenario left; return them, the figures and the failures."""
    failures: list[str] = []

    # slots: exactly one execution per slot, none missing from creation to the end.
    duplicates, gaps = invariants.slot_violations(schedules, executions, created_at=created_at, ended_at=ended_at)
    if duplicates or gaps:
        failures.append(f"slots: {duplicates} duplicate(s), {gaps} gap(s)")

    # final: every execution final, each within the bound after its slot or the end of the fault.
    open_rows = invariants.open_executions(executions)
    delays = [
        e.finished_at.timestamp() - max(e.scheduled_for.timestamp(), fault_end)
        for e in executions
        if e.status in Execution.FINAL_STATUSES and e.finished_at is not None
    ]
    time_to_final = max([0.0, *delays])
    if open_rows:
        failures.append(
            "final: not final: "
            + ", ".join(f"{e.pk} {e.status} attempt {e.attempt}" for e in open_rows[:5])
            + (f" (+{len(open_rows) - 5})" if len(open_rows) > 5 else "")
        )
    if time_to_final > FINAL_BOUND_SECONDS:
        failures.append(f"final: {time_to_final:.1f}s after the fault (bound {FINAL_BOUND_SECONDS}s)")

    # claims: no body completed after its claim moved on, none ran twice or alongside another.
    stale, twice, overlapping = invariants.claim_violations(events, executions)
    fenced_wrong = invariants.fenced_violations(side_effects, executions) if side_effects is not None else []
    if stale or twice or overlapping or fenced_wrong:
        failures.append(
            f"claims: completed after the claim moved on {stale}, ran twice {twice}, overlapped {overlapping}"
            + (f", fenced side effects wrong {fenced_wrong}" if fenced_wrong else "")
        )

    # results: Celery's stored result of each execution's task id agrees with its row.
    results_wrong = invariants.result_violations(executions, results)
    if results_wrong:
        by_id = {execution.pk: execution for execution in executions}
        failures.append(
            "results: Celery's stored result contradicts the row of "
            + ", ".join(
                f"{pk} ({by_id[pk].status}, stored {results[by_id[pk].celery_task_id]})" for pk in results_wrong
            )
        )

    # SQLite: a fault inside a write transaction holds the database's one writer, and with no row
    # locks to pass by everyone waits it out. Then the stall may last as long as the fault and no
    # longer, and a leader that could not renew through it may lose its lease.
    holds_writer = connection.vendor == "sqlite" and point.in_write and action in ("freeze", "delay")
    stall_bound = STALL_BOUND_SECONDS + (FAULT_SECONDS if holds_writer else 0)

    # stall: the largest gap between consecutive committed slots of an every-second schedule.
    max_gap, _ = invariants.max_stall(schedules, executions, created_at=created_at, ended_at=ended_at)
    if max_gap > stall_bound:
        failures.append(f"stall: {max_gap:.1f}s between two committed slots (bound {stall_bound}s)")

    # leadership: tokens change only when the fault stopped a beat replica's tick.
    token_changes = invariants.token_changes(lease_log)
    stops_a_beat = fired_in == "beat" and (action in ("crash", "freeze") or point.tick) or holds_writer
    if token_changes and not stops_a_beat:
        failures.append(f"leadership: {token_changes} token change(s) though the fault stopped no beat replica")

    passed = {
        "slots": not (duplicates or gaps),
        "final": not open_rows and time_to_final <= FINAL_BOUND_SECONDS,
        "claims": not (stale or twice or overlapping or fenced_wrong),
        "results": not results_wrong,
        "stall": max_gap <= stall_bound,
        "leadership": not token_changes or stops_a_beat,
    }
    return {
        **passed,
        "passed": all(passed.values()),
        "failures": failures,
        "time_to_final": round(time_to_final, 1),
        "max_gap": round(max_gap, 1),
        "stall_bound": stall_bound,
        "duplicates": duplicates,
        "gaps": gaps,
        "token_changes": token_changes,
    }


# --- the matrix -----------------------------------------------------------------------------------


def scenarios(points: Iterable[str] | None = None, actions: Iterable[str] | None = None) -> list[tuple[Point, str]]:
    """Every (point, action) of the matrix, optionally only those points and actions."""
    wanted_points = set(points) if points else set(POINTS_BY_NAME)
    unknown = wanted_points - set(POINTS_BY_NAME)
    if unknown:
        raise ValueError(f"unknown failpoint(s): {', '.join(sorted(unknown))}")
    wanted_actions = list(actions) if actions else list(ACTIONS)
    if set(wanted_actions) - set(ACTIONS):
        raise ValueError(f"unknown action(s): {', '.join(sorted(set(wanted_actions) - set(ACTIONS)))}")
    return [(point, action) for point in POINTS if point.name in wanted_points for action in wanted_actions]


def row(result: dict[str, Any]) -> list[Any]:
    """One line of the printed matrix."""

    def mark(name: str) -> str:
        value = result.get(name)
        return "-" if value is None else ("ok" if value else "FAIL")

    return [
        result["point"],
        result["action"],
        result["fired_in"] or "not reached",
        *(mark(name) for name in INVARIANTS),
        "-" if result.get("time_to_final") is None else result["time_to_final"],
        "-" if result.get("max_gap") is None else result["max_gap"],
        result.get("token_changes", "-"),
        result["scenario_seconds"],
    ]


HEADERS = ["failpoint", "action", "fired in", *INVARIANTS, "to final s", "max gap s", "tokens", "took s"]
