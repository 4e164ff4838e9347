"""A hostile operator of tenant acme, through the API and the admin, against globex and the platform.

Callers: an operator token bound to acme, and a staff user in the operator
group bound to acme. Every attempt names a reserved task (Celery's built-ins,
the platform's own) or another tenant's rows; each must be refused with a
field error that names the rule, and change no row of any table.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.core.cache import cache
from django.test import Client
from django_celery_results.models import TaskResult

from scheduler import dbclock
from scheduler.models import ApiToken, Execution, OperatorProfile, Schedule
from scheduler.owners import schedules
from scheduler.web.permissions import OPERATOR_GROUP, VIEWER_GROUP
from tests.integration.api_support import TENANT_TASK, bind, make_execution, tables, token_client
from tests.support.admin_forms import schedule_form
from tests.support.factories import make_schedule

pytestmark = pytest.mark.django_db

ACME, GLOBEX = "acme", "globex"
#: Celery's built-ins (``celery.group`` carries whole task messages) and the platform's own.
RESERVED = ("scheduler.prune_executions", "scheduler.echo", "celery.group", "celery.chord", "celery.backend_cleanup")
Status = Execution.Status


@pytest.fixture(autouse=True)
def _fresh_throttle() -> None:
    cache.clear()


def _schedule(name: str, tenant: str, task: str = TENANT_TASK) -> Schedule:
    return make_schedule(name, task=task, tenant=tenant)


@pytest.fixture
def world() -> dict[str, Any]:
    """acme's and globex's rows; a reserved-task schedule the deployer put in acme; a result of each tenant."""
    acme, globex = _schedule("nightly", ACME), _schedule("nightly", GLOBEX)
    housekeeping = _schedule("housekeeping", ACME, task="scheduler.prune_executions")
    housekeeping_off = _schedule("housekeeping-off", ACME, task="scheduler.prune_executions")
    housekeeping_off.enabled = False
    schedules.save(housekeeping_off, now=dbclock.now())
    housekeeping_paused = _schedule("housekeeping-paused", ACME, task="scheduler.prune_executions")
    schedules.pause(housekeeping_paused, "by the deployer", now=dbclock.now())
    rows = {
        "acme": acme,
        "globex": globex,
        "housekeeping": housekeeping,
        "housekeeping_off": housekeeping_off,
        "housekeeping_paused": housekeeping_paused,
        "acme_done": make_execution(acme, "acme-done", Status.SUCCEEDED),
        "globex_done": make_execution(globex, "globex-done", Status.SUCCEEDED),
        "globex_waiting": make_execution(globex, "globex-waiting", Status.QUEUED),
        "housekeeping_done": make_execution(housekeeping, "housekeeping-done", Status.FAILED),
    }
    for key in ("acme_done", "globex_done"):
        execution = rows[key]
        execution.celery_task_id = f"{key}-task-id"
        execution.save(update_fields=["celery_task_id"])
        TaskResult.objects.create(
            task_id=execution.celery_task_id,
            task_name=TENANT_TASK,
            status="SUCCESS",
            task_args=f'["{key} secret argument"]',
            result=f'"{key} secret result"',
        )
    return rows


def _staff(username: str, *, tenant: str | None, group: str = OPERATOR_GROUP) -> Client:
    """A logged-in staff user in ``group``: bound to ``tenant``, to all tenants (``""``), or to nothing (None)."""
    user = get_user_model().objects.create_user(username, password="pw", is_staff=True)
    user.groups.add(Group.objects.get(name=group))
    if tenant is not None:
        bind(user, tenant)
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def acme_token() -> Client:
    return token_client("acme-operator", role=ApiToken.Role.OPERATOR, tenant=ACME)


@pytest.fixture
def acme_staff() -> Client:
    return _staff("acme-operator", tenant=ACME)


def _refused_on_task(response: Any) -> str:
    assert response.status_code == 400, (response.status_code, response.content)
    message = " ".join(response.json()["task"])
    assert "reserved" in message and "celery.*" in message and "scheduler.*" in message, message
    return message


# --- the API -------------------------------------------------------------------------


@pytest.mark.parametrize("task", RESERVED)
def test_api__a_tenant_operator_cannot_create_a_schedule_of_a_reserved_task(
    world: dict[str, Any], acme_token: Client, task: str
) -> None:
    before = tables()
    response = acme_token.post(
        "/api/v1/schedules/", {"name": "wipe", "task": task, "interval": 60}, content_type="application/json"
    )
    _refused_on_task(response)
    assert tables() == before


@pytest.mark.parametrize("task", RESERVED)
def test_api__a_tenant_operator_cannot_change_a_schedule_to_a_reserved_task(
    world: dict[str, Any], acme_token: Client, task: str
) -> None:
    before = tables()
    response = acme_token.patch(
        f"/api/v1/schedules/{world['acme'].pk}/",
        {"task": task, "kwargs": {"older_than_days": 1, "keep_last": 0}},
        content_type="application/json",
    )
    _refused_on_task(response)
    assert tables() == before


@pytest.mark.parametrize(
    ("label", "method", "path", "body"),
    [
        ("run now", "post", "/api/v1/schedules/{housekeeping}/run-now/", None),
        ("enable", "post", "/api/v1/schedules/{housekeeping_off}/enable/", None),
        ("resume", "post", "/api/v1/schedules/{housekeeping_paused}/resume/", None),
        ("backfill", "post", "/api/v1/schedules/{housekeeping}/backfill/", "BACKFILL"),
        ("edit", "patch", "/api/v1/schedules/{housekeeping}/", {"kwargs": {"older_than_days": 1, "keep_last": 0}}),
        ("retry", "post", "/api/v1/executions/{housekeeping_done}/retry/", None),
    ],
)
def test_api__a_tenant_operator_cannot_run_a_reserved_task_its_tenant_holds(
    world: dict[str, Any], acme_token: Client, label: str, method: str, path: str, body: Any
) -> None:
    # Given: the deployer put a housekeeping schedule in acme (trusted), with a finished execution
    now = dbclock.now()
    if body == "BACKFILL":
        body = {"start": (now - timedelta(minutes=10)).isoformat(), "end": now.isoformat(), "dry_run": False}
    before = tables()
    url = path.format(**{key: row.pk for key, row in world.items()})
    # When: acme's operator runs it, edits it, backfills it or retries it
    response = getattr(acme_token, method)(url, body, content_type="application/json")
    # Then: refused on the task, and nothing changed
    _refused_on_task(response)
    assert tables() == before


def test_api__a_superuser_and_an_all_tenants_operator_may_schedule_reserved_tasks(world: dict[str, Any]) -> None:
    unscoped = token_client("platform", role=ApiToken.Role.OPERATOR)
    response = unscoped.post(
        "/api/v1/schedules/",
        {"name": "cleanup", "task": "celery.backend_cleanup", "cron": "0 4 * * *"},
        content_type="application/json",
    )
    assert response.status_code == 201, response.content
    run = unscoped.post(f"/api/v1/schedules/{world['housekeeping'].pk}/run-now/", content_type="application/json")
    assert run.status_code == 201, run.content


def test_api__tenant_tasks_setting_narrows_what_a_tenant_may_run(
    world: dict[str, Any], acme_token: Client, settings: Any
) -> None:
    settings.SCHEDULER_TENANT_TASKS = {ACME: ["reports.*"], "*": [TENANT_TASK]}
    before = tables()
    response = acme_token.post(
        "/api/v1/schedules/", {"name": "mine", "task": TENANT_TASK, "interval": 60}, content_type="application/json"
    )
    assert response.status_code == 400
    assert "SCHEDULER_TENANT_TASKS allows only these tasks: reports.*" in response.json()["task"][0]
    assert tables() == before
    # And a tenant not listed gets the default
    globex = token_client("globex-operator", role=ApiToken.Role.OPERATOR, tenant=GLOBEX)
    created = globex.post(
        "/api/v1/schedules/", {"name": "theirs", "task": TENANT_TASK, "interval": 60}, content_type="application/json"
    )
    assert created.status_code == 201, created.content


def test_api__names_are_unique_per_tenant_and_say_nothing_of_another_tenant(
    world: dict[str, Any], acme_token: Client
) -> None:
    # Given: globex has "nightly", and acme has one of its own by the same name
    assert Schedule.objects.filter(name="nightly").count() == 2
    # When: acme takes a name only globex uses
    _schedule("globex-only", GLOBEX)
    created = acme_token.post(
        "/api/v1/schedules/",
        {"name": "globex-only", "task": TENANT_TASK, "interval": 60},
        content_type="application/json",
    )
    # Then: it may
    assert created.status_code == 201, created.content
    # And a name acme uses twice is refused by acme's own name only
    twice = acme_token.post(
        "/api/v1/schedules/", {"name": "nightly", "task": TENANT_TASK, "interval": 60}, content_type="application/json"
    )
    assert twice.status_code == 400 and twice.json() == {"name": ["Schedule with this Name already exists."]}


# --- the admin -----------------------------------------------------------------------


@pytest.mark.parametrize("task", RESERVED)
def test_admin__add_form_refuses_a_reserved_task(world: dict[str, Any], acme_staff: Client, task: str) -> None:
    before = tables()
    response = acme_staff.post("/admin/scheduler/schedule/add/", schedule_form(name="wipe", task=task))
    assert response.status_code == 200
    assert "is reserved" in response.content.decode()
    assert tables() == before


@pytest.mark.parametrize("task", RESERVED)
def test_admin__change_form_refuses_a_reserved_task(world: dict[str, Any], acme_staff: Client, task: str) -> None:
    before = tables()
    response = acme_staff.post(
        f"/admin/scheduler/schedule/{world['acme'].pk}/change/", schedule_form(name="nightly", task=task)
    )
    assert response.status_code == 200
    assert "is reserved" in response.content.decode()
    assert tables() == before


def test_admin__add_form_saves_a_tenant_task_in_the_users_tenant(world: dict[str, Any], acme_staff: Client) -> None:
    response = acme_staff.post(
        "/admin/scheduler/schedule/add/", schedule_form(name="globex-sounding", task=TENANT_TASK, tenant=GLOBEX)
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Schedule.objects.get(name="globex-sounding").tenant == ACME


def test_admin__suggestions_hide_reserved_tasks_from_a_tenant(acme_staff: Client) -> None:
    page = acme_staff.get("/admin/scheduler/schedule/add/").content.decode()
    assert TENANT_TASK in page
    assert "scheduler.prune_executions" not in page and "celery.backend_cleanup" not in page


@pytest.mark.parametrize(
    ("path", "data"),
    [
        ("/admin/scheduler/schedule/{housekeeping}/act/run_now/", {}),
        ("/admin/scheduler/schedule/{housekeeping_off}/act/enable/", {}),
        ("/admin/scheduler/schedule/", {"action": "enable", "_selected_action": "{housekeeping_off}"}),
        ("/admin/scheduler/schedule/{housekeeping_paused}/act/resume/", {}),
        ("/admin/scheduler/schedule/", {"action": "resume", "_selected_action": "{housekeeping_paused}"}),
        ("/admin/scheduler/schedule/", {"action": "run_now", "_selected_action": "{housekeeping}"}),
        ("/admin/scheduler/execution/{housekeeping_done}/act/retry/", {}),
        ("/admin/scheduler/execution/", {"action": "retry", "_selected_action": "{housekeeping_done}"}),
        ("/admin/scheduler/schedule/{housekeeping}/backfill/", {"start": "START", "end": "END", "confirm": "1"}),
    ],
)
def test_admin__actions_refuse_a_reserved_task(
    world: dict[str, Any], acme_staff: Client, path: str, data: dict[str, str]
) -> None:
    now = dbclock.now()
    ids = {key: row.pk for key, row in world.items()}
    stamps = {
        "START": (now - timedelta(minutes=10)).strftime("%Y-%m-%d %H:%M:%S"),
        "END": now.strftime("%Y-%m-%d %H:%M:%S"),
    }
    data = {key: stamps.get(value, value.format(**ids)) for key, value in data.items()}
    before = tables()
    response = acme_staff.post(path.format(**ids), data, follow=True)
    assert response.status_code == 200
    assert "is reserved" in response.content.decode()
    assert tables() == before


# --- results -------------------------------------------------------------------------


def test_results__a_tenant_sees_only_its_own_task_results(world: dict[str, Any]) -> None:
    viewer = _staff("acme-viewer", tenant=ACME, group=VIEWER_GROUP)
    listing = viewer.get("/admin/django_celery_results/taskresult/").content.decode()
    assert "acme_done-task-id" in listing and "globex_done-task-id" not in listing
    theirs = TaskResult.objects.get(task_id="globex_done-task-id")
    page = viewer.get(f"/admin/django_celery_results/taskresult/{theirs.pk}/change/", follow=True)
    assert "globex_done secret" not in page.content.decode()
    mine = TaskResult.objects.get(task_id="acme_done-task-id")
    assert (
        "acme_done secret argument"
        in viewer.get(f"/admin/django_celery_results/taskresult/{mine.pk}/change/").content.decode()
    )
    # And group results are for every-tenant callers only
    assert viewer.get("/admin/django_celery_results/groupresult/").status_code == 403


def test_results__an_all_tenants_viewer_sees_every_result(world: dict[str, Any]) -> None:
    viewer = _staff("platform-viewer", tenant="", group=VIEWER_GROUP)
    listing = viewer.get("/admin/django_celery_results/taskresult/").content.decode()
    assert "acme_done-task-id" in listing and "globex_done-task-id" in listing


# --- binding fails closed ------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/admin/scheduler/schedule/",
        "/admin/scheduler/execution/",
        "/admin/scheduler/auditevent/",
        "/admin/django_celery_results/taskresult/",
    ],
)
def test_binding__a_staff_user_without_a_profile_sees_nothing_in_the_admin(world: dict[str, Any], path: str) -> None:
    unbound = _staff("unbound", tenant=None)
    page = unbound.get(path).content.decode()
    for secret in ("nightly", "housekeeping", "secret", "-task-id"):
        assert secret not in page, (path, secret)


def test_binding__a_staff_user_without_a_profile_sees_nothing_in_the_api_and_cannot_add(world: dict[str, Any]) -> None:
    unbound = _staff("unbound", tenant=None)
    for path in ("/api/v1/schedules/", "/api/v1/executions/", "/api/v1/audit-events/"):
        assert unbound.get(path).json()["results"] == [], path
    assert unbound.get(f"/api/v1/schedules/{world['acme'].pk}/").status_code == 404
    assert unbound.get("/admin/scheduler/schedule/add/").status_code == 403


def test_binding__a_token_bound_to_nothing_sees_nothing(world: dict[str, Any]) -> None:
    _, raw = ApiToken.issue("nobody", role=ApiToken.Role.OPERATOR)
    client = Client(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert client.get("/api/v1/schedules/").json()["results"] == []
    assert client.get(f"/api/v1/schedules/{world['acme'].pk}/").status_code == 404
    before = tables()
    created = client.post(
        "/api/v1/schedules/", {"name": "x", "task": TENANT_TASK, "interval": 60}, content_type="application/json"
    )
    assert created.status_code == 400 and "bound to no tenant" in created.json()["tenant"][0]
    assert tables() == before


def test_binding__being_staff_is_not_a_role(world: dict[str, Any]) -> None:
    user = bind(get_user_model().objects.create_user("staff-only", password="pw", is_staff=True))
    client = Client()
    client.force_login(user)
    assert client.get("/api/v1/schedules/").status_code == 403


def test_binding__only_superusers_change_operator_profiles(acme_staff: Client) -> None:
    user = get_user_model().objects.get(username="acme-operator")
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_operatorprofile", "change_operatorprofile"])
    )
    profile = OperatorProfile.objects.get(user=user)
    response = acme_staff.post(
        f"/admin/scheduler/operatorprofile/{profile.pk}/change/", {"user": user.pk, "tenant": "", "all_tenants": "on"}
    )
    assert response.status_code == 403
    profile.refresh_from_db()
    assert profile.tenant == ACME and not profile.all_tenants
