"""Every write through the API, the admin and the CLI, and every change to who may do what, leaves one AuditEvent.

Each event commits with its write: when the event cannot be written, the
write does not happen either (a trigger refuses the insert), and another
connection sees both at the same moment. Long writes (backfill, reconcile,
prune) commit a "started" event before the work and complete it after.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.core.cache import cache
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, connection, connections, transaction
from django.db.models import Max
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from scheduler import dbclock, tasks
from scheduler.models import ApiToken, AuditEvent, Execution, OperatorProfile, Schedule
from scheduler.ops import audit, prune
from scheduler.owners import executions
from scheduler.web.permissions import OPERATOR_GROUP, VIEWER_GROUP, ensure_groups
from tests.integration.api_support import make_execution, make_schedule, token_client
from tests.support.admin_forms import schedule_form

pytestmark = pytest.mark.django_db

Status = Execution.Status
User = get_user_model()
ADMIN = "/admin/scheduler"


@pytest.fixture(autouse=True)
def _fresh_throttle() -> None:
    cache.clear()


class Trail:
    """The audit events recorded since the last look."""

    def __init__(self) -> None:
        self.seen = 0
        self.skip()

    def skip(self) -> None:
        """Forget the events so far (those of a test's set-up)."""
        self.seen = AuditEvent.objects.aggregate(last=Max("id"))["last"] or 0

    def new(self) -> list[AuditEvent]:
        events = list(AuditEvent.objects.filter(pk__gt=self.seen).order_by("id"))
        if events:
            self.seen = events[-1].pk
        return events

    def one(self, action: str, object_type: str, actor_type: str = "") -> AuditEvent:
        """Assert that exactly one event was recorded since the last look, of ``action`` on ``object_type``."""
        events = self.new()
        assert [(e.action, e.object_type) for e in events] == [(action, object_type)], [str(e) for e in events]
        if actor_type:
            assert events[0].actor_type == actor_type, str(events[0])
        return events[0]

    def none(self) -> None:
        events = self.new()
        assert events == [], [str(e) for e in events]


def cli(*argv: str) -> str:
    out = io.StringIO()
    call_command(*argv, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def superuser_client(username: str = "root") -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser(username, f"{username}@example.invalid", "pw"))
    return client


def past_range() -> tuple[str, str]:
    """Five minutes ending a minute ago, in ISO-8601."""
    now = dbclock.now()
    return (now - timedelta(minutes=6)).isoformat(), (now - timedelta(minutes=1)).isoformat()


# --- every path, one event each --------------------------------------------------------


def test_every_api_write__leaves_exactly_one_event(redis_client: object) -> None:
    # Given: an operator token of every tenant, a failed and a queued execution
    api = token_client("ops", role="operator")
    viewer = token_client("eyes", role="viewer")
    old = make_schedule("old")
    failed = make_execution(old, "k-failed", Status.FAILED)
    queued = make_execution(old, "k-queued", Status.QUEUED)
    trail = Trail()

    def post(path: str, data: dict[str, Any] | None = None) -> Any:
        return api.post(f"/api/v1/{path}", data or {}, content_type="application/json")

    # When / Then: each write is one event by the token
    pk = post("schedules/", {"name": "api", "task": "scheduler.echo", "interval": 60}).json()["id"]
    trail.one("create", "scheduler.schedule", "token")
    assert (
        api.patch(f"/api/v1/schedules/{pk}/", {"description": "d"}, content_type="application/json").status_code == 200
    )
    trail.one("update", "scheduler.schedule")
    for action in ("pause", "resume", "disable", "enable"):
        assert post(f"schedules/{pk}/{action}/").status_code == 200, action
        trail.one(action, "scheduler.schedule")
    assert post(f"schedules/{pk}/run-now/").status_code == 201
    trail.one("run_now", "scheduler.schedule")
    start, end = past_range()
    assert post(f"schedules/{pk}/backfill/", {"start": start, "end": end}).status_code == 200  # a preview
    trail.none()
    assert post(f"schedules/{pk}/backfill/", {"start": start, "end": end, "dry_run": False}).status_code == 200
    event = trail.one("backfill", "scheduler.schedule")
    assert event.changes["state"] == "completed" and "created" in event.changes
    assert post(f"executions/{failed.pk}/retry/").status_code == 201
    trail.one("retry", "scheduler.execution")
    assert post(f"executions/{queued.pk}/cancel/").status_code == 200
    trail.one("cancel", "scheduler.execution")
    assert post("reconcile/").status_code == 200  # a dry run
    trail.none()
    assert post("reconcile/", {"dry_run": False, "repair": True}).status_code == 200
    event = trail.one("reconcile", "reconcile")
    assert event.changes["state"] == "completed" and event.changes["repair"] is True
    assert api.delete(f"/api/v1/schedules/{pk}/").status_code == 204
    trail.one("delete", "scheduler.schedule")
    # And a refused write records nothing
    assert viewer.post(f"/api/v1/schedules/{old.pk}/pause/").status_code == 403
    trail.none()


def test_every_admin_write__leaves_exactly_one_event(redis_client: object) -> None:
    # Given: a superuser in the admin
    admin = superuser_client()
    staff = User.objects.create_user("staff", password="pw", is_staff=True)
    trail = Trail()

    # When / Then: add, change
    assert admin.post(f"{ADMIN}/schedule/add/", schedule_form(name="from-admin")).status_code == 302
    trail.one("create", "scheduler.schedule", "user")
    schedule = Schedule.objects.get(name="from-admin")
    assert (
        admin.post(
            f"{ADMIN}/schedule/{schedule.pk}/change/", schedule_form(name="from-admin", description="edited")
        ).status_code
        == 302
    )
    assert trail.one("update", "scheduler.schedule").changes["description"] == ["", "edited"]
    # each list action
    for action in ("pause", "resume", "disable", "enable", "run_now"):
        admin.post(f"{ADMIN}/schedule/", {"action": action, "_selected_action": [schedule.pk]})
        trail.one(action, "scheduler.schedule")
    # each button
    for action in ("pause", "resume", "disable", "enable", "run_now"):
        assert admin.post(f"{ADMIN}/schedule/{schedule.pk}/act/{action}/").status_code == 302, action
        trail.one(action, "scheduler.schedule")
    # backfill: a preview records nothing, the confirmed run one event
    start, end = past_range()
    url = f"{ADMIN}/schedule/{schedule.pk}/backfill/"
    assert (
        admin.post(url, {"start": start[:19].replace("T", " "), "end": end[:19].replace("T", " ")}).status_code == 200
    )
    trail.none()
    admin.post(url, {"start": start[:19].replace("T", " "), "end": end[:19].replace("T", " "), "confirm": "1"})
    assert trail.one("backfill", "scheduler.schedule").changes["state"] == "completed"
    # executions: retry and cancel, as list actions and as buttons
    failed = [make_execution(schedule, f"k-failed-{n}", Status.FAILED) for n in range(2)]
    queued = [make_execution(schedule, f"k-queued-{n}", Status.QUEUED) for n in range(2)]
    trail.skip()
    admin.post(f"{ADMIN}/execution/", {"action": "retry", "_selected_action": [failed[0].pk]})
    trail.one("retry", "scheduler.execution")
    admin.post(f"{ADMIN}/execution/", {"action": "cancel", "_selected_action": [queued[0].pk]})
    trail.one("cancel", "scheduler.execution")
    admin.post(f"{ADMIN}/execution/{failed[1].pk}/act/retry/")
    trail.one("retry", "scheduler.execution")
    admin.post(f"{ADMIN}/execution/{queued[1].pk}/act/cancel/")
    trail.one("cancel", "scheduler.execution")
    # delete
    assert admin.post(f"{ADMIN}/schedule/{schedule.pk}/delete/", {"post": "yes"}).status_code == 302
    trail.one("delete", "scheduler.schedule")
    # operator profile: add, change, delete, one event each
    assert admin.post(f"{ADMIN}/operatorprofile/add/", {"user": staff.pk, "tenant": "team-a"}).status_code == 302
    assert trail.one("create", "scheduler.operatorprofile", "user").actor == "root"
    profile = OperatorProfile.objects.get(user=staff)
    change = f"{ADMIN}/operatorprofile/{profile.pk}/change/"
    assert admin.post(change, {"user": staff.pk, "tenant": "", "all_tenants": "on"}).status_code == 302
    assert trail.one("update", "scheduler.operatorprofile").changes["all_tenants"] == [False, True]
    assert admin.post(change, {"user": staff.pk, "tenant": "", "all_tenants": "on"}).status_code == 302  # unchanged
    trail.none()
    assert admin.post(f"{ADMIN}/operatorprofile/{profile.pk}/delete/", {"post": "yes"}).status_code == 302
    trail.one("delete", "scheduler.operatorprofile")


def test_every_cli_write__leaves_exactly_one_event(redis_client: object, settings: Any) -> None:
    # Given: the command line
    trail = Trail()

    # When / Then: schedules
    cli("schedules", "create", "from-cli", "--task", "scheduler.echo", "--every", "60")
    trail.one("create", "scheduler.schedule", "cli")
    cli("schedules", "update", "from-cli", "--queue", "reports")
    trail.one("update", "scheduler.schedule")
    for action in ("pause", "resume", "disable", "enable", "run-now"):
        cli("schedules", action, "from-cli")
        trail.one(action.replace("-", "_"), "scheduler.schedule")
    cli("schedules", "pause", "from-cli", "--dry-run")
    trail.none()
    # executions
    schedule = Schedule.objects.get(name="from-cli")
    failed = make_execution(schedule, "k-failed", Status.FAILED)
    queued = make_execution(schedule, "k-queued", Status.QUEUED)
    cli("executions", "retry", str(failed.pk))
    trail.one("retry", "scheduler.execution")
    cli("executions", "cancel", str(queued.pk))
    trail.one("cancel", "scheduler.execution")
    # backfill and reconcile: one event each, completed; dry runs none
    start, end = past_range()
    cli("backfill", "from-cli", "--start", start, "--end", end, "--dry-run")
    trail.none()
    cli("backfill", "from-cli", "--start", start, "--end", end)
    assert trail.one("backfill", "scheduler.schedule").changes["state"] == "completed"
    cli("reconcile", "--repair", "--dry-run")
    trail.none()
    cli("reconcile", "--repair")
    assert trail.one("reconcile", "reconcile").changes["state"] == "completed"
    # prune
    cli("prune_executions", "--older-than", "1d", "--dry-run")
    trail.none()
    cli("prune_executions", "--older-than", "1d")
    assert trail.one("prune", "scheduler.execution").changes["state"] == "completed"
    # tokens
    cli("api_tokens", "create", "ci", "--role", "viewer", "--tenant", "team-a")
    trail.one("create", "scheduler.apitoken")
    cli("api_tokens", "revoke", "ci")
    trail.one("revoke", "scheduler.apitoken")
    # shards --assign: one event when it moves schedules, none when nothing moves
    Schedule.objects.filter(pk=schedule.pk).update(shard=3)
    cli("shards", "--assign")
    assert trail.one("assign_shards", "scheduler.schedule").changes["moved"] == 1
    cli("shards", "--assign")
    trail.none()
    # import_celery_beat: one event per schedule imported
    PeriodicTask.objects.create(
        name="imported", task="scheduler.echo", interval=IntervalSchedule.objects.create(every=1, period="minutes")
    )
    trail.skip()
    cli("import_celery_beat")
    trail.one("import", "scheduler.schedule")
    # demo: its login and its two schedules
    settings.VAR_DIR = settings.VAR_DIR / "demo-test"
    cli("demo", "--username", "demo-admin")
    assert sorted((e.action, e.object_type) for e in trail.new()) == [
        ("create", "auth.user"),
        ("create", "scheduler.schedule"),
        ("create", "scheduler.schedule"),
    ]
    # delete last
    cli("schedules", "delete", "from-cli")
    trail.one("delete", "scheduler.schedule")


def test_the_daily_prune__records_its_counts_and_never_deletes_its_own_event() -> None:
    # Given: an old finished execution and an old audit event
    schedule = make_schedule("pruned")
    old = make_execution(schedule, "k-old", Status.SUCCEEDED)
    Execution.objects.filter(pk=old.pk).update(finished_at=dbclock.now() - timedelta(days=40))
    stale = audit.record(audit.CLI, "disable", schedule)
    AuditEvent.objects.filter(pk=stale.pk).update(created_at=dbclock.now() - timedelta(days=40))
    trail = Trail()

    # When: the daily prune runs
    result = tasks.prune_executions(older_than_days=30, keep_last=0)

    # Then: one event, by the system, with both counts; it survived its own prune
    event = trail.one("prune", "scheduler.execution", "system")
    assert (result["deleted"], result["audit_events_deleted"]) == (1, 1)
    assert event.changes["state"] == "completed"
    assert (event.changes["deleted"], event.changes["audit_events_deleted"]) == (1, 1)
    assert not AuditEvent.objects.filter(pk=stale.pk).exists()
    # And even a cutoff later than the event itself leaves it
    assert prune.prune_audit_events(older_than=dbclock.now() + timedelta(days=1), keep=[event.pk]) >= 0
    assert AuditEvent.objects.filter(pk=event.pk).exists()


# --- users, groups, permissions, operator profiles ------------------------------------


def test_user_and_group_changes_in_the_admin__one_event_each_by_the_request_user() -> None:
    # Given: a superuser in the admin
    admin = superuser_client()
    trail = Trail()
    view = Permission.objects.get(codename="view_schedule")

    # When: it adds a user, then gives it a group and a permission
    response = admin.post(
        "/admin/auth/user/add/",
        {"username": "newbie", "usable_password": "true", "password1": "a-Long-pass-1", "password2": "a-Long-pass-1"},
    )
    assert response.status_code == 302, response.context["adminform"].form.errors
    created = trail.one("create", "auth.user", "user")
    assert created.actor == "root" and created.tenant == ""
    user = User.objects.get(username="newbie")
    User.objects.filter(pk=user.pk).update(
        date_joined=datetime(2026, 1, 1, tzinfo=timezone.utc)
    )  # as the form posts it
    response = admin.post(
        f"/admin/auth/user/{user.pk}/change/",
        {
            "username": "newbie",
            "first_name": "New",
            "last_name": "",
            "email": "",
            "is_active": "on",
            "groups": [Group.objects.get(name=VIEWER_GROUP).pk],
            "user_permissions": [view.pk],
            "date_joined_0": "2026-01-01",
            "date_joined_1": "00:00:00",
        },
    )
    assert response.status_code == 302, response.context["adminform"].form.errors

    # Then: the field change, the groups and the permissions, each said once, by the user
    events = trail.new()
    assert {(e.action, e.object_type) for e in events} == {("update", "auth.user")}
    assert {key for e in events for key in e.changes} == {"first_name", "groups", "user_permissions"}
    assert len(events) == 3
    assert {e.actor for e in events} == {"root"}
    assert [e.changes["groups"] for e in events if "groups" in e.changes] == [[[], [VIEWER_GROUP]]]
    assert [e.changes["user_permissions"] for e in events if "user_permissions" in e.changes] == [
        [[], ["scheduler.view_schedule"]]
    ]

    # When: it changes the user's password, then groups' names and permissions, then deletes both
    response = admin.post(
        f"/admin/auth/user/{user.pk}/password/",
        {"usable_password": "true", "password1": "an-Other-pass-2", "password2": "an-Other-pass-2"},
    )
    assert response.status_code == 302
    event = trail.one("update", "auth.user")
    assert event.changes == {"password": ["(hidden)", "(changed)"]}
    response = admin.post("/admin/auth/group/add/", {"name": "auditors", "permissions": [view.pk]})
    assert response.status_code == 302
    events = trail.new()
    assert [(e.action, e.object_type) for e in events] == [("create", "auth.group"), ("update", "auth.group")]
    assert events[1].changes == {"permissions": [[], ["scheduler.view_schedule"]]}
    group = Group.objects.get(name="auditors")
    assert admin.post(f"/admin/auth/group/{group.pk}/delete/", {"post": "yes"}).status_code == 302
    trail.one("delete", "auth.group")
    assert admin.post(f"/admin/auth/user/{user.pk}/delete/", {"post": "yes"}).status_code == 302
    trail.one("delete", "auth.user")

    # Then: no event anywhere holds a password hash
    hashes = [u.password for u in User.objects.all()] + ["pbkdf2_", "argon2", "bcrypt"]
    dumped = json.dumps([e.changes for e in AuditEvent.objects.all()])
    assert not any(h in dumped for h in hashes)


def test_user_and_group_changes_in_code__one_event_each_by_the_system() -> None:
    # Given: the ORM, outside any request
    trail = Trail()
    operators = Group.objects.get(name=OPERATOR_GROUP)
    change = Permission.objects.get(codename="change_schedule")

    # When / Then: a user is created (once), its password set, groups changed from either side
    user = User.objects.create_user("coder", password="pw-1-long-enough")
    event = trail.one("create", "auth.user", "system")
    assert event.actor == "system" and event.changes["password"] == [None, "(hidden)"]
    assert "pw-1" not in json.dumps(event.changes) and user.password not in json.dumps(event.changes)
    user.set_password("pw-2-long-enough")
    user.save()
    assert trail.one("update", "auth.user").changes == {"password": ["(hidden)", "(changed)"]}
    user.groups.add(operators)
    assert trail.one("update", "auth.user").changes == {"groups": [[], [OPERATOR_GROUP]]}
    user.groups.add(operators)  # already a member: nothing changes
    trail.none()
    operators.user_set.remove(user)
    assert trail.one("update", "auth.user").changes == {"groups": [[OPERATOR_GROUP], []]}
    user.groups.add(operators)
    trail.skip()
    user.groups.clear()
    assert trail.one("update", "auth.user").changes == {"groups": [[OPERATOR_GROUP], []]}
    user.user_permissions.add(change)
    assert trail.one("update", "auth.user").changes == {"user_permissions": [[], ["scheduler.change_schedule"]]}
    group = Group.objects.create(name="temp")
    trail.one("create", "auth.group")
    group.permissions.add(change)
    trail.one("update", "auth.group")
    group.name = "renamed"
    group.save()
    assert trail.one("update", "auth.group").changes == {"name": ["temp", "renamed"]}
    profile = OperatorProfile.objects.create(user=user, tenant="team-a")
    assert trail.one("create", "scheduler.operatorprofile").tenant == ""
    profile.delete()
    trail.one("delete", "scheduler.operatorprofile")

    # And: logins and saves that change nothing are not events
    Client().force_login(user)
    user.save(update_fields=["last_login"])
    user.save()
    trail.none()


def test_createsuperuser__one_event(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given
    trail = Trail()
    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", "a-Long-pass-1")

    # When
    cli("createsuperuser", "--noinput", "--username", "boss", "--email", "boss@example.invalid")

    # Then
    event = trail.one("create", "auth.user")
    assert event.changes["is_superuser"] == [None, True] and event.changes["password"] == [None, "(hidden)"]


def test_migrate_restoring_the_groups__audited_only_when_something_changes() -> None:
    # Given: the groups as migrate left them
    trail = Trail()

    # When: the post_migrate receiver runs again
    ensure_groups()

    # Then: nothing changed, nothing recorded
    trail.none()

    # When: someone removed a permission from the viewers (one event), and migrate restores it
    viewers = Group.objects.get(name=VIEWER_GROUP)
    viewers.permissions.remove(Permission.objects.get(codename="view_lease"))
    trail.one("update", "auth.group")
    ensure_groups()

    # Then: the restore is one event, by the system
    event = trail.one("update", "auth.group", "system")
    assert event.changes["permissions"][1] == sorted(event.changes["permissions"][1])
    assert "scheduler.view_lease" in event.changes["permissions"][1]


def test_migrate_with_the_groups_in_step__one_query_and_no_write() -> None:
    # Given: the groups as migrate left them

    # When: the post_migrate receiver runs again, as migrate runs it once for each installed app
    with CaptureQueriesContext(connection) as queries:
        ensure_groups()

    # Then: one query found them in step
    assert [query["sql"].split()[0] for query in queries] == ["SELECT"]


# --- committed with the write ---------------------------------------------------------------


def refuse_audit_inserts() -> None:
    """Make every insert into the audit table fail from now on, as a full disk or a lost connection would."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "CREATE FUNCTION audit_refused() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'audit refused'; END $$"
            )
            cursor.execute(
                "CREATE TRIGGER audit_refused BEFORE INSERT ON scheduler_auditevent "
                "FOR EACH ROW EXECUTE FUNCTION audit_refused()"
            )
        else:
            cursor.execute(
                "CREATE TRIGGER audit_refused BEFORE INSERT ON scheduler_auditevent "
                "BEGIN SELECT RAISE(ABORT, 'audit refused'); END"
            )


def rows() -> dict[str, list[dict[str, Any]]]:
    """Every row an audited write may change."""
    models = (
        Schedule,
        Execution,
        AuditEvent,
        ApiToken,
        OperatorProfile,
        User,
        Group,
        User.groups.through,
        User.user_permissions.through,
        Group.permissions.through,
    )
    return {model.__name__: list(model.objects.order_by("pk").values()) for model in models}


World = dict[str, Any]


def _fill(value: Any, world: World) -> Any:
    """``"{name}"`` is the world's ``name``; any other value is itself."""
    if isinstance(value, str) and value.startswith("{") and value.endswith("}") and value[1:-1] in world:
        return world[value[1:-1]]
    return value


def _api(method: str, path: str, data: dict[str, Any] | None = None) -> Callable[[World], Any]:
    def write(world: World) -> Any:
        body = {key: _fill(value, world) for key, value in (data or {}).items()}
        return getattr(world["api"], method)(f"/api/v1/{path.format(**world)}", body, content_type="application/json")

    return write


def _admin(path: str, data: dict[str, Any] | None = None) -> Callable[[World], Any]:
    def write(world: World) -> Any:
        return world["admin"].post(
            path.format(**world), {key: _fill(value, world) for key, value in (data or {}).items()}
        )

    return write


def _cli(*argv: str) -> Callable[[World], Any]:
    return lambda world: cli(*(str(_fill(arg, world)) for arg in argv))


def _code(change: Callable[[World], Any]) -> Callable[[World], Any]:
    def write(world: World) -> Any:
        # The caller's transaction, as around any ORM write that must be all or nothing.
        with transaction.atomic():
            change(world)

    return write


def _viewers() -> Group:
    return Group.objects.get(name=VIEWER_GROUP)


#: One write of each kind: API, admin, CLI and code changing who may do what.
WRITES: dict[str, Callable[[World], Any]] = {
    "api create": _api("post", "schedules/", {"name": "new", "task": "scheduler.echo", "interval": 60}),
    "api update": _api("patch", "schedules/{schedule}/", {"description": "d"}),
    "api pause": _api("post", "schedules/{schedule}/pause/"),
    "api run-now": _api("post", "schedules/{schedule}/run-now/"),
    "api backfill": _api(
        "post", "schedules/{schedule}/backfill/", {"start": "{start}", "end": "{end}", "dry_run": False}
    ),
    "api retry": _api("post", "executions/{failed}/retry/"),
    "api cancel": _api("post", "executions/{queued}/cancel/"),
    "api reconcile": _api("post", "reconcile/", {"dry_run": False, "repair": True}),
    "api delete": _api("delete", "schedules/{schedule}/"),
    "admin add": _admin(f"{ADMIN}/schedule/add/", schedule_form(name="from-admin")),
    "admin action": _admin(f"{ADMIN}/schedule/", {"action": "disable", "_selected_action": "{schedule}"}),
    "admin button": _admin(f"{ADMIN}/schedule/{{schedule}}/act/pause/"),
    "admin backfill": _admin(
        f"{ADMIN}/schedule/{{schedule}}/backfill/", {"start": "{start_form}", "end": "{end_form}", "confirm": "1"}
    ),
    "admin retry": _admin(f"{ADMIN}/execution/{{failed}}/act/retry/"),
    "admin cancel": _admin(f"{ADMIN}/execution/", {"action": "cancel", "_selected_action": "{queued}"}),
    "admin delete": _admin(f"{ADMIN}/schedule/{{schedule}}/delete/", {"post": "yes"}),
    "admin profile": _admin(f"{ADMIN}/operatorprofile/add/", {"user": "{staff}", "tenant": "team-a"}),
    "admin group": _admin("/admin/auth/group/add/", {"name": "auditors"}),
    "cli update": _cli("schedules", "update", "kept", "--queue", "q"),
    "cli retry": _cli("executions", "retry", "{failed}"),
    "cli backfill": _cli("backfill", "kept", "--start", "{start}", "--end", "{end}"),
    "cli reconcile": _cli("reconcile", "--repair"),
    "cli prune": _cli("prune_executions", "--older-than", "1d"),
    "cli token create": _cli("api_tokens", "create", "ci", "--role", "viewer", "--all-tenants"),
    "cli token revoke": _cli("api_tokens", "revoke", "old-token"),
    "cli shards": _cli("shards", "--assign"),
    "code user groups": _code(lambda world: User.objects.get(pk=world["staff"]).groups.add(_viewers())),
    "code group permissions": _code(lambda world: _viewers().permissions.clear()),
    "code profile": _code(lambda world: OperatorProfile.objects.create(user_id=world["staff"], all_tenants=True)),
    "code user delete": _code(lambda world: User.objects.filter(pk=world["staff"]).delete()),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_whose_event_cannot_be_written__does_not_happen(write: str, redis_client: object) -> None:
    # Given: a schedule (in a shard to move), executions, tokens, a staff user and a superuser in the admin
    schedule = make_schedule("kept")
    Schedule.objects.filter(pk=schedule.pk).update(shard=2)
    start, end = past_range()
    world: World = {
        "schedule": schedule.pk,
        "failed": make_execution(schedule, "k-failed", Status.FAILED).pk,
        "queued": make_execution(schedule, "k-queued", Status.QUEUED).pk,
        "staff": User.objects.create_user("staff", password="pw", is_staff=True).pk,
        "start": start,
        "end": end,
        "start_form": start[:19].replace("T", " "),
        "end_form": end[:19].replace("T", " "),
        "api": token_client("ops", role="operator"),
        "admin": superuser_client(),
    }
    ApiToken.issue("old-token", role="viewer", all_tenants=True)
    world["api"].get("/api/v1/schedules/")  # the token's once-a-minute last_used_at write, before the look
    before = rows()
    # ... and an audit table that refuses every insert
    refuse_audit_inserts()

    # When: the write is attempted
    with pytest.raises((DatabaseError, CommandError)):
        WRITES[write](world)

    # Then: nothing changed
    assert rows() == before


# --- seen by another connection exactly when the write is ----------------------------------


@pytest.fixture
def observer() -> Iterator[Callable[[str, list[Any]], list[tuple[Any, ...]]]]:
    """A second connection, in autocommit: it sees only what was committed."""
    other = connections["default"].__class__(connection.settings_dict, alias="observer")

    def query(sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
        with other.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())

    yield query
    other.close()


def _changes(value: Any) -> dict[str, Any]:
    return json.loads(value) if isinstance(value, str) else value


@pytest.mark.django_db(transaction=True)
def test_an_api_write_and_its_event__committed_together(
    observer: Callable[[str, list[Any]], list[tuple[Any, ...]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: an operator token; a look from another connection just after the event is written
    api = token_client("ops", role="operator")
    seen: list[tuple[int, int]] = []
    record = audit.record

    def record_then_look(*args: Any, **kwargs: Any) -> AuditEvent:
        event = record(*args, **kwargs)
        seen.append(
            (
                observer("SELECT count(*) FROM scheduler_schedule WHERE name = %s", ["watched"])[0][0],
                observer("SELECT count(*) FROM scheduler_auditevent WHERE id = %s", [event.pk])[0][0],
            )
        )
        return event

    monkeypatch.setattr(audit, "record", record_then_look)

    # When: it creates a schedule
    response = api.post(
        "/api/v1/schedules/",
        {"name": "watched", "task": "scheduler.echo", "interval": 60},
        content_type="application/json",
    )

    # Then: inside the transaction neither was visible; after it, both are
    assert response.status_code == 201
    assert seen == [(0, 0)]
    assert observer("SELECT count(*) FROM scheduler_schedule WHERE name = %s", ["watched"])[0][0] == 1
    assert observer("SELECT count(*) FROM scheduler_auditevent WHERE action = %s", ["create"])[0][0] == 1


@pytest.mark.django_db(transaction=True)
def test_an_admin_group_change_and_its_event__committed_together(
    observer: Callable[[str, list[Any]], list[tuple[Any, ...]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: a superuser in the admin, a user; a look from another connection as each event is written
    admin = superuser_client()
    user = User.objects.create_user("member", password="pw")
    viewers = Group.objects.get(name=VIEWER_GROUP)
    seen: list[tuple[int, int]] = []
    record = audit.record

    def record_then_look(*args: Any, **kwargs: Any) -> AuditEvent:
        event = record(*args, **kwargs)
        seen.append(
            (
                observer("SELECT count(*) FROM auth_user_groups WHERE user_id = %s", [user.pk])[0][0],
                observer("SELECT count(*) FROM scheduler_auditevent WHERE id = %s", [event.pk])[0][0],
            )
        )
        return event

    monkeypatch.setattr(audit, "record", record_then_look)

    # When: it adds the user to the viewers on the user's page
    response = admin.post(
        f"/admin/auth/user/{user.pk}/change/",
        {
            "username": "member",
            "first_name": "",
            "last_name": "",
            "email": "",
            "is_active": "on",
            "groups": [viewers.pk],
            "date_joined_0": "2026-01-01",
            "date_joined_1": "00:00:00",
        },
    )

    # Then: the group change and its event appeared together, after the request
    assert response.status_code == 302
    assert (0, 0) in seen and all(look == (0, 0) for look in seen)
    assert observer("SELECT count(*) FROM auth_user_groups WHERE user_id = %s", [user.pk])[0][0] == 1


@pytest.mark.django_db(transaction=True)
def test_a_backfill_event__committed_before_the_work_and_completed_after(
    observer: Callable[[str, list[Any]], list[tuple[Any, ...]]], monkeypatch: pytest.MonkeyPatch, redis_client: object
) -> None:
    # Given: a schedule; a look from another connection as the first executions are recorded
    make_schedule("long")
    looks: list[list[tuple[Any, ...]]] = []
    record_slots = executions.record_slots

    def look_then_record(*args: Any, **kwargs: Any) -> Any:
        looks.append(observer("SELECT action, changes FROM scheduler_auditevent ORDER BY id", []))
        return record_slots(*args, **kwargs)

    monkeypatch.setattr(executions, "record_slots", look_then_record)
    start, end = past_range()

    # When: it is backfilled from the command line
    cli("backfill", "long", "--start", start, "--end", end)

    # Then: while the work ran, the event was committed, "started"; after it, "completed" with the counts
    assert looks, "the backfill recorded nothing"
    ((action, changes),) = looks[0]
    assert action == "backfill" and _changes(changes)["state"] == "started"
    assert {"start", "end"} <= set(_changes(changes))
    ((action, changes),) = observer("SELECT action, changes FROM scheduler_auditevent ORDER BY id", [])
    done = _changes(changes)
    assert done["state"] == "completed" and done["created"] == Execution.objects.count()


@pytest.mark.django_db(transaction=True)
def test_a_prune_that_fails_part_way__leaves_its_started_event_marked_failed(
    observer: Callable[[str, list[Any]], list[tuple[Any, ...]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: a prune that fails after it started
    def broken(**kwargs: Any) -> Any:
        looks.append(observer("SELECT action, changes FROM scheduler_auditevent ORDER BY id", []))
        raise DatabaseError("connection lost")

    looks: list[list[tuple[Any, ...]]] = []
    monkeypatch.setattr("scheduler.ops.prune.prune_executions", broken)

    # When
    with pytest.raises(CommandError):
        cli("prune_executions", "--older-than", "1d")

    # Then: the event was committed before the work, and says it failed
    ((action, changes),) = looks[0]
    assert action == "prune" and _changes(changes)["state"] == "started"
    ((action, changes),) = observer("SELECT action, changes FROM scheduler_auditevent ORDER BY id", [])
    assert _changes(changes)["state"] == "failed" and "connection lost" in _changes(changes)["error"]
