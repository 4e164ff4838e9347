"""Pause rules: what they match (in SQL and in Python alike), drain, the CLI, the API, the admin; always within a tenant."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import redis
from django.core.cache import cache
from django.test import Client

import tests.support.tasks  # noqa: F401 -- registers tests.record with the Celery app
from project.celery import app
from scheduler import dbclock
from scheduler.beat import dispatch
from scheduler.models import AuditEvent, Execution, PauseRule, Schedule
from scheduler.ops import audit, operations
from scheduler.owners import executions, leases, work_rules
from scheduler.tenancy import EVERY_TENANT, Scope
from tests.integration import command_support
from tests.integration.api_support import (
    TENANT_A,
    TENANT_B,
    TENANT_TASK,
    make_schedule,
    operator_session,
    tables,
    token_client,
)
from tests.integration.command_support import run
from tests.support.factories import make_execution

pytestmark = pytest.mark.django_db

Status = Execution.Status
refused = partial(command_support.refused)


@pytest.fixture(autouse=True)
def _fresh() -> None:
    cache.clear()
    work_rules.forget()


def _pause(scope: Scope = EVERY_TENANT, **what: Any) -> PauseRule:
    return operations.pause_work(actor=audit.CLI, scope=scope, **what).rule


WORK = [
    {"task": "billing.invoice", "queue": "reports", "tenant": "acme"},
    {"task": "billing.refund", "queue": "default", "tenant": "acme"},
    {"task": "mail.send", "queue": "reports", "tenant": "other"},
    {"task": "mail.send", "queue": "default", "tenant": ""},
]


@pytest.mark.parametrize(
    ("what", "held"),
    [
        ({"queue": "reports"}, [0, 2]),
        ({"task": "billing.*"}, [0, 1]),
        ({"task": "mail.sen?"}, [2, 3]),
        ({"tenant": "acme"}, [0, 1]),
        ({"tenant": "acme", "queue": "default"}, [1]),
        ({"everything": True}, [0, 1, 2, 3]),
        ({"everything": True, "tenant": "other"}, [2]),
    ],
)
def test_a_rule_matches_the_same_work_in_sql_and_in_python(what: dict[str, Any], held: list[int]) -> None:
    # Given executions of several tasks, queues and tenants, and one rule
    rows = [make_execution(f"work-{n}", status=Status.QUEUED, **work) for n, work in enumerate(WORK)]
    rule = work_rules.Rule.of(_pause(**what))
    # Then the SQL filter and the Python match agree, and hold exactly the expected work
    in_python = [n for n, work in enumerate(WORK) if rule.matches(**work)]
    in_sql = sorted(rows.index(row) for row in Execution.objects.filter(rule.condition()))
    assert in_python == in_sql == held


def test_everything_or_anything_else_still_holds_everything() -> None:
    make_execution("one", status=Status.QUEUED, queue="q")
    _pause(queue="other")
    _pause(everything=True)
    condition = work_rules.held(work_rules.pauses_in_force(max_age=0))
    assert condition is not None and Execution.objects.filter(condition).count() == 1


def test_the_beat_dispatches_no_slot_of_a_held_schedule(redis_url: str) -> None:
    # Given two due schedules (a whole minute is a slot of both), one on a held queue
    due = dbclock.now().replace(second=0, microsecond=0)
    held = make_schedule("held", interval=60, queue="reports")
    free = make_schedule("free", interval=60, queue="default")
    Schedule.objects.update(next_run_at=due)
    _pause(queue="reports")
    # When the leader's pass runs
    handle = leases.acquire("beat", "host-1:1", ttl=60)
    assert handle is not None
    dispatch.dispatch_due(handle)
    # Then only the free one fired; the held one waits on its slot
    assert list(Execution.objects.values_list("schedule__name", flat=True)) == ["free"]
    held.refresh_from_db()
    free.refresh_from_db()
    assert held.next_run_at == due and free.next_run_at > due


def test_drain_cancels_the_waiting_work_it_matches_and_leaves_running_work_alone() -> None:
    waiting = make_execution("waiting", status=Status.QUEUED, queue="reports")
    pending = make_execution("pending", status=Status.PENDING, queue="reports")
    running = make_execution("running", status=Status.RUNNING, queue="reports")
    elsewhere = make_execution("elsewhere", status=Status.QUEUED, queue="default")
    result = operations.pause_work(actor=audit.CLI, scope=EVERY_TENANT, queue="reports", mode="drain", reason="bad")
    assert result.cancelled == 2
    statuses = {e.idempotency_key: (e.status, e.error) for e in Execution.objects.all()}
    assert statuses[waiting.idempotency_key] == (Status.CANCELLED, "Drained: bad")
    assert statuses[pending.idempotency_key] == (Status.CANCELLED, "Drained: bad")
    assert statuses[running.idempotency_key][0] == Status.RUNNING
    assert statuses[elsewhere.idempotency_key][0] == Status.QUEUED


@pytest.mark.django_db(transaction=True)
def test_resume_sends_again_what_the_rule_held_but_not_what_another_rule_still_holds(
    redis_client: redis.Redis,
) -> None:
    make_execution("a", status=Status.QUEUED, queue="reports", celery_task_id="a", task=TENANT_TASK)
    make_execution("b", status=Status.QUEUED, queue="reports", celery_task_id="b", task="mail.send", tenant="acme")
    rule = _pause(queue="reports")
    _pause(tenant="acme")
    assert operations.resume_work(rule, actor=audit.CLI, app=app) == 1
    assert redis_client.llen("reports") == 1
    assert not PauseRule.objects.filter(pk=rule.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_resume_sends_again_only_what_was_waiting_before_the_lift(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given one execution the rule held
    queued = {"status": Status.QUEUED, "queue": "reports", "task": TENANT_TASK}
    make_execution("held", celery_task_id="held", enqueued_at=dbclock.now(), **queued)
    rule = _pause(queue="reports")
    # and a leader that, woken by the lift, sends the work's next slot before the resume reads what waits
    read_held = executions.held_rows

    def the_leader_sends_first(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        make_execution("next-slot", celery_task_id="next", enqueued_at=dbclock.now(), **queued)
        return read_held(*args, **kwargs)

    monkeypatch.setattr(executions, "held_rows", the_leader_sends_first)

    # When the rule is lifted
    sent = operations.resume_work(rule, actor=audit.CLI, app=app)

    # Then only the held one is sent again: the leader's was sent already
    assert sent == 1
    assert redis_client.llen("reports") == 1


def test_a_tenants_caller_pauses_its_own_tenants_work_only() -> None:
    mine = Scope(tenant=TENANT_A)
    assert _pause(mine, queue="reports").tenant == TENANT_A
    assert _pause(mine, everything=True).describe() == f"hold tenant {TENANT_A}"
    with pytest.raises(operations.ActionRefused, match="your own tenant's work only"):
        _pause(mine, tenant=TENANT_B)
    with pytest.raises(operations.ActionRefused, match="bound to no tenant"):
        _pause(Scope(), queue="reports")


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ({}, "Say what to pause"),
        ({"everything": True, "queue": "q"}, "Pause everything, or a queue or tasks: not both."),
        ({"queue": "q", "mode": "explode"}, "Mode 'explode' is not one of hold, drain."),
        ({"task": "*a*a*a*a*a*b"}, "Task pattern refused: a pattern may hold at most 4 \\*, not 6."),
    ],
)
def test_a_pause_that_says_nothing_clear_is_refused(what: dict[str, Any], message: str) -> None:
    with pytest.raises(operations.ActionRefused, match=message):
        _pause(**what)
    assert not PauseRule.objects.exists()


def test_a_tenant_cannot_pile_up_pauses() -> None:
    mine = Scope(tenant=TENANT_A)
    for n in range(operations.MAX_PAUSE_RULES):
        _pause(mine, queue=f"q{n}")
    with pytest.raises(operations.ActionRefused, match="At most 50 pauses in force"):
        _pause(mine, queue="one-more")
    assert _pause(Scope(tenant=TENANT_B), queue="q0").tenant == TENANT_B  # another tenant's count is its own


# --- CLI ------------------------------------------------------------------------------


def test_cli__pause_lists_resume_and_every_step_is_audited() -> None:
    assert run("pause") == "Nothing is paused.\n"
    assert run("pause", "--queue", "reports", "--reason", "vendor outage").startswith(
        "Paused: hold queue reports of every tenant (rule "
    )
    assert "hold queue reports of every tenant  vendor outage" in run("pause")
    assert "Pause everything, or a queue or tasks: not both." in refused("pause", "--all", "--queue", "q")
    assert "That work is paused so already." in refused("pause", "--queue", "reports")
    assert "No pause rule matches" in refused("resume", "--queue", "other")
    assert run("resume", "--queue", "reports").splitlines() == [
        f"Resumed: hold queue reports of every tenant (rule {AuditEvent.objects.get(action='pause_work').object_id}).",
        "0 held execution(s) sent again.",
    ]
    assert list(AuditEvent.objects.order_by("id").values_list("action", "actor_type")) == [
        ("pause_work", "cli"),
        ("resume_work", "cli"),
    ]


# --- API ------------------------------------------------------------------------------


def _post(client: Client, body: dict[str, Any]) -> Any:
    return client.post("/api/v1/pauses/", body, content_type="application/json")


def test_api__a_tenant_pauses_and_lifts_its_own_work_only(redis_url: str) -> None:
    deployer = token_client("root", role="operator")
    everyone = _post(deployer, {"everything": True, "reason": "migration"}).json()["rule"]
    operator_a = token_client("ops-a", role="operator", tenant=TENANT_A)
    created = _post(operator_a, {"queue": "reports", "tenant": TENANT_B})
    assert created.status_code == 400 and "your own tenant's work only" in created.json()["detail"]
    mine = _post(operator_a, {"queue": "reports"})
    assert mine.status_code == 201, mine.content
    assert mine.json()["rule"]["tenant"] == TENANT_A
    # Tenant B sees neither A's pause nor the every-tenant one (a row of no tenant), and lifts neither
    operator_b = token_client("ops-b", role="operator", tenant=TENANT_B)
    assert operator_b.get("/api/v1/pauses/").json() == []
    assert operator_b.delete(f"/api/v1/pauses/{mine.json()['rule']['id']}/").status_code == 404
    assert operator_a.delete(f"/api/v1/pauses/{everyone['id']}/").status_code == 404
    # The deployer sees both; a viewer cannot pause at all
    assert [rule["tenant"] for rule in deployer.get("/api/v1/pauses/").json()] == ["", TENANT_A]
    viewer = token_client("viewer", role="viewer", tenant=TENANT_A)
    assert _post(viewer, {"queue": "x"}).status_code == 403
    # A's own pause is A's to lift
    lifted = operator_a.delete(f"/api/v1/pauses/{mine.json()['rule']['id']}/")
    assert lifted.status_code == 200 and lifted.json() == {
        "resumed": f"hold queue reports of tenant {TENANT_A}",
        "sent": 0,
    }
    assert list(PauseRule.objects.values_list("every_tenant", flat=True)) == [True]


def test_api__bad_bodies_are_400s_that_change_nothing() -> None:
    operator = token_client("root", role="operator")
    before = tables()
    for body in ({}, {"mode": "explode", "queue": "q"}, {"queue": "q", "reason": "r" * 2000}, {"everything": "maybe"}):
        assert _post(operator, body).status_code == 400, body
    assert tables() == before and not PauseRule.objects.exists()


# --- admin ----------------------------------------------------------------------------


def test_admin__adding_a_pause_pauses_the_banner_shows_it_and_deleting_it_resumes(redis_url: str) -> None:
    admin = operator_session(TENANT_A)
    added = admin.post(
        "/admin/scheduler/pauserule/add/",
        {"queue": "reports", "task": "", "tenant": "", "mode": "hold", "reason": "vendor outage"},
        follow=True,
    )
    assert added.status_code == 200
    rule = PauseRule.objects.get()
    assert (rule.tenant, rule.every_tenant, rule.queue, rule.created_by) == (
        TENANT_A,
        False,
        "reports",
        f"op-{TENANT_A}",
    )
    # The banner shows it on the scheduler's pages, to its tenant only
    page = admin.get("/admin/scheduler/schedule/").content.decode()
    assert f"Paused: hold queue reports of tenant {TENANT_A} (vendor outage)" in page
    assert "Paused:" not in operator_session(TENANT_B).get("/admin/scheduler/schedule/").content.decode()
    # A refused pause is a form error
    again = admin.post(
        "/admin/scheduler/pauserule/add/",
        {"queue": "reports", "task": "", "tenant": "", "mode": "hold", "reason": ""},
    )
    assert "That work is paused so already." in again.content.decode()
    # Deleting it resumes, audited
    admin.post(f"/admin/scheduler/pauserule/{rule.pk}/delete/", {"post": "yes"})
    assert not PauseRule.objects.exists()
    assert list(AuditEvent.objects.filter(object_type="scheduler.pauserule").values_list("action", flat=True)) == [
        "resume_work",
        "pause_work",
    ]


def test_metrics__count_the_pauses_by_mode() -> None:
    _pause(queue="a")
    _pause(queue="b", mode="drain")
    _pause(queue="c", mode="drain")
    text = Client().get("/metrics").content.decode()
    assert 'scheduler_pauses{mode="hold"} 1.0' in text
    assert 'scheduler_pauses{mode="drain"} 2.0' in text
