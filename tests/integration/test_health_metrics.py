"""/healthz, /readyz, /leaderz and /metrics against the real database and Redis."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import IO

import pytest
from django.db.models.functions import Now
from django.test import Client

from scheduler import dbclock
from scheduler.conf import settings as scheduler_settings
from scheduler.models import Execution, Instance, Lease, Schedule
from scheduler.owners import leases, schedules
from tests.support import processes
from tests.support.services import free_port

pytestmark = pytest.mark.django_db


@pytest.fixture
def leader() -> Iterator[leases.LeaseHandle]:
    handle = leases.acquire(scheduler_settings.LEASE_NAME, "host-1-abc", ttl=10)
    assert handle is not None
    yield handle


def test_healthz__alive(client: Client) -> None:
    response = client.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "alive"})


def test_readyz__ready_with_database_and_broker_even_without_a_leader(client: Client, redis_url: str) -> None:
    # Given no beat holds the lease (a beat outage)
    # When the web's readiness probe asks
    response = client.get("/readyz")
    # Then the web stays ready: leadership is not its business
    body = response.json()
    assert response.status_code == 200, body
    assert body["status"] == "ready" and body["failed"] == []
    assert set(body["checks"]) == {"database", "broker"}


def test_leaderz__fresh_leader_is_200(client: Client, leader: leases.LeaseHandle) -> None:
    response = client.get("/leaderz")
    body = response.json()
    assert response.status_code == 200, body
    assert body["status"] == "leading" and body["failed"] == []
    assert "host-1-abc renewed" in body["checks"]["leader"]["detail"]


def test_leaderz__no_leader_is_503_naming_the_leader_check(client: Client) -> None:
    response = client.get("/leaderz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "no leader" and body["failed"] == ["leader"]
    assert "no beat replica holds the lease" in body["checks"]["leader"]["detail"]


def test_leaderz__leader_not_renewed_within_twice_the_renew_interval_is_503(
    client: Client, leader: leases.LeaseHandle
) -> None:
    # Given a lease still valid but not renewed for longer than 2x the renew interval
    Lease.objects.filter(name=leader.name).update(
        renewed_at=dbclock.now() - timedelta(seconds=2 * scheduler_settings.LEASE_RENEW_SECONDS + 1)
    )
    response = client.get("/leaderz")
    body = response.json()
    assert response.status_code == 503
    assert body["failed"] == ["leader"] and "last renewed" in body["checks"]["leader"]["detail"]


def test_leaderz__released_lease_is_503(client: Client, leader: leases.LeaseHandle) -> None:
    # Given the leader stopped cleanly and released the lease
    assert leases.release(leader)
    assert client.get("/leaderz").status_code == 503


def _serve(
    env_overrides: dict[str, str], stderr: IO[bytes] | int = subprocess.DEVNULL
) -> tuple[subprocess.Popen[bytes], int]:
    """Serve the project's WSGI app in a child process with a changed environment."""
    port = free_port()
    env = {**os.environ, "DJANGO_DEBUG": "1", "DATABASE_URL": processes.test_database_url(), **env_overrides}
    code = (
        "import sys; from wsgiref.simple_server import make_server; from project.wsgi import application; "
        f"make_server('127.0.0.1', {port}, application).serve_forever()"
    )
    server = subprocess.Popen([sys.executable, "-c", code], cwd=processes.ROOT, env=env, stderr=stderr)
    return server, port


def _get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (urllib.error.URLError, ConnectionError):
        return 0, {}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("broken", "path", "failed"),
    [
        ("database", "/readyz", ["database"]),
        ("broker", "/readyz", ["broker"]),
        ("database", "/leaderz", ["database", "leader"]),
    ],
)
def test_probes__unreachable_service_is_503_naming_it(
    redis_url: str, broken: str, path: str, failed: list[str]
) -> None:
    # Given a web process whose database (or broker) does not answer, and a live leader
    assert leases.acquire(scheduler_settings.LEASE_NAME, "host-1-abc", ttl=30) is not None
    dead = f"127.0.0.1:{free_port()}"
    overrides = {"REDIS_URL": redis_url}
    if broken == "database":
        overrides["DATABASE_URL"] = f"postgres://nobody@{dead}/nothing"
    else:
        overrides["REDIS_URL"] = f"redis://{dead}/0"
    server, port = _serve(overrides)
    try:
        found = processes.wait_until(lambda: _get(port, path)[0], timeout=20)
        assert found, "the web process never answered"
        status, body = _get(port, path)
        alive, _ = _get(port, "/healthz")
    finally:
        server.terminate()
        server.wait(10)
    # Then the probe fails, says which check failed, and the process is still alive
    assert status == 503, body
    assert body["failed"] == failed
    assert "unreachable" in body["checks"][broken]["detail"]
    assert alive == 200


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("broken", ["database", "broker"])
def test_readyz__names_the_failed_component_never_the_driver_message(
    redis_url: str, tmp_path: Path, broken: str
) -> None:
    # Given a web process whose database (or broker) refuses connections on a closed port
    dead_port = free_port()
    overrides = {"REDIS_URL": redis_url, "SCHEDULER_LOG_FORMAT": "plain"}
    if broken == "database":
        overrides["DATABASE_URL"] = f"postgres://nobody@127.0.0.1:{dead_port}/nothing"
    else:
        overrides["REDIS_URL"] = f"redis://127.0.0.1:{dead_port}/0"
    log = tmp_path / "web.log"
    with log.open("wb") as stderr:
        server, port = _serve(overrides, stderr=stderr)
        try:
            assert processes.wait_until(lambda: _get(port, "/readyz")[0], timeout=20), "the web process never answered"
            status, body = _get(port, "/readyz")
        finally:
            server.terminate()
            server.wait(10)
    # Then the body names the component that failed, and nothing the driver said
    assert status == 503, body
    assert body["failed"] == [broken]
    assert body["checks"][broken] == {"ok": False, "detail": f"{broken} unreachable"}
    text = json.dumps(body)
    for driver_says in (str(dead_port), "127.0.0.1", "refused", "nobody", "Error", "connect"):
        assert driver_says not in text, text
    # And the driver's message is in the server's log, for the operator
    logged = log.read_text()
    assert f"{broken} unreachable" in logged and str(dead_port) in logged, logged


def _metrics(client: Client) -> str:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    return response.content.decode()


def _value(text: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    assert match, f"{sample} not in:\n{text}"
    return float(match[1])


def test_metrics__names_present_and_values_follow_executions(client: Client, leader: leases.LeaseHandle) -> None:
    before = _metrics(client)
    for name in (
        "scheduler_executions_total",
        "scheduler_dispatch_lag_seconds",
        "scheduler_leader_changes_total",
        "scheduler_lease_renew_failures_total",
        "scheduler_due_backlog",
        "scheduler_instances",
    ):
        assert f"# TYPE {name} " in before
    assert _value(before, 'scheduler_leader_changes_total{lease="beat"}') == leader.token
    assert 'scheduler_executions_total{status="succeeded",task="scheduler.echo",trigger="scheduled"}' not in before

    # When executions are recorded, sent and finished, a schedule is due and a worker beats
    now = dbclock.now()
    for n, lag in enumerate((0.02, 0.3, 4.0)):
        Execution.objects.create(
            idempotency_key=f"m{n}",
            task="scheduler.echo",
            status=Execution.Status.SUCCEEDED,
            scheduled_for=now - timedelta(seconds=10),
            enqueued_at=now - timedelta(seconds=10 - lag),
        )
    schedules.create(name="due", task="scheduler.echo", interval=60)
    Schedule.objects.filter(name="due").update(next_run_at=now - timedelta(seconds=1))
    Instance.objects.create(instance_id="w-1", role="worker", hostname="h", pid=1, started_at=Now(), last_seen=Now())
    leases.record_renew_failure(leader.name)
    after = _metrics(client)

    # Then the values changed accordingly
    assert (
        _value(after, 'scheduler_executions_total{status="succeeded",task="scheduler.echo",trigger="scheduled"}') == 3
    )
    assert _value(after, 'scheduler_dispatch_lag_seconds_bucket{le="0.05"}') == 1
    assert _value(after, 'scheduler_dispatch_lag_seconds_bucket{le="0.5"}') == 2
    assert _value(after, 'scheduler_dispatch_lag_seconds_bucket{le="+Inf"}') == 3
    assert _value(after, "scheduler_due_backlog") == 1
    assert _value(after, 'scheduler_instances{leader="false",role="worker"}') == 1
    assert _value(after, 'scheduler_lease_renew_failures_total{lease="beat"}') == 1


def test_metrics__after_crashes_only_the_lease_holder_leads_and_silent_instances_are_stale(client: Client) -> None:
    # Given three beats that each wrote is_leader=True; two were killed long ago, the third holds the lease
    now = dbclock.now()
    for instance_id, age in (("host-1-dead", 416), ("host-2-dead", 325), ("host-3-live", 1.7)):
        seen = now - timedelta(seconds=age)
        Instance.objects.create(
            instance_id=instance_id, role="beat", hostname="h", pid=1, started_at=seen, last_seen=seen, is_leader=True
        )
    assert leases.acquire(scheduler_settings.LEASE_NAME, "host-3-live", ttl=10) is not None
    # When scraped
    text = _metrics(client)
    # Then one live leader, the dead ones are stale (not counted as alive) with their heartbeat age
    assert _value(text, 'scheduler_instances{leader="true",role="beat"}') == 1
    assert _value(text, 'scheduler_instances{leader="false",role="beat"}') == 0
    age = "scheduler_instance_heartbeat_age_seconds"
    assert _value(text, f'{age}{{instance="host-1-dead",role="beat",stale="true"}}') >= 416
    assert _value(text, f'{age}{{instance="host-2-dead",role="beat",stale="true"}}') >= 325
    assert _value(text, f'{age}{{instance="host-3-live",role="beat",stale="false"}}') < 10

    # When the lease expires too (no beat left), Then nobody leads
    Lease.objects.filter(name=scheduler_settings.LEASE_NAME).update(expires_at=dbclock.now() - timedelta(seconds=1))
    text = _metrics(client)
    assert _value(text, 'scheduler_instances{leader="true",role="beat"}') == 0
    assert _value(text, 'scheduler_instances{leader="false",role="beat"}') == 1
