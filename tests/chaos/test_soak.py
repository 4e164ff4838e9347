"""Chaos soak: beats, workers, the broker and operators fail at random; nothing is lost, failed, run twice or stalled.

Three beat replicas and two workers run 30 every-second schedules, 5 long
tasks (3 of them with timeouts), two every-2-second schedules whose bodies
fail once per execution (``tests.fail_once``, ``max_retries=1``: exactly the
one planned failure), an every-second ``fenced()`` task and an every-3-second
``cancel_previous`` task (on a queue of its own) that checkpoints twice
inside its own ``transaction.atomic()``, all otherwise with the default settings, on the
test database and a broker of the test's own. Every few seconds a seeded
random fault hits (the nemeses, each once per round, in a random order):

- ``leader_sigkill`` / ``leader_freeze`` / ``leader_sigterm``: a replica
  holding a lease (any shard's) is SIGKILLed, frozen past its lease
  (SIGSTOP, then SIGCONT) or stopped (SIGTERM);
- ``worker_sigkill``: a worker is SIGKILLed mid-task;
- ``worker_freeze``: a pool child running a long body without a timeout is
  frozen past its claim, then resumed;
- ``worker_db_cut``: a worker's database sessions are terminated
  (PostgreSQL's ``pg_terminate_backend``);
- ``broker_restart``: the broker restarts, losing its queues;
- ``broker_down_retrying``: the broker goes away for ``BROKER_DOWN_SECONDS``
  just as a failing body starts, so it raises (and asks for its retry)
  while nothing can be sent;
- ``freeze_in_transaction`` / ``freeze_in_fenced``: a pool child is frozen
  (failpoint ``running.checkpoint`` / ``running.fenced``, ``freeze``) inside
  the body's own ``atomic()`` with its execution row locked, or inside a
  ``fenced()`` block with its writes done, past its claim;
- ``publisher_freeze``: a beat replica is frozen (failpoint
  ``publish.holding_batch``) while it holds a batch of pending rows locked;
- ``reshard``: ``manage.py shards --set N`` changes the stored shard count
  (1 -> 4 -> 2 -> 3 -> 1 ...) while the beats run;
- ``rolling_restart``: every beat replica, then every worker, is replaced
  one by one (the new one started and ready, then the old one SIGTERMed),
  the new ones with another ``SCHEDULER_SHARDS`` (which only seeds the
  stored count: they must follow the stored one);
- ``prune_reconcile``: ``prune_executions --older-than 10s`` and
  ``reconcile --repair`` run at once (a trigger keeps a copy of every
  deleted row, so the pruned slots are checked too).

Killed processes are started again. At the end the test waits for
quiescence, runs ``reconcile`` and checks the guarantees on the rows (and
the pruned rows) and on the side-effect log the tasks write to a Redis of
their own (which never restarts), with ``tests/support/invariants.py``: every slot
from the schedules' creation to the end of the faults (database clock) has
exactly one execution; every execution is final and succeeded (the
``cancel_previous`` one: or ``cancelled`` by a newer slot, or ``skipped``
in the commit of a newer one); no claim ran its body twice, no body
completed after its claim moved on, no two bodies of one execution
overlapped; each fenced side effect committed exactly once; Celery's stored
result of each task id says what its execution's row says; no every-second
schedule went more than 2 × the lease TTL without a committed slot.

``CHAOS_DURATION`` (seconds, default 60; the run lasts at least one round
of every nemesis) and ``CHAOS_SEED`` pick the run; ``make chaos
DURATION=300`` runs the long one. The summary line is printed (and written
to ``CHAOS_SUMMARY``); ``CHAOS_LOGS`` names a directory to keep the
processes' logs in.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from django.db import connection
from django_celery_results.models import TaskResult

from scheduler import dbclock, failpoints, shards
from scheduler.beat import dispatch
from scheduler.models import Execution, Schedule
from scheduler.owners import leases, schedules
from tests.support import invariants
from tests.support import tasks as test_tasks
from tests.support.processes import ROOT, CeleryProcess, pid_of, wait_until
from tests.support.services import find_redis_server, free_port

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
#: An every-second schedule may wait at most this long between two committed slots (SPEC guarantee 11).
STALL_BOUND_SECONDS = 2 * SETTINGS["lease_ttl_seconds"]
#: A frozen pool child stays stopped past its claim, and long enough for a
#: reconcile pass to find the claim expired and let a successor take it.
FREEZE_SECONDS = SETTINGS["claim_seconds"] + SETTINGS["reconcile_interval_seconds"] + 1
#: SQLite has one writer: a process frozen inside a write transaction (``freeze_in_fenced``,
#: ``freeze_in_transaction``) holds it, and every other writer waits until the fault ends. There
#: dispatch may stall as long as the fault plus the bound (docs/testing.md); PostgreSQL waits on nobody.
SQLITE_STALL_BOUND_SECONDS = FREEZE_SECONDS + STALL_BOUND_SECONDS
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
#: ``tests.fail_once`` bodies work this long before they raise, so one started
#: just before the broker goes away raises while it is away.
FAILING_BODY_SECONDS = 1.0
FAILING_INTERVAL_SECONDS = 2
#: The ``cancel_previous`` schedule whose bodies checkpoint inside their own transaction: every few seconds,
#: on a queue of its own, so on a loaded machine its body starts before the next slot cancels it.
IN_TRANSACTION_INTERVAL_SECONDS = 3
IN_TRANSACTION_QUEUE = "chaos-in-transaction"
#: How long ``broker_down_retrying`` keeps the broker away.
BROKER_DOWN_SECONDS = 5
#: The shard counts ``reshard`` stores in turn: grow from 1, shrink between counts above 1, back to 1.
SHARD_COUNTS = (4, 2, 3, 1)
#: ``SCHEDULER_SHARDS`` of the replicas a rolling restart starts (it only seeds the stored count).
ROLLING_SHARDS_SETTINGS = (1, 2, 4, 8)
#: ``prune_reconcile`` prunes the executions finished longer ago than this.
PRUNE_OLDER_THAN = "10s"
#: The failpoint each failpoint nemesis fires, and the kind of process it fires in.
FAILPOINT_FAULTS = {
    "freeze_in_transaction": ("running.checkpoint", "worker"),
    "freeze_in_fenced": ("running.fenced", "worker"),
    "publisher_freeze": ("publish.holding_batch", "beat"),
}
FAULTS = (
    "leader_sigkill",
    "leader_freeze",
    "leader_sigterm",
    "worker_sigkill",
    "worker_freeze",
    "worker_db_cut",
    "broker_restart",
    "broker_down_retrying",
    *FAILPOINT_FAULTS,
    "reshard",
    "rolling_restart",
    "prune_reconcile",
)
#: Each process's database sessions carry this prefix and its name, so the test can cut them.
APPLICATION_NAME_PREFIX = "chaos-"
#: The unsharded beat's lease (``SCHEDULER_LEASE_NAME`` is left at its default).
LEASE_NAME = "beat"
#: Tasks that log their bodies' start and end in the run log.
LOGGING_TASKS = ("tests.record", "tests.fail_once", "tests.checkpoint_in_transaction")
#: The table the trigger copies every deleted execution into (no model).
PRUNED_TABLE = "chaos_pruned_execution"


class Broker:
    """A redis-server on a fixed port that can be restarted (without persistence: queues are lost)."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.dir = directory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                find_redis_server(),
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--logfile",
                str(self.dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
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
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    # pytest's temporary folders: kept for the last runs' inspection, then removed
    server = Broker(tmp_path_factory.mktemp("chaos-redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def pruned_table(transactional_db: None) -> Iterator[None]:
    """Copy every execution deleted during the test into ``PRUNED_TABLE`` (a trigger); drop both afterwards.

    Request it before ``celery_processes``, so it is dropped after they stopped.
    """
    columns = [field.column for field in Execution._meta.concrete_fields]
    listed, old = ", ".join(columns), ", ".join(f"OLD.{column}" for column in columns)
    table = Execution._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {PRUNED_TABLE}")
        cursor.execute(f"CREATE TABLE {PRUNED_TABLE} AS SELECT {listed} FROM {table} WHERE 1 = 0")
        if connection.vendor == "postgresql":
            cursor.execute(
                f"CREATE OR REPLACE FUNCTION {PRUNED_TABLE}_keep() RETURNS trigger LANGUAGE plpgsql AS $$ "
                f"BEGIN INSERT INTO {PRUNED_TABLE} ({listed}) VALUES ({old}); RETURN OLD; END $$"
            )
            cursor.execute(
                f"CREATE TRIGGER {PRUNED_TABLE}_keep AFTER DELETE ON {table} "
                f"FOR EACH ROW EXECUTE FUNCTION {PRUNED_TABLE}_keep()"
            )
        else:
            cursor.execute(
                f"CREATE TRIGGER {PRUNED_TABLE}_keep AFTER DELETE ON {table} "
                f"BEGIN INSERT INTO {PRUNED_TABLE} ({listed}) VALUES ({old}); END"
            )
    yield
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"DROP TRIGGER IF EXISTS {PRUNED_TABLE}_keep ON {table}")
            cursor.execute(f"DROP FUNCTION IF EXISTS {PRUNED_TABLE}_keep()")
        else:
            cursor.execute(f"DROP TRIGGER IF EXISTS {PRUNED_TABLE}_keep")
        cursor.execute(f"DROP TABLE IF EXISTS {PRUNED_TABLE}")


def _pruned() -> list[Execution]:
    """The executions deleted during the test, as they were when deleted.

    Not a slot given back before its instant (``COMMIT_AHEAD_SECONDS``): a
    row deleted ``pending`` and never sent was not an execution, and its
    slot must have one all the same (a gap otherwise).
    """
    unsent = f"status = '{Execution.Status.PENDING}' AND enqueued_at IS NULL"
    return list(Execution.objects.raw(f"SELECT * FROM {PRUNED_TABLE} WHERE NOT ({unsent})"))


def _lease_holders(beats: list[CeleryProcess]) -> list[CeleryProcess]:
    """The live beat replicas holding a lease now: the one ``beat``, or any shard's."""
    count = shards.count()
    pids = set()
    for name in shards.lease_names(count) if count > 1 else [LEASE_NAME]:
        state = leases.current(name)
        if state.is_held:
            pids.add(pid_of(state.holder))
    return [beat for beat in beats if beat.pid in pids and beat.alive()]


class Failpoints:
    """Fire one failpoint of ``FAILPOINT_FAULTS`` at a time, once, through the directory every process shares."""

    def __init__(self, directory: Path, seconds: float) -> None:
        self.dir = directory
        self.dir.mkdir()
        self.seconds = seconds

    def env(self, kind: str) -> dict[str, str]:
        """The settings (``celery_processes`` keywords) of a process of ``kind``: each of its points freezes on hit 1."""
        points = [name for name, process in FAILPOINT_FAULTS.values() if process == kind]
        return {
            "failpoints": ";".join(f"{name}=freeze {self.seconds:g}@1" for name in points),
            "failpoints_dir": str(self.dir),
        }

    def fire(self, name: str, *, timeout: float = 15.0) -> dict[str, Any] | None:
        """Arm ``name`` alone, wait until it fired (return its record) or ``timeout`` passes (``None``); disarm."""
        assert name in failpoints.POINTS
        for other, _ in FAILPOINT_FAULTS.values():
            # The next hit of ``name`` is hit 1, of the others one they never fire on.
            (self.dir / f"{other}.hits").write_text("0" if other == name else "1000000000")
        before = len(self._fired())
        (self.dir / "armed").touch()
        try:
            found = wait_until(
                lambda: [f for f in self._fired()[before:] if f["name"] == name], timeout=timeout, interval=0.1
            )
        finally:
            (self.dir / "armed").unlink()
        return found[0] if found else None

    def _fired(self) -> list[dict[str, Any]]:
        path = self.dir / "fired.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(DURATION + 1200)
def test_chaos_soak__every_slot_once_nothing_run_twice_nothing_lost(
    side_effect_table: None,
    pruned_table: None,
    celery_processes: Callable[..., CeleryProcess],
    process_env: dict[str, str],
    redis_url: str,
    redis_client: redis.Redis,
    broker: Broker,
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    # A database connection can be cut on PostgreSQL only (SQLite has none).
    faults = FAULTS if connection.vendor == "postgresql" else tuple(f for f in FAULTS if f != "worker_db_cut")
    # Tasks log to the suite's Redis, which never restarts; the broker is the chaos one.
    process_env.update(REDIS_URL=broker.url, CELERY_BROKER_URL=broker.url, TEST_RUNS_REDIS_URL=redis_url)
    database_url = process_env["DATABASE_URL"]
    command_env = {**process_env, **_as_env(SETTINGS)}
    points = Failpoints(tmp_path / "failpoints", FREEZE_SECONDS)

    def start(kind: str, name: str, **settings: object) -> CeleryProcess:
        # celery_processes copies process_env at each start: this process's sessions carry its name.
        process_env["DATABASE_URL"] = _with_application_name(database_url, name)
        queues = f"celery,{IN_TRANSACTION_QUEUE}" if kind == "worker" else None
        try:
            return celery_processes(
                kind, name, concurrency=4, queues=queues, **SETTINGS, **points.env(kind), **settings
            )
        finally:
            process_env["DATABASE_URL"] = database_url

    workers = [start("worker", f"w{n}") for n in (1, 2)]
    for worker in workers:
        worker.wait_for_log(r"ready\.")
    beats = [start("beat", f"beat{n}") for n in (1, 2, 3)]
    assert wait_until(lambda: leases.current(LEASE_NAME).is_held, timeout=60), "no beat replica took the lease"
    # The run starts when the schedules are created (database clock), a leader
    # in place: from then on every slot is owed (misfire run_all, in the
    # catch-up window), and every every-second schedule is committed on time.
    started_at = dbclock.now()
    every_second = [
        Schedule(name=f"tick-{n:02d}", task="tests.record", interval=1, kwargs={"label": f"tick-{n:02d}"})
        for n in range(30)
    ]
    long = [
        Schedule(
            name=f"long-{n}",
            task="tests.record",
            interval=LONG_INTERVAL_SECONDS,
            timeout=LONG_TIMEOUT_SECONDS if n < LONG_WITH_TIMEOUT else None,
            kwargs={"label": f"long-{n}", "seconds": LONG_BODY_SECONDS, "step": LONG_STEP_SECONDS},
        )
        for n in range(5)
    ]
    failing = [
        Schedule(
            name=f"fail-once-{n}",
            task="tests.fail_once",
            interval=FAILING_INTERVAL_SECONDS,
            max_retries=1,
            retry_backoff=1,
            kwargs={"label": f"fail-once-{n}", "seconds": FAILING_BODY_SECONDS},
        )
        for n in range(2)
    ]
    fenced = Schedule(name="fenced", task="tests.fenced_invoice", interval=1)
    in_transaction = Schedule(
        name="checkpoint-in-transaction",
        task="tests.checkpoint_in_transaction",
        interval=IN_TRANSACTION_INTERVAL_SECONDS,
        queue=IN_TRANSACTION_QUEUE,
        overlap=Schedule.Overlap.CANCEL_PREVIOUS,
        kwargs={"label": "checkpoint-in-transaction"},
    )
    created = [*every_second, *long, *failing, fenced, in_transaction]
    for schedule in created:
        schedule.full_clean()
        schedules.save(schedule, now=started_at)

    injected: Counter[str] = Counter()
    crashed: Counter[str] = Counter()  # processes that exited by themselves (restarted too)
    restarts = 0
    frozen: list[tuple[int, int]] = []  # (execution id, attempt) of each body frozen past its claim
    sessions_cut = 0
    outages: list[tuple[float, float]] = []  # (down, up) of each broker_down_retrying, time.time()
    fired: list[str] = []  # "<failpoint> in <pid>" of each failpoint nemesis
    reshards: list[dict[str, Any]] = []
    commands: list[str] = []  # what each prune_reconcile's two commands said
    rolled = 0
    shard_counts = iter(SHARD_COUNTS * 100)
    timeline: list[str] = []  # "<database time once done> <fault> <target>", to read rows and logs against

    def roll(group: list[CeleryProcess], kind: str, shards_setting: int) -> None:
        """Replace each process of ``group`` in turn: start the new one, wait until it is ready, SIGTERM the old one."""
        nonlocal rolled
        for index, old in enumerate(group):
            rolled += 1
            new = start(kind, f"{kind}-roll-{rolled}", shards=shards_setting)
            if kind == "worker":
                new.wait_for_log(r"ready\.", timeout=60)
            else:
                new.wait_for_log(r"beat: Starting", timeout=60)
                time.sleep(1)  # its first tick: registered, following the stored count
            group[index] = new
            old.send(signal.SIGTERM)
            if not wait_until(lambda o=old: not o.alive(), timeout=30):
                old.kill_group(signal.SIGKILL)
                crashed[f"{kind} (stuck in shutdown)"] += 1

    def supervise(victim: CeleryProcess | None = None) -> None:
        """Act as the supervisor (systemd, Kubernetes, compose's restart policy), to the end of the test.

        Start again whatever is not running, whether a fault (``victim``) or
        a crash stopped it: kombu's Redis transport crashes a worker whose
        broker vanished (docs/testing.md), after the run's last fault too.
        """
        nonlocal restarts
        for group, kind in ((beats, "beat"), (workers, "worker")):
            for index, process in enumerate(group):
                if process.alive():
                    continue
                if process is not victim:
                    crashed[kind] += 1
                process.stop(timeout=1)
                restarts += 1
                group[index] = start(kind, f"{kind}-restart-{restarts}")

    pending_faults: list[str] = []
    deadline = time.monotonic() + DURATION
    fault_floor = DURATION // 10
    # At least DURATION, until every nemesis hit once, and until one fault per
    # 10 s of DURATION hit: a slower database makes the faults take longer
    # (a rolling restart waits for each process to be ready), so it runs
    # longer rather than with fewer faults.
    while time.monotonic() < deadline or set(injected) != set(faults) or sum(injected.values()) < fault_floor:
        if time.monotonic() > deadline + 600:
            break  # a nemesis that cannot find its target: the assertion below names it
        time.sleep(rng.uniform(3, 6))
        if not pending_faults:  # every kind once per round, in a random order
            pending_faults = rng.sample(faults, len(faults))
        fault = pending_faults.pop()
        victim: CeleryProcess | None = None
        target = ""
        if fault.startswith("leader"):
            holders = _lease_holders(beats)
            if not holders:
                pending_faults.append(fault)
                continue  # a takeover is under way; try again in a moment
            leader = rng.choice(holders)
            target = leader.name
            if fault == "leader_sigkill":
                victim = leader
                leader.kill_group(signal.SIGKILL)
            elif fault == "leader_sigterm":
                victim = leader
                leader.send(signal.SIGTERM)
            else:
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
        elif fault == "broker_restart":
            broker.stop()
            time.sleep(1)
            broker.start()
        elif fault == "broker_down_retrying":
            # Just as a failing body starts: it raises, and asks for its retry, with the broker away.
            started = _a_failing_body_starts([schedule.pk for schedule in failing])
            down = time.time()
            broker.stop()
            time.sleep(BROKER_DOWN_SECONDS)
            broker.start()
            outages.append((down, time.time()))
            target = f"execution {started}" if started else "no failing body seen starting"
        elif fault in FAILPOINT_FAULTS:
            name, _ = FAILPOINT_FAULTS[fault]
            hit = points.fire(name)
            if hit is None:
                continue  # not reached (no such body or batch in time); the next round tries again
            fired.append(f"{name} in {hit['pid']}")
            target = f"pid {hit['pid']}"
            time.sleep(max(0.0, hit["at"] + FREEZE_SECONDS + 0.5 - time.time()))  # until it resumed
        elif fault == "reshard":
            count = next(shard_counts)
            done = subprocess.run(
                [sys.executable, "manage.py", "shards", "--set", str(count), "--json"],
                cwd=ROOT,
                env=command_env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert done.returncode == 0, f"shards --set {count}: {done.stderr[-2000:]}"
            reshards.append(json.loads(done.stdout))
            target = f"{reshards[-1]['previous']} -> {count} (settled {reshards[-1]['settled']})"
        elif fault == "rolling_restart":
            setting = rng.choice(ROLLING_SHARDS_SETTINGS)
            roll(beats, "beat", setting)
            roll(workers, "worker", setting)
            target = f"SCHEDULER_SHARDS={setting}"
        else:  # prune_reconcile
            both = [
                subprocess.Popen(
                    [sys.executable, "manage.py", *argv],
                    cwd=ROOT,
                    env=command_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for argv in (["prune_executions", "--older-than", PRUNE_OLDER_THAN], ["reconcile", "--repair"])
            ]
            outputs = [process.communicate(timeout=120)[0] for process in both]
            assert all(process.returncode == 0 for process in both), outputs
            commands.append(" | ".join(output.strip().replace("\n", "; ")[-200:] for output in outputs))
        injected[fault] += 1
        timeline.append(f"{dbclock.now():%H:%M:%S} {fault} {victim.name if victim else target}")
        if victim is not None:
            assert wait_until(lambda v=victim: not v.alive(), timeout=20), f"{victim.name} did not stop"
        time.sleep(0.5)
        supervise(victim)
    ended_at = dbclock.now()

    # Every slot up to the end is owed, and a fault may just have hit the
    # leader: let the beat send them before dispatching stops.
    wait_until(lambda: not Schedule.objects.filter(next_run_at__lte=ended_at).exists(), timeout=60, interval=0.5)
    # Quiescence: stop dispatching, then reconcile (as an operator would) until
    # every execution a fault left behind is re-sent, retried or failed.
    Schedule.objects.update(enabled=False)
    # Generous: on a loaded machine the workers may still be draining a backlog.
    settle_deadline = time.monotonic() + 300
    while (
        Execution.objects.exclude(status__in=Execution.FINAL_STATUSES).exists() and time.monotonic() < settle_deadline
    ):
        supervise()
        subprocess.run(
            [sys.executable, "manage.py", "reconcile"],
            cwd=ROOT,
            env=command_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
            check=False,
        )
        time.sleep(2)
    pruned = _pruned()
    executions = [*Execution.objects.all(), *pruned]
    open_rows = Counter(execution.status for execution in invariants.open_executions(executions))

    # 1. every slot of the run, to both of its ends, has exactly one execution (the pruned ones included)
    duplicates, gaps = invariants.slot_violations(created, executions, created_at=started_at, ended_at=ended_at)
    # 2. no execution ran twice: each claim (attempt) ran its body at most once,
    #    no body completed after its claim moved on (a frozen body resumed), and
    #    no two bodies of one execution overlapped. A body interrupted after its
    #    side effect (its process killed before the outcome was recorded) is
    #    run again as a new attempt; that is counted, not failed (tasks dedupe
    #    on current_execution()). Fenced side effects commit exactly once.
    events = test_tasks.events(redis_client)
    overlapped_by_policy = _overlap_outcomes(in_transaction, executions)
    cancelled_by_policy = [pk for pk, status in overlapped_by_policy.items() if status == Execution.Status.CANCELLED]
    stale, ran_twice, concurrent = invariants.claim_violations(
        events, executions, cancelled_by_policy=cancelled_by_policy
    )
    fenced_wrong = invariants.fenced_violations(test_tasks.side_effects(), executions)
    # ... and Celery's stored result of each task id says what its execution's row says
    results_wrong = invariants.result_violations(executions, dict(TaskResult.objects.values_list("task_id", "status")))
    stops = Counter(event["execution_id"] for event in events if event["event"] == "stop")
    rerun_after_interruption = sum(1 for n in stops.values() if n > 1)
    # 3. every execution succeeded (these tasks never raise but the planned
    #    once, retried; nothing is missed, failed, timed out...), with the
    #    outcome of a body that ran to its end under the attempt recorded; the
    #    cancel_previous schedule's may also be cancelled or skipped by a newer slot
    without_body = invariants.succeeded_without_body(events, executions, tasks=LOGGING_TASKS)
    statuses = Counter(e.status for e in executions)
    names = {schedule.pk: schedule.name for schedule in created}
    frozen_ids = {execution_id for execution_id, _ in frozen}
    unsuccessful = [
        {
            "id": e.pk,
            "schedule": names.get(e.schedule_id),
            "status": e.status,
            "attempt": e.attempt,
            "frozen": e.pk in frozen_ids,
            "error": e.error[:120],
            "worker": e.worker,
            "celery_task_id": e.celery_task_id,
            "started_at": _iso(e.started_at),
            "claim_expires_at": _iso(e.claim_expires_at),
        }
        for e in executions
        if e.status != Execution.Status.SUCCEEDED and e.pk not in overlapped_by_policy
    ]
    unsuccessful.sort(key=lambda row: (row["status"] not in Execution.FINAL_STATUSES, row["id"]))  # final ones first
    # 4. no every-second schedule went longer than 2 x the lease TTL without a committed slot
    stall, stalled = invariants.max_stall(created, executions, created_at=started_at, ended_at=ended_at)
    stall_bound = SQLITE_STALL_BOUND_SECONDS if connection.vendor == "sqlite" else STALL_BOUND_SECONDS
    raised_while_down = sum(
        1 for event in events if event["event"] == "raise" and any(down <= event["at"] <= up for down, up in outages)
    )
    summary = {
        "seed": SEED,
        "duration_s": DURATION,
        "faults": dict(injected),
        "restarts": restarts,
        "crashed": dict(crashed),
        "db_sessions_cut": sessions_cut,
        "frozen_bodies": frozen,
        "failpoints_fired": fired,
        "failing_bodies_raised_while_broker_down": raised_while_down,
        "reshards": reshards,
        "rolled": rolled,
        "prune_reconcile": commands,
        "pruned": len(pruned),
        "executions_checked": len(executions),
        "statuses": dict(statuses),
        "cancel_previous_outcomes": dict(Counter(overlapped_by_policy.values())),
        "duplicates": duplicates + len(ran_twice),
        "gaps": gaps,
        "completed_after_claim_moved_on": stale,
        "concurrent_runs": len(concurrent),
        "fenced_side_effects_wrong": fenced_wrong,
        # (each with what the row and Celery's result say, and the run's events: what to read the logs for)
        "results_contradicting_rows": [
            {
                "id": e.pk,
                "row": [e.status, e.attempt, e.worker],
                "stored": [
                    [state, str(done)]
                    for state, done in TaskResult.objects.filter(task_id=e.celery_task_id).values_list(
                        "status", "date_done"
                    )
                ],
                "events": [event for event in events if event["execution_id"] == e.pk],
            }
            for e in executions
            if e.pk in set(results_wrong)
        ],
        "succeeded_without_body": without_body,
        "rerun_after_interruption": rerun_after_interruption,
        "max_stall_s": round(stall, 2),
        "max_stall_schedule": stalled,
        "stall_bound_s": stall_bound,
        "not_final": dict(open_rows),
        "window": [started_at.isoformat(), ended_at.isoformat()],
        "unsuccessful": unsuccessful[:40],
        "timeline": timeline,
    }
    stale_ids = {execution_id for execution_id, _ in stale}
    summary["stale_bodies"] = [
        {
            "id": e.pk,
            "schedule": names.get(e.schedule_id),
            "status": e.status,
            "attempt": e.attempt,
            "worker": e.worker,
            "events": [event for event in events if event["execution_id"] == e.pk],
        }
        for e in executions
        if e.pk in stale_ids
    ]
    print("\nchaos summary: " + json.dumps(summary))
    if os.environ.get("CHAOS_LOGS"):  # the processes' logs, kept past pytest's temporary directories
        shutil.copytree(tmp_path, os.environ["CHAOS_LOGS"], dirs_exist_ok=True)
    Path(os.environ.get("CHAOS_SUMMARY", tempfile.gettempdir() + "/chaos-summary.json")).write_text(
        json.dumps(summary, indent=2)
    )

    # A fault every 3-6 s, plus what each takes; every nemesis at least once, and each did what it says.
    assert sum(injected.values()) >= fault_floor and set(injected) == set(faults), summary
    assert raised_while_down and len(fired) >= injected["freeze_in_transaction"] + injected["freeze_in_fenced"], summary
    assert duplicates == 0 and gaps == 0, summary
    assert not ran_twice and not stale and not concurrent and not fenced_wrong, summary
    assert not results_wrong, summary
    assert not open_rows, summary
    assert not unsuccessful, summary
    assert not without_body, summary
    assert stall <= stall_bound, summary


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


def _a_failing_body_starts(failing_ids: list[int]) -> int | None:
    """Wait (up to two intervals) until a first attempt of a failing schedule is claimed; return its execution id."""

    def started() -> int | None:
        return (
            Execution.objects.filter(
                schedule_id__in=failing_ids,
                status=Execution.Status.RUNNING,
                attempt=1,
                started_at__gte=dbclock.now() - timedelta(seconds=0.3),
            )
            .values_list("pk", flat=True)
            .first()
        )

    return wait_until(started, timeout=2 * FAILING_INTERVAL_SECONDS + 2, interval=0.05) or None  # type: ignore[return-value]


def _overlap_outcomes(schedule: Schedule, executions: list[Execution]) -> dict[int, str]:
    """{execution id: status} of the ``cancel_previous`` schedule's executions that a newer slot rightly ended.

    ``cancelled`` with the policy's reason while a newer slot exists, or
    ``skipped`` in the same commit (within a second) as a newer slot.
    """
    mine = [execution for execution in executions if execution.schedule_id == schedule.pk]
    ended = {}
    for execution in mine:
        newer = [other for other in mine if other.scheduled_for > execution.scheduled_for]
        cancelled = execution.status == Execution.Status.CANCELLED and execution.error == dispatch.CANCEL_PREVIOUS_ERROR
        skipped = execution.status == Execution.Status.SKIPPED and any(
            other.status != Execution.Status.SKIPPED
            and abs((other.created_at - execution.created_at).total_seconds()) < 1
            for other in newer
        )
        if newer and (cancelled or skipped):
            ended[execution.pk] = execution.status
    return ended


def _freeze_a_long_body(workers: list[CeleryProcess], long_ids: list[int]) -> tuple[int, int] | None:
    """SIGSTOP the pool child running a long body (no timeout) that just started, past its claim, then SIGCONT it.

    Return the (execution id, attempt) frozen, or None if no such body
    started on a live worker within one interval of the long schedules.
    """
    deadline = time.monotonic() + LONG_INTERVAL_SECONDS + 2
    while time.monotonic() < deadline:
        # Started within the last second: most of the body is still to run when the child resumes.
        recent = Execution.objects.filter(
            schedule_id__in=long_ids,
            timeout=None,
            status=Execution.Status.RUNNING,
            started_at__gte=dbclock.now() - timedelta(seconds=1),
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
