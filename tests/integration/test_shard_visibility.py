"""The sharded beat as operators see it: ``leases``, ``shards``, the cluster page, ``/leaderz``, ``/metrics``, check W001."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from django.template import Context, Template
from django.test import Client, RequestFactory
from prometheus_client.parser import text_string_to_metric_families

from scheduler import checks, dbclock, shards
from scheduler.beat import liveness
from scheduler.conf import settings as scheduler_settings
from scheduler.models import Instance, Lease, Schedule
from scheduler.owners import leases, schedules
from tests.integration.command_support import refused, run
from tests.support.processes import ROOT

pytestmark = pytest.mark.django_db

SHARDS = 4


@pytest.fixture
def sharded(settings: Any) -> None:
    settings.SCHEDULER_SHARDS = SHARDS


def beat(instance_id: str, *, age: float = 1.0) -> Instance:
    """A beat replica whose last heartbeat was ``age`` seconds ago on the database clock."""
    seen = dbclock.now() - timedelta(seconds=age)
    return Instance.objects.create(
        instance_id=instance_id, role="beat", hostname="h", pid=1, started_at=seen, last_seen=seen
    )


def hold(holder: str, *shard_numbers: int, ttl: float = 10) -> list[leases.LeaseHandle]:
    taken = leases.acquire_many([shards.lease_name(shard) for shard in shard_numbers], holder, ttl=ttl)
    assert len(taken) == len(shard_numbers)
    return taken


@pytest.fixture
def three_replicas(sharded: None) -> None:
    """host-a holds shards 0 and 2, host-b shard 1, host-c (live) none; shard 3 has never been taken."""
    for instance_id in ("host-a", "host-b", "host-c"):
        beat(instance_id)
    hold("host-a", 0, 2)
    hold("host-b", 1)


# --- manage.py leases ----------------------------------------------------------------


def test_leases__sharded__one_line_per_shard_the_replicas_and_the_shard_not_held(three_replicas: None) -> None:
    # Given three live replicas holding shards 0-2 of 4, and a lease left by the unsharded beat
    assert leases.acquire("beat", "host-old", ttl=10) is not None
    # When shown
    data = json.loads(run("leases", "--json"))
    text = run("leases")
    # Then every shard has its line, and the one nobody holds is flagged
    assert data["shards"] == SHARDS and data["not_held"] == ["beat:3"]
    by_name = {row["name"]: row for row in data["leases"]}
    assert [by_name[f"beat:{k}"]["shard"] for k in range(SHARDS)] == list(range(SHARDS))
    assert [by_name[f"beat:{k}"]["holder"] for k in range(SHARDS)] == ["host-a", "host-b", "host-a", None]
    assert by_name["beat"]["shard"] is None and by_name["beat"]["holder"] == "host-old"
    assert data["replicas"] == {
        "host-a": {"count": 2, "shards": [0, 2]},
        "host-b": {"count": 1, "shards": [1]},
        "host-c": {"count": 0, "shards": []},
    }
    assert "shards: 4 (SCHEDULER_SHARDS), 3 held, NOT HELD 1: beat:3" in text
    assert "  host-a  2 shards (0, 2)" in text and "  host-c  0 shards" in text
    assert re.search(r"^lease beat:1: held by host-b \(token 1\), expires in \d+\.\ds", text, re.MULTILINE), text
    assert "lease beat:3: NOT HELD (last token 0): its schedules are not dispatched" in text
    assert "other leases (no shard of 4" in text and "lease beat: held by host-old" in text
    # And a replica holding any shard leads, one holding none does not
    leading = {row["instance_id"]: row["is_leader"] for row in data["instances"]}
    assert leading == {"host-a": True, "host-b": True, "host-c": False}


def test_leases__sharded__an_expired_shard_reads_not_held(three_replicas: None) -> None:
    Lease.objects.filter(name="beat:1").update(expires_at=dbclock.now() - timedelta(seconds=1))
    data = json.loads(run("leases", "--json"))
    assert data["not_held"] == ["beat:1", "beat:3"]
    assert data["replicas"]["host-b"] == {"count": 0, "shards": []}


def test_leases__invalid_shard_count__one_line_error(settings: Any) -> None:
    settings.SCHEDULER_SHARDS = 0
    assert "SCHEDULER_SHARDS must be a whole number from 1 to 1024, got 0" in refused("leases")


# --- manage.py shards ----------------------------------------------------------------


def _schedules(count: int) -> list[Schedule]:
    return [schedules.create(name=f"s{n}", task="scheduler.echo", interval=60) for n in range(count)]


def test_shards__after_the_count_shrinks__stranded_schedules_counted_then_assigned(settings: Any) -> None:
    # Given schedules saved with 4 shards, then the count lowered to 2
    settings.SCHEDULER_SHARDS = 4
    created = _schedules(12)
    assert {schedule.shard for schedule in created} == {0, 1, 2, 3}
    settings.SCHEDULER_SHARDS = 2
    misplaced = [s for s in created if s.shard != s.pk % 2]
    stranded = [s for s in created if s.shard >= 2]
    # When reported
    data = json.loads(run("shards", "--json"))
    text = run("shards")
    # Then the schedules per shard, those not in id % N, and those no replica dispatches are counted
    assert (data["shards"], data["schedules"], data["misplaced"], data["stranded"]) == (
        2,
        12,
        len(misplaced),
        len(stranded),
    )
    assert [row["shard"] for row in data["by_shard"]] == [0, 1, 2, 3]
    assert [row["stranded"] for row in data["by_shard"]] == [False, False, True, True]
    assert sum(row["schedules"] for row in data["by_shard"]) == 12
    assert f"STRANDED in shards >= 2: {len(stranded)} (not dispatched until manage.py shards --assign)" in text
    # And the system check says so too
    assert [warning.id for warning in checks.check_stranded_schedules(databases=["default"])] == ["scheduler.W001"]

    # When assigned as a dry run, Then nothing moves
    assert json.loads(run("shards", "--assign", "--dry-run", "--json")) == {
        "shards": 2,
        "moved": len(misplaced),
        "dry_run": True,
    }
    assert Schedule.objects.filter(shard__gte=2).count() == len(stranded)
    # When assigned, Then every schedule is in shard id % 2 and nothing is stranded
    assert run("shards", "--assign").strip() == f"moved {len(misplaced)} schedules into shard id % 2"
    assert all(schedule.shard == schedule.pk % 2 for schedule in Schedule.objects.all())
    assert json.loads(run("shards", "--json"))["stranded"] == 0
    assert checks.check_stranded_schedules(databases=["default"]) == []
    assert run("shards", "--assign").strip() == "moved 0 schedules into shard id % 2"


def test_shards__live_replicas_and_the_shards_they_prefer_and_hold(three_replicas: None) -> None:
    # Given three live beats (on PostgreSQL a live beat also holds its instance lock)
    locks = [liveness.InstanceLock(instance_id) for instance_id in ("host-a", "host-b", "host-c")]
    try:
        if connection.vendor == "postgresql":
            assert all(lock.try_acquire() for lock in locks)
        # When reported
        replicas = json.loads(run("shards", "--json"))["replicas"]
        text = run("shards")
    finally:
        for lock in locks:
            lock.close()
    # Then each live replica is listed with the shards rendezvous hashing gives it, and those it holds
    assert set(replicas) == {"host-a", "host-b", "host-c"}
    preferred = sorted(shard for row in replicas.values() for shard in row["preferred"])
    assert preferred == list(range(SHARDS))
    assert sorted(len(row["preferred"]) for row in replicas.values()) == [1, 1, 2]
    assert replicas["host-a"]["held"] == [0, 2] and replicas["host-c"]["held"] == []
    assert "live beat replicas: 3" in text
    assert re.search(r"^  host-c  prefers [0-9, -]+ \(holds none\)$", text, re.MULTILINE), text


def test_shards__invalid_count__one_line_error_and_nothing_changes(settings: Any) -> None:
    # Given schedules in shards 0..3 and an invalid count
    settings.SCHEDULER_SHARDS = 4
    _schedules(4)
    before = sorted(Schedule.objects.values_list("pk", "shard"))
    settings.SCHEDULER_SHARDS = 5000
    # When assigned, Then refused in one line, and nothing moved
    assert "SCHEDULER_SHARDS must be a whole number from 1 to 1024, got 5000" in refused("shards", "--assign")
    assert sorted(Schedule.objects.values_list("pk", "shard")) == before
    # And a dry run without --assign is refused too
    settings.SCHEDULER_SHARDS = 2
    assert "--dry-run goes with --assign" in refused("shards", "--dry-run")
    assert sorted(Schedule.objects.values_list("pk", "shard")) == before


def test_shards__invalid_count_from_the_command_line__one_line_on_stderr() -> None:
    # Given SCHEDULER_SHARDS=0 in the environment (the system check would print a report of several lines)
    env = {**os.environ, "DJANGO_DEBUG": "1", "SCHEDULER_SHARDS": "0"}
    # When the command runs, Then it exits 1 with one line
    result = subprocess.run(
        [sys.executable, "manage.py", "shards", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "SCHEDULER_SHARDS must be a whole number from 1 to 1024, got 0" in result.stderr
    assert "SCHEDULER_SHARDS must be a whole number" in json.loads(result.stdout)["error"]


# --- check W001 ----------------------------------------------------------------------


def test_check_stranded__only_as_a_database_check_and_only_for_active_schedules(settings: Any) -> None:
    # Given a schedule left in shard 3 when the count is 2
    settings.SCHEDULER_SHARDS = 4
    schedule = next(s for s in _schedules(8) if s.shard >= 2)
    Schedule.objects.exclude(pk=schedule.pk).delete()
    settings.SCHEDULER_SHARDS = 2
    # Then a plain check (no database) asks nothing, a database check warns
    assert checks.check_stranded_schedules() == []
    out, err = io.StringIO(), io.StringIO()
    call_command("check", "--database", "default", stdout=out, stderr=err)
    assert "scheduler.W001" in out.getvalue() + err.getvalue()
    # When the schedule is disabled, Then nothing is stranded that the beat would dispatch
    Schedule.objects.filter(pk=schedule.pk).update(enabled=False)
    assert checks.check_stranded_schedules(databases=["default"]) == []
    # And unsharded, one leader dispatches every shard
    Schedule.objects.filter(pk=schedule.pk).update(enabled=True)
    settings.SCHEDULER_SHARDS = 1
    assert checks.check_stranded_schedules(databases=["default"]) == []


# --- the cluster page ------------------------------------------------------------------


def _table(page: str, table_id: str, attribute: str) -> dict[str, str]:
    table = re.search(rf'<table id="{table_id}">(.*?)</table>', page, re.DOTALL)
    assert table, page
    return {m[1]: m[0] for m in re.finditer(rf'<tr[^>]* {attribute}="([^"]+)"[^>]*>.*?</tr>', table[1], re.DOTALL)}


def test_cluster_page__sharded__shards_replicas_and_holders_lead(staff: Client, three_replicas: None) -> None:
    # When the cluster page is shown
    page = staff.get("/admin/scheduler/lease/").content.decode()
    # Then each shard has its row with holder, token and expiry, and the one not held is flagged
    rows = _table(page, "cluster-shards", "data-shard")
    assert list(rows) == ["0", "1", "2", "3"]
    assert "<td>host-a</td>" in rows["0"] and "<td>host-b</td>" in rows["1"]
    assert re.search(r"<td>\d+\.\ds</td>", rows["2"])
    assert 'class="not-held"' in rows["3"] and "NOT HELD" in rows["3"]
    assert "not held: beat:3" in page
    # And the shards per replica, a live replica holding none included
    replicas = _table(page, "cluster-replicas", "data-replica")
    assert re.search(r"<td>host-a</td><td>2</td><td>0, 2</td>", replicas["host-a"])
    assert re.search(r"<td>host-c</td><td>0</td><td>—</td>", replicas["host-c"])
    # And a beat holding any shard leads in the instances table
    instances = _table(page, "cluster-instances", "data-instance")
    assert sorted(iid for iid, row in instances.items() if "<td>yes</td>" in row) == ["host-a", "host-b"]
    # And the banner names the shard without an owner
    assert 'id="leader-warning"' in page and "1 of 4 shards have no owner" in page and "beat:3" in page


def test_cluster_page__sharded__every_shard_held_no_banner(staff: Client, three_replicas: None) -> None:
    hold("host-c", 3)
    page = staff.get("/admin/scheduler/lease/").content.decode()
    assert 'id="leader-warning"' not in page and "every shard held" in page


def test_cluster_page__sharded__a_lease_of_another_count_is_warned_about(staff: Client, three_replicas: None) -> None:
    # Given a replica still on 8 shards holding shard 6
    hold("host-old", 6)
    page = staff.get("/admin/scheduler/lease/").content.decode()
    assert 'id="stray-leases"' in page and "Lease beat:6 is held by host-old but fences no shard of the 4" in page


def test_instance_list__sharded__a_shard_holder_leads(staff: Client, three_replicas: None) -> None:
    page = staff.get("/admin/scheduler/instance/").content.decode()
    assert page.count('alt="True"') == 2


def test_leader_warning__sharded__one_query(three_replicas: None, django_assert_num_queries: Any) -> None:
    request = RequestFactory().get("/admin/")
    request.user = get_user_model().objects.create_superuser("root", "root@example.invalid", "pw")
    template = Template("{% load scheduler_admin %}{% leader_problem as problem %}{{ problem }}")
    with django_assert_num_queries(1):
        text = template.render(Context({"request": request}))
    assert "1 of 4 shards have no owner" in text and "beat:3" in text


# --- /leaderz and /readyz ----------------------------------------------------------------


def test_leaderz__sharded__503_naming_shards_without_an_owner_that_renewed_and_readyz_stays_200(
    client: Client, three_replicas: None, redis_url: str
) -> None:
    # Given shard 3 never taken, and shard 1's holder silent for longer than twice the renew interval
    limit = 2 * scheduler_settings.LEASE_RENEW_SECONDS
    Lease.objects.filter(name="beat:1").update(renewed_at=dbclock.now() - timedelta(seconds=limit + 1))
    # When probed
    response = client.get("/leaderz")
    # Then 503, naming both shards
    body = response.json()
    assert response.status_code == 503 and body["failed"] == ["leader"]
    detail = body["checks"]["leader"]["detail"]
    assert detail.startswith("2 of 4 shards have no owner that renewed within") and detail.endswith("beat:1, beat:3")
    # And the web's readiness does not depend on the beat
    assert client.get("/readyz").status_code == 200


def test_leaderz__sharded__200_when_every_shard_was_renewed(client: Client, three_replicas: None) -> None:
    hold("host-c", 3)
    response = client.get("/leaderz")
    body = response.json()
    assert response.status_code == 200, body
    assert (
        body["checks"]["leader"]["detail"].startswith("all 4 shards renewed within")
        and "by 3 replicas" in body["checks"]["leader"]["detail"]
    )


# --- /metrics ----------------------------------------------------------------------------


def scrape(client: Client) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def _series(samples: dict[str, float], name: str) -> dict[str, float]:
    return {key: value for key, value in samples.items() if key.startswith(name + "{") or key == name}


def test_metrics__sharded__per_shard_held_leader_per_replica_and_leader_present(
    client: Client, three_replicas: None
) -> None:
    # Given shards 0-2 of 4 held
    samples = scrape(client)
    # Then each shard says whether it is held, and by whom
    assert samples["scheduler_shards"] == SHARDS
    assert _series(samples, "scheduler_shard_held") == {
        'scheduler_shard_held{shard="0"}': 1,
        'scheduler_shard_held{shard="1"}': 1,
        'scheduler_shard_held{shard="2"}': 1,
        'scheduler_shard_held{shard="3"}': 0,
    }
    assert _series(samples, "scheduler_shard_leader_info") == {
        'scheduler_shard_leader_info{instance="host-a",shard="0"}': 1,
        'scheduler_shard_leader_info{instance="host-b",shard="1"}': 1,
        'scheduler_shard_leader_info{instance="host-a",shard="2"}': 1,
    }
    # And how many shards each replica holds, a live one with none included
    assert _series(samples, "scheduler_shards_held") == {
        'scheduler_shards_held{instance="host-a"}': 2,
        'scheduler_shards_held{instance="host-b"}': 1,
        'scheduler_shards_held{instance="host-c"}': 0,
    }
    # And the beat's lease is present only when every shard is held; no per-shard leader_present series
    assert _series(samples, "scheduler_leader_present") == {'scheduler_leader_present{lease="beat"}': 0}
    assert samples['scheduler_instances{leader="true",role="beat"}'] == 2
    assert samples['scheduler_leader_changes_total{lease="beat:0"}'] == 1
    # When the last shard is taken, Then the leader is present
    hold("host-c", 3)
    assert scrape(client)['scheduler_leader_present{lease="beat"}'] == 1


def test_metrics__stranded_schedules_counted(client: Client, settings: Any) -> None:
    settings.SCHEDULER_SHARDS = 4
    created = _schedules(8)
    settings.SCHEDULER_SHARDS = 2
    assert scrape(client)["scheduler_schedules_stranded"] == sum(1 for s in created if s.shard >= 2)
    schedules.assign_shards()
    assert scrape(client)["scheduler_schedules_stranded"] == 0


def test_metrics__unsharded__leftover_shard_leases_are_no_leader_series(client: Client) -> None:
    # Given the count back at 1, shard leases left from before, and the beat's lease held
    hold("host-a", 0, 1)
    Lease.objects.filter(name="beat:1").update(expires_at=dbclock.now() - timedelta(seconds=1))
    assert leases.acquire("beat", "host-a", ttl=10) is not None
    samples = scrape(client)
    # Then only the beat's lease reports presence (a leftover shard would alert for ever), and no shard series
    assert _series(samples, "scheduler_leader_present") == {'scheduler_leader_present{lease="beat"}': 1}
    assert samples["scheduler_shards"] == 1 and not _series(samples, "scheduler_shard_held")
