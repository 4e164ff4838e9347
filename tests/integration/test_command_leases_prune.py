"""``leases`` and ``prune_executions`` commands: output, and bad input that changes nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext

from scheduler import dbclock
from scheduler.models import Execution, Instance, Lease, Schedule
from scheduler.ops.prune import prune_executions
from scheduler.owners import leases
from tests.integration.command_support import refused, run
from tests.support import processes
from tests.support.factories import make_past_execution, make_schedule

Status = Execution.Status


@pytest.mark.django_db
def test_leases__no_leader_yet() -> None:
    output = run("leases")
    assert "no lease has ever been taken" in output
    assert json.loads(run("leases", "--json"))["leases"] == []


@pytest.mark.django_db
def test_leases__shows_holder_token_expiry_and_heartbeats() -> None:
    # Given a leader with a heartbeat and a follower
    handle = leases.acquire("beat", "host-1-aaa", ttl=10)
    assert handle is not None
    for instance_id, leader in (("host-1-aaa", True), ("host-2-bbb", False)):
        Instance.objects.create(
            instance_id=instance_id,
            role="beat",
            hostname="host",
            pid=1,
            started_at=Now(),
            last_seen=Now(),
            is_leader=leader,
        )
    # When shown
    data = json.loads(run("leases", "--json"))
    text = run("leases")
    # Then
    (lease,) = data["leases"]
    assert (lease["held"], lease["holder"], lease["token"]) == (True, "host-1-aaa", handle.token)
    assert 0 < lease["seconds_left"] <= 10
    assert lease["leader_heartbeat_age_seconds"] is not None
    assert [row["instance_id"] for row in data["instances"]] == ["host-1-aaa", "host-2-bbb"]
    assert f"held by host-1-aaa (token {handle.token})" in text
    assert "leader  host-1-aaa" in text


@pytest.mark.django_db
def test_leases__after_crashes_only_the_holder_leads_and_silent_beats_are_stale() -> None:
    # Given three beats that each wrote is_leader=True; two were killed long ago, the third holds the lease
    now = dbclock.now()
    for instance_id, age in (("host-1-dead", 416), ("host-2-dead", 325), ("host-3-live", 1.7)):
        seen = now - timedelta(seconds=age)
        Instance.objects.create(
            instance_id=instance_id,
            role="beat",
            hostname="host",
            pid=1,
            started_at=seen,
            last_seen=seen,
            is_leader=True,
        )
    assert leases.acquire("beat", "host-3-live", ttl=10) is not None
    # When shown
    rows = {row["instance_id"]: row for row in json.loads(run("leases", "--json"))["instances"]}
    text = run("leases")
    # Then only the holder leads, and the silent ones are stale with their age
    assert {iid: (row["is_leader"], row["stale"]) for iid, row in rows.items()} == {
        "host-3-live": (True, False),
        "host-1-dead": (False, True),
        "host-2-dead": (False, True),
    }
    assert rows["host-1-dead"]["last_seen_age_seconds"] >= 416
    assert "leader  host-3-live" in text and "leader  host-1-dead" not in text
    assert re.search(r"host-1-dead  last seen 41\d\.\ds ago, STALE \(no heartbeat for over 10s\)", text), text

    # When the lease expires too (every beat is dead), Then nobody leads
    Lease.objects.filter(name="beat").update(expires_at=dbclock.now() - timedelta(seconds=1))
    assert not [row for row in json.loads(run("leases", "--json"))["instances"] if row["is_leader"]]
    assert " leader " not in run("leases")


@pytest.mark.django_db
def test_leases__expired_lease_reads_not_held() -> None:
    assert leases.acquire("beat", "gone-1-aaa", ttl=10) is not None
    Lease.objects.filter(name="beat").update(expires_at=dbclock.now() - timedelta(seconds=5))
    assert "NOT HELD" in run("leases")


@pytest.fixture
def history(db: None) -> Schedule:
    schedule = make_schedule("s")
    for n in range(5):
        make_past_execution(f"old-{n}", status=Status.SUCCEEDED, age_days=40 + n, schedule=schedule)
    make_past_execution("old-failed", status=Status.FAILED, age_days=50, schedule=schedule)
    make_past_execution("old-running", status=Status.RUNNING, age_days=0, slot_age_days=60, schedule=schedule)
    make_past_execution("recent", status=Status.SUCCEEDED, age_days=1, schedule=schedule)
    make_past_execution("adhoc-old", status=Status.SUCCEEDED, age_days=45)
    return schedule


def test_prune__deletes_old_finished_only(history: Schedule) -> None:
    output = run("prune_executions", "--older-than", "30d")
    assert output.startswith("deleted 7 execution(s)")
    assert set(Execution.objects.values_list("idempotency_key", flat=True)) == {"old-running", "recent"}


def test_prune__dry_run_changes_nothing(history: Schedule) -> None:
    data = json.loads(run("prune_executions", "--older-than", "30d", "--dry-run", "--json"))
    assert (data["matched"], data["deleted"], data["dry_run"]) == (7, 0, True)
    assert Execution.objects.count() == 9


def test_prune__keep_last_keeps_each_schedules_newest(history: Schedule) -> None:
    run("prune_executions", "--older-than", "30d", "--keep-last", "3")
    # the schedule's newest three by slot are kept, and the one in flight is never pruned
    kept = set(Execution.objects.values_list("idempotency_key", flat=True))
    assert kept == {"recent", "old-0", "old-1", "old-running"}


def test_prune__status_filter(history: Schedule) -> None:
    run("prune_executions", "--older-than", "30d", "--status", "failed")
    assert not Execution.objects.filter(idempotency_key="old-failed").exists()
    assert Execution.objects.count() == 8


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--older-than", "thirty days"], "is not a duration like 30d"),
        (["--older-than", "0d"], "must be longer than 0"),
        (["--older-than", "30d", "--keep-last", "-1"], "-1 is negative"),
        (["--older-than", "30d", "--status", "running"], "invalid choice: 'running'"),
        ([], "the following arguments are required: --older-than"),
    ],
)
def test_prune__bad_input_refused_and_nothing_deleted(history: Schedule, args: list[str], message: str) -> None:
    assert message in refused("prune_executions", *args)
    assert Execution.objects.count() == 9


@pytest.mark.django_db(transaction=True)
def test_prune__command_line_errors_are_one_line_without_traceback(redis_url: str) -> None:
    env = {**os.environ, "DATABASE_URL": processes.test_database_url(), "REDIS_URL": redis_url, "DJANGO_DEBUG": "1"}
    for args, code in ((["--older-than", "soon"], 1), (["--keep-last", "x", "--older-than", "1d"], 2)):
        result = subprocess.run(
            [sys.executable, "manage.py", "prune_executions", *args],
            cwd=processes.ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == code, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr


def test_prune__holds_schedule_rows_only_while_the_server_works(history: Schedule) -> None:
    # Given old executions, one of them re-run by a recent execution (retry_of)
    rerun = make_past_execution("rerun", status=Status.SUCCEEDED, age_days=0, schedule=history)
    rerun.retry_of = Execution.objects.get(idempotency_key="old-0")
    rerun.save(update_fields=["retry_of"])
    # When a prune deletes them
    with CaptureQueriesContext(connection) as queries:
        report = prune_executions(older_than=dbclock.now() - timedelta(days=30))
    # Then no statement loaded the rows it deleted into this process: with the
    # schedule rows locked, client-side work per row (Django's delete collector
    # reads every row to null retry_of) leaves the transaction idle, stalling
    # those schedules' dispatch and tripping the session's idle-in-transaction bound
    assert report.deleted == 7
    loaded = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT") and '"args"' in q["sql"]]
    assert not loaded, loaded
    # and the re-run stays, no longer pointing at the pruned execution
    rerun.refresh_from_db()
    assert rerun.retry_of_id is None
