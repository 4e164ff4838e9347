"""``manage.py schedules export`` and ``import``: a round trip field for field, a diff, prune, and bad files refused whole."""

from __future__ import annotations

import io
import json
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

import tests.support.tasks  # noqa: F401 -- registers tests.record with the Celery app
from scheduler import dbclock
from scheduler.models import AuditEvent, Schedule
from scheduler.ops.schedule_files import FILE_FIELDS, PRUNED_REASON
from scheduler.owners import schedules as owner
from tests.integration import command_support
from tests.integration.api_support import tables
from tests.integration.command_support import run
from tests.support.factories import make_schedule

pytestmark = pytest.mark.django_db

schedules = partial(run, "schedules")
refused = partial(command_support.refused, "schedules")


def _variety() -> None:
    """Schedules of every kind and state, the deployer's and a tenant's."""
    soon = (dbclock.now() + timedelta(days=30)).replace(microsecond=0)
    make_schedule(
        "nightly",
        cron="30 2 * * 1-5",
        timezone="Europe/Berlin",
        args=[1, "two"],
        kwargs={"deep": {"list": [1, 2]}},
        queue="reports",
        priority=7,
        description="The nightly report.",
        overlap="skip",
        misfire="run_once",
        catchup_window=600,
        jitter=5,
        dst_gap="skip",
        dst_fold="both",
        timeout=300,
        max_retries=3,
        retry_backoff=10,
        pause_after_failures=4,
        alert_after=7200,
        start_at=soon - timedelta(days=60),
        end_at=soon + timedelta(days=365),
    )
    make_schedule("once", run_at=soon, max_runs=None)
    make_schedule("paused", interval=60, paused_reason="vendor outage")
    make_schedule("off", interval=90, enabled=False)
    make_schedule("billing", tenant="acme", task="tests.record", interval=3600, max_runs=10)


def _definitions() -> list[dict[str, Any]]:
    return list(Schedule.objects.order_by("tenant", "name").values(*FILE_FIELDS))


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "schedules.yaml"
    path.write_text(text)
    return str(path)


def test_export_then_import_into_an_empty_database_gives_equal_schedules_and_a_second_import_changes_nothing(
    tmp_path: Path,
) -> None:
    # Given schedules of every kind, exported
    _variety()
    exported = schedules("export")
    expected = _definitions()
    # When every schedule is gone and the file is imported
    Schedule.objects.all().delete()
    out = schedules("import", _write(tmp_path, exported))
    # Then the schedules are equal, field for field, and say where they came from
    assert _definitions() == expected
    assert set(Schedule.objects.values_list("origin", flat=True)) == {Schedule.Origin.IMPORT}
    assert out.splitlines()[-1] == "5 created, 0 updated, 0 disabled, 0 unchanged."
    assert schedules("export") == exported
    # And a second import changes nothing, and audits nothing
    events = AuditEvent.objects.count()
    before = tables()
    assert schedules("import", _write(tmp_path, exported)) == "0 created, 0 updated, 0 disabled, 5 unchanged.\n"
    assert tables() == before and AuditEvent.objects.count() == events


def test_import__prints_a_diff_and_applies_each_change_as_its_action(tmp_path: Path) -> None:
    # Given a file exported, then edited: a queue changed, a schedule paused, another turned on, one added
    _variety()
    document = yaml.safe_load(schedules("export"))
    by_name = {entry["name"]: entry for entry in document["schedules"]}
    by_name["nightly"]["queue"] = "urgent"
    by_name["off"]["enabled"] = True
    by_name["paused"]["paused_reason"] = ""
    document["schedules"].append({"name": "new", "task": "scheduler.echo", "interval": 30})
    # When it is imported
    out = schedules("import", _write(tmp_path, yaml.safe_dump(document)))
    # Then the diff names each change
    assert out.splitlines() == [
        "~ nightly: queue reports -> urgent",
        "~ off: enabled False -> True",
        "~ paused: paused_reason vendor outage -> ",
        "+ new",
        "1 created, 3 updated, 0 disabled, 2 unchanged.",
    ]
    # and each is applied as the admin's own action would be, audited
    assert Schedule.objects.get(name="nightly").queue == "urgent"
    assert Schedule.objects.get(name="off").enabled
    resumed = Schedule.objects.get(name="paused")
    assert resumed.paused_reason == "" and resumed.next_run_at is not None
    assert Schedule.objects.get(name="new").origin == Schedule.Origin.IMPORT
    actions = list(AuditEvent.objects.filter(actor_type="cli").values_list("action", flat=True))
    assert sorted(actions) == ["enable", "import", "import", "resume"]


def test_import__dry_run_prints_the_same_diff_and_writes_nothing(tmp_path: Path) -> None:
    _variety()
    document = yaml.safe_load(schedules("export"))
    document["schedules"][0]["description"] = "changed"
    before = tables()
    out = schedules("import", _write(tmp_path, yaml.safe_dump(document)), "--dry-run", "--prune")
    assert out.splitlines()[-1] == "Would make: 0 created, 1 updated, 0 disabled, 4 unchanged."
    assert tables() == before


def test_import__prune_turns_off_what_the_file_does_not_name_within_the_tenant_given(tmp_path: Path) -> None:
    # Given a file naming only the deployer's "nightly", and the tenant's own file naming nothing
    _variety()
    document = yaml.safe_load(schedules("export", "--tenant", ""))
    document["schedules"] = [entry for entry in document["schedules"] if entry["name"] == "nightly"]
    # When it is imported with --prune for the deployer's schedules
    out = schedules("import", _write(tmp_path, yaml.safe_dump(document)), "--prune", "--tenant", "")
    # Then the deployer's other enabled schedules are off, with the reason; the tenant's is untouched
    assert "- once (turned off: not in the file)" in out.splitlines()
    assert dict(Schedule.objects.filter(tenant="").values_list("name", "enabled")) == {
        "nightly": True,
        "once": False,
        "paused": False,
        "off": False,
    }
    assert Schedule.objects.get(name="once").disabled_reason == PRUNED_REASON
    assert Schedule.objects.get(tenant="acme").enabled
    # And an entry of another tenant is refused under --tenant
    document["schedules"][0]["tenant"] = "acme"
    before = tables()
    message = refused("import", _write(tmp_path, yaml.safe_dump(document)), "--tenant", "")
    assert message == "entry 1 ('nightly'): of tenant 'acme', not ''"
    assert tables() == before


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("schedules: [", "not YAML: "),
        ("- a list", "a schedules file is a mapping with a list under 'schedules'"),
        ("version: 2\nschedules: []", "version 2 is not one this release reads (1)"),
        ("schedules: [{task: scheduler.echo}]", "entry 1: a mapping with a 'name' is expected"),
        ("schedules: [{name: a, colour: red}]", "entry 1 ('a'): unknown field(s) colour"),
        ("schedules: [{name: a, start_at: yesterday}]", "entry 1 ('a'): start_at: "),
        (
            "schedules: [{name: a, task: scheduler.echo, interval: 5}, {name: a, task: scheduler.echo, interval: 5}]",
            "entry 2 ('a'): named twice for tenant ''",
        ),
        (
            "schedules: [{name: good, task: scheduler.echo, interval: 5}, {name: bad, task: scheduler.echo, cron: '61 * * * *'}]",
            "'bad': cron: ",
        ),
        ("schedules: [{name: ghost, task: no.such.task, interval: 5}]", "'ghost': task: Unknown task 'no.such.task'"),
    ],
)
def test_import__a_bad_file_is_refused_in_one_line_and_changes_nothing(tmp_path: Path, text: str, message: str) -> None:
    make_schedule("existing", interval=60)
    before = tables()
    assert message in refused("import", _write(tmp_path, text))
    assert tables() == before


def test_import__reads_standard_input_and_answers_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("schedules: [{name: piped, task: scheduler.echo, interval: 30}]"))
    report = json.loads(schedules("import", "-", "--json"))
    assert report["counts"] == {"create": 1}
    assert report["changes"][0]["name"] == "piped"
    assert Schedule.objects.get(name="piped").interval == 30


def test_import__a_missing_file_is_a_one_line_error() -> None:
    assert refused("import", "/nonexistent/schedules.yaml").startswith("cannot read /nonexistent/schedules.yaml: ")


def test_export__json_and_by_tenant() -> None:
    _variety()
    owner.pause(Schedule.objects.get(name="nightly"), "checking")
    exported = json.loads(schedules("export", "--tenant", "acme", "--json"))
    assert [entry["name"] for entry in exported["schedules"]] == ["billing"]
    assert set(exported["schedules"][0]) == set(FILE_FIELDS)
