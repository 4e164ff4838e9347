"""A rolling upgrade under load: an older release's beats and worker replaced one by one by this one's, nothing doubled or lost.

The older release is ``OLD_RELEASE``, checked out in a git worktree and run
with this checkout's virtualenv (its pinned requirements are a subset of
these). As in production, its ``migrate`` creates the database (a new one
beside the test database, on both PostgreSQL and SQLite) and two of its
beats and a worker run every-second schedules; this release's ``migrate``
then runs under them (its migrations only add, so the old code keeps
working), and each old replica is replaced by one of this release: a new
one starts, then an old one gets SIGTERM, beats first, then the worker.

Throughout, the lease token may move only when the beat stopped was the
leader, and then once. At the end, with ``tests/support/invariants.py``: every slot
from the schedules' creation to the end has exactly one execution, every
execution succeeded within ``FINAL_SECONDS``, each body ran once under its
claim, and no schedule went longer than 2 x TTL without a committed slot.

The commit must be in the clone: a shallow clone fails this test, naming
the fix (``git fetch --unshallow``), rather than skipping it.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path

import pytest
import redis
from django.db import connection

from scheduler import dbclock
from scheduler.conf import Defaults
from scheduler.models import Execution, Schedule
from scheduler.owners import leases
from tests.acceptance.test_beat_replicas import Start, leader_process
from tests.acceptance.test_shard_count_change import settle_window
from tests.support import invariants, processes
from tests.support import tasks as test_tasks
from tests.support.processes import ROOT, CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

#: The older release: the last commit before issue 26's first change
#: (generation (b) of the upgrade section in docs/deploying.md: the instance lock, no stored shard count).
OLD_RELEASE = "60ac055279871d9edec322f58dd18a0350fee739"
SCHEDULES = 10
WORKER_CONCURRENCY = 4
#: A new or old replica's start (imports, first database round trip) on a busy machine.
START_SECONDS = 30.0
#: How long each mixed state is held and watched before the next step.
STEADY_SECONDS = 3.0
#: A leader stopped by SIGTERM releases its lease: a follower takes it within a few ticks.
HANDOVER_SECONDS = 10.0
#: A beat given SIGTERM releases its lease and exits within a tick or two.
BEAT_STOP_SECONDS = 15.0
#: A worker given SIGTERM finishes what it runs, hands back what it holds
#: and exits. Seen here: a pool child first waiting out billiard's 30 s
#: (300 x 0.1 s) for the main process to read its last results.
WORKER_STOP_SECONDS = 45.0
#: Every execution of the run is final this long after its slot was committed at the latest.
FINAL_SECONDS = 30.0
#: The longest an every-second schedule may go without a committed slot (the replicas run the default lease).
STALL_SECONDS = 2 * Defaults.LEASE_TTL_SECONDS


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def old_release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Check ``OLD_RELEASE`` out in a worktree of its own; remove it afterwards."""
    if git("rev-parse", "--git-dir").returncode:
        pytest.fail(f"{ROOT} is not a git checkout: this test runs {OLD_RELEASE} from its history", pytrace=False)
    if git("cat-file", "-e", f"{OLD_RELEASE}^{{commit}}").returncode:
        pytest.fail(
            f"commit {OLD_RELEASE} (the older release of the rolling upgrade) is not in this clone; a shallow "
            "clone lacks it: run `git fetch --unshallow` (CI must clone the full history)",
            pytrace=False,
        )
    path = tmp_path_factory.mktemp("old-release") / "checkout"
    added = git("worktree", "add", "--detach", str(path), OLD_RELEASE)
    assert added.returncode == 0, f"git worktree add failed: {added.stderr}"
    try:
        yield path
    finally:
        git("worktree", "remove", "--force", str(path))
        git("worktree", "prune")


@contextlib.contextmanager
def connected_to(name: str) -> Iterator[None]:
    """Point this process's connection at database ``name`` for the block (a new database of the same server)."""
    original = connection.settings_dict["NAME"]
    connection.close()
    connection.settings_dict["NAME"] = name
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict["NAME"] = original


@pytest.fixture
def upgraded_database(process_env: dict[str, str], tmp_path: Path, db_vendor: str) -> Iterator[None]:
    """An empty database beside the test database, that this test and every process it starts use.

    Empty, because the older release's ``migrate`` must create it, as it
    did in production: the test database holds this release's schema.
    """
    name = str(tmp_path / "upgrade.sqlite3") if db_vendor == "sqlite" else f"{connection.settings_dict['NAME']}_upgrade"
    if db_vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            cursor.execute(f'CREATE DATABASE "{name}"')
    original_url = process_env["DATABASE_URL"]
    try:
        with connected_to(name):
            process_env["DATABASE_URL"] = processes.test_database_url()
            yield
    finally:
        process_env["DATABASE_URL"] = original_url
        if db_vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def manage(checkout: Path, env: dict[str, str], *args: str) -> str:
    """Run ``manage.py`` of ``checkout``; return its output, failing with it on a non-zero exit."""
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=checkout,
        env={**env, "PYTHONPATH": str(checkout)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, (
        f"manage.py {' '.join(args)} in {checkout} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


#: Run by the older release's ``manage.py shell``: its own models create the schedules.
CREATE_SCHEDULES = f"""
import tests.tasks  # the older release's place for them
from scheduler.models import Schedule
for index in range({SCHEDULES}):
    schedule = Schedule(name=f"upgrade-{{index:02d}}", task="tests.record", interval=1, kwargs={{"label": f"upgrade-{{index:02d}}"}})
    schedule.full_clean()
    schedule.save()
"""
#: Run by the older release's ``manage.py shell`` on this release's schema: it still writes what it knows.
OLD_CODE_WRITES_A_SCHEDULE = """
import tests.tasks
from scheduler.models import Schedule
schedule = Schedule(name="written-by-the-older-release", task="tests.record", interval=60, enabled=False)
schedule.full_clean()
schedule.save()
Schedule.objects.filter(pk=schedule.pk).delete()
"""


def _not_fires(log: str) -> str:
    """The lines of a beat's log that are not one fire each (those crowd out why it moved), the last 60."""
    return "\n".join([line for line in log.splitlines() if " dispatch " not in line][-60:])


class Leadership:
    """The beat lease's token, read at each step: it may move only when the step stopped the leader, and then once."""

    def __init__(self) -> None:
        self.state = leases.current("beat")
        assert self.state.is_held, "no beat leads"
        self.handovers = 0

    def unchanged(self, step: str, beats: list[CeleryProcess]) -> None:
        now = leases.current("beat")
        assert (now.token, now.holder) == (self.state.token, self.state.holder), (
            f"leadership changed while {step}: token {self.state.token} ({self.state.holder}) -> {now.token} ({now.holder})"
            + "".join(f"\n--- {beat.name}'s log, but its fires:\n{_not_fires(beat.log())}" for beat in beats)
        )

    def handed_over(self, step: str) -> None:
        took = wait_until(
            lambda: leases.current("beat").token != self.state.token, timeout=HANDOVER_SECONDS, interval=0.1
        )
        assert took, f"no replica took the lease within {HANDOVER_SECONDS}s of {step}"
        time.sleep(STEADY_SECONDS)  # a flap after the takeover would move the token again
        now = leases.current("beat")
        assert now.is_held and now.token == self.state.token + 1, (
            f"{step}: the lease should change hands once, token {self.state.token} -> {now.token} ({now.holder})"
        )
        self.state = now
        self.handovers += 1


def exited(process: CeleryProcess, *, within: float) -> None:
    """Wait for a process sent SIGTERM to exit by itself; fail with its processes and log tail otherwise."""
    try:
        process.popen.wait(within)  # type: ignore[union-attr]
    except subprocess.TimeoutExpired:
        tree = subprocess.run(
            ["ps", "-o", "pid,ppid,stat,wchan:30,cmd", "-g", str(process.pid)],
            capture_output=True,
            text=True,
            check=False,
        )
        raise AssertionError(
            f"{process.name} did not stop within {within}s of SIGTERM:\n{tree.stdout}\nlog tail:\n{process.log()[-3000:]}"
        ) from None


def stop_gracefully(process: CeleryProcess) -> None:
    """SIGTERM, as a rollout does; the process must exit by itself."""
    process.send(signal.SIGTERM)
    exited(process, within=BEAT_STOP_SECONDS)


def test_rolling_upgrade_from_an_older_release__no_slot_doubled_or_lost_and_leadership_moves_only_with_a_stopped_leader(
    old_release: Path,
    upgraded_database: None,
    celery_processes: Start,
    process_env: dict[str, str],
    redis_client: redis.Redis,
) -> None:
    # The old processes must run the worktree's code, not this checkout's or an installed copy.
    found = subprocess.run(
        [sys.executable, "-P", "-c", "import importlib.util; print(importlib.util.find_spec('scheduler').origin)"],
        cwd=old_release,
        env={**process_env, "PYTHONPATH": str(old_release)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(found.stdout.strip()).is_relative_to(old_release), found.stdout
    here = find_spec("scheduler")
    assert here is not None and here.origin is not None and Path(here.origin).is_relative_to(ROOT)

    began = time.monotonic()

    def step(done: str) -> None:
        print(f"{time.monotonic() - began:6.1f}s {done}", flush=True)

    # Given a database migrated by the older release, its every-second schedules,
    # and two of its beats and a worker running them
    manage(old_release, process_env, "migrate", "--no-input")
    step("older release migrated")
    manage(old_release, process_env, "shell", "-c", CREATE_SCHEDULES)
    step("schedules created")
    old_worker = celery_processes("worker", "old-worker", checkout=old_release, concurrency=WORKER_CONCURRENCY)
    old_beats = [celery_processes("beat", f"old-beat{i}", checkout=old_release) for i in range(2)]
    old_worker.wait_for_log(r"ready\.", timeout=START_SECONDS)
    leader_process(old_beats, timeout=START_SECONDS)
    assert wait_until(
        lambda: Execution.objects.filter(status=Execution.Status.SUCCEEDED).count() >= 3 * SCHEDULES,
        timeout=START_SECONDS,
    ), "the older release's replicas did not run the schedules"
    leadership = Leadership()
    running_since = dbclock.now()
    step("older release running")

    # When this release's migrations run under them
    print(manage(ROOT, process_env, "migrate", "--no-input"))
    step("this release migrated")
    ran = Execution.objects.filter(status=Execution.Status.SUCCEEDED).count()
    assert wait_until(
        lambda: Execution.objects.filter(status=Execution.Status.SUCCEEDED).count() >= ran + 2 * SCHEDULES,
        timeout=START_SECONDS,
    ), "the older release stopped running the schedules after this release's migrate"
    leadership.unchanged("this release's migrations ran", old_beats)
    manage(old_release, process_env, "shell", "-c", OLD_CODE_WRITES_A_SCHEDULE)
    schedules = list(Schedule.objects.order_by("pk"))
    assert len(schedules) == SCHEDULES

    # ... and each old beat is replaced: a new one starts, then an old one gets
    # SIGTERM (the one leading first, so the lease passes between versions)
    new_beats: list[CeleryProcess] = []
    for index in range(2):
        new = celery_processes("beat", f"new-beat{index}")
        new.wait_for_log(r"beat replica \S+ started", timeout=START_SECONDS)
        new_beats.append(new)
        step(f"{new.name} started")
        time.sleep(STEADY_SECONDS)
        leadership.unchanged(f"new-beat{index} started beside {len(old_beats)} old", [*old_beats, *new_beats])
        leading = leader_process([*old_beats, *new_beats])
        old = leading if leading in old_beats else old_beats[0]
        old_beats.remove(old)
        stop_gracefully(old)
        step(f"{old.name} stopped")
        if old is leading:
            leadership.handed_over(f"stopping the leader {old.name}")
        else:
            time.sleep(STEADY_SECONDS)
            leadership.unchanged(f"the follower {old.name} stopped", [*old_beats, *new_beats])
    assert leader_process(new_beats) and leadership.handovers >= 1

    # ... then the old worker, the same way
    new_worker = celery_processes("worker", "new-worker", concurrency=WORKER_CONCURRENCY)
    new_worker.wait_for_log(r"ready\.", timeout=START_SECONDS)
    step("new-worker started")
    old_worker.send(signal.SIGTERM)  # waited for below: the new worker serves meanwhile, as in a rollout
    time.sleep(STEADY_SECONDS)
    leadership.unchanged("the worker was replaced", new_beats)

    # Then every slot from the schedules' creation to the end has exactly one
    # execution, every execution succeeded within the bound, each body ran
    # once under its claim, and no on-time schedule stalled
    settle_window(schedules)
    ended = dbclock.now()
    open_rows = Execution.objects.filter(scheduled_for__lte=ended).exclude(status__in=Execution.FINAL_STATUSES)
    waited = time.monotonic()
    settled = wait_until(lambda: not open_rows.exists(), timeout=FINAL_SECONDS, interval=0.2)
    final_after = time.monotonic() - waited
    leadership.unchanged("the upgraded replicas ran", new_beats)
    step("every execution final" if settled else "executions left open")
    exited(old_worker, within=WORKER_STOP_SECONDS)
    step("old-worker stopped")
    for process in new_beats:
        process.stop()
    executions = list(Execution.objects.filter(scheduled_for__lte=ended))
    # A schedule's first slot is the first after its save; its created_at may be read a moment before.
    created_at = max(schedule.created_at for schedule in schedules) + timedelta(seconds=1)
    duplicates, gaps = invariants.slot_violations(schedules, executions, created_at=created_at, ended_at=ended)
    stall, stalled = invariants.max_stall(schedules, executions, created_at=running_since, ended_at=ended)
    events = test_tasks.events(redis_client)
    stale, twice, overlapping = invariants.claim_violations(events, executions)
    without_body = invariants.succeeded_without_body(events, executions, tasks=["tests.record"])
    bodies = Counter(run["execution_id"] for run in test_tasks.runs(redis_client))
    summary = {
        "executions": len(executions),
        "statuses": dict(Counter(e.status for e in executions)),
        "duplicates": duplicates,
        "gaps": gaps,
        "final_after_s": round(final_after, 2),
        "handovers": leadership.handovers,
        "longest_stall_s": round(stall, 2),
        "stalled_schedule": stalled,
        "stale": stale,
        "started_twice": twice,
        "overlapping": overlapping,
        "succeeded_without_body": without_body,
        "bodies_run_twice": [execution_id for execution_id, n in bodies.items() if n > 1],
    }
    print("rolling upgrade summary: " + json.dumps(summary))
    assert settled, (
        f"executions not final {FINAL_SECONDS}s after the run: {dict(Counter(open_rows.values_list('status', flat=True)))}, "
        f"{redis_client.llen('celery')} messages in the broker, the oldest: "
        f"{list(open_rows.order_by('scheduled_for').values('id', 'status', 'scheduled_for', 'enqueued_at', 'worker')[:5])}"
    )
    assert duplicates == 0 and gaps == 0, summary
    assert summary["statuses"] == {Execution.Status.SUCCEEDED: len(executions)}, summary
    assert not (stale or twice or overlapping or without_body or summary["bodies_run_twice"]), summary
    assert stall <= STALL_SECONDS, summary
