"""Bad input to every command and to the admin: a one-line error, nothing changed, never a traceback or a 500.

The explicit cases come first; the generated sweep at the end feeds hostile
argv to every management command and sub-command of the project, through
the same ``ManagementUtility`` entry point ``manage.py`` uses.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from datetime import timedelta
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import redis
from django.core.exceptions import ValidationError
from django.core.management import ManagementUtility, find_commands, load_command_class
from django.test import Client
from hypothesis import HealthCheck, example, given
from hypothesis import strategies as st

import scheduler
from project.celery import app
from scheduler import dbclock
from scheduler.management.base import SchedulerCommand
from scheduler.models import Execution, Instance, Lease, Schedule
from scheduler.ops.backfill import backfill
from scheduler.owners import schedules
from tests.support.admin_forms import schedule_form

# Commands run through ManagementUtility close the database connection when
# they finish (as manage.py does), which a test transaction would not survive.
pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status
NOT_A_DATE = "2026-02-30T00:00:00Z"
HUGE = "99999999999999999999"
LONG_NAME = "n" * 300
#: Django's own options that change the process (settings module, sys.path) or
#: ask for tracebacks on purpose; the sweep leaves them out.
PROCESS_OPTIONS = ("--settings", "--pythonpath", "--traceback")


def manage(*argv: str) -> tuple[int, str, str]:
    """Run ``manage.py argv`` in this process; return (exit status, stdout, stderr).

    Any exception other than SystemExit propagates, and so fails the test.
    """
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            ManagementUtility(["manage.py", *argv]).execute()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def counts() -> tuple[int, int, int, int]:
    return (Schedule.objects.count(), Execution.objects.count(), Lease.objects.count(), Instance.objects.count())


def rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return list(Schedule.objects.order_by("pk").values()), list(Execution.objects.order_by("pk").values())


def refused(*argv: str) -> str:
    """Run a command that must refuse: exit 1 or 2, one line on stderr, no row changed; return that line."""
    before = rows()
    code, out, err = manage(*argv)
    assert code in (1, 2), (code, out, err)
    assert "Traceback" not in out + err
    assert len(err.strip().splitlines()) == 1, err
    assert rows() == before
    return err.strip()


@pytest.fixture
def nightly() -> Schedule:
    schedule = Schedule(name="nightly", task="scheduler.echo", interval=3600)
    schedule.full_clean()
    schedules.save(schedule)
    return schedule


# --- impossible dates ------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["backfill", "nightly", "--start", NOT_A_DATE, "--end", "2026-03-01T00:00:00Z"],
        ["backfill", "nightly", "--start", "2026-01-01", "--end", NOT_A_DATE],
        ["executions", "list", "--since", NOT_A_DATE],
        ["schedules", "create", "new", "--task", "scheduler.echo", "--at", NOT_A_DATE],
        ["schedules", "create", "new", "--task", "scheduler.echo", "--every", "60", "--start", NOT_A_DATE],
        ["schedules", "create", "new", "--task", "scheduler.echo", "--every", "60", "--end", NOT_A_DATE],
        ["schedules", "update", "nightly", "--at", NOT_A_DATE],
        ["schedules", "update", "nightly", "--start", NOT_A_DATE],
        ["schedules", "update", "nightly", "--end", NOT_A_DATE],
    ],
    ids=lambda argv: " ".join(argv[:2] + [next(a for a in argv if a.startswith("--"))]),
)
def test_date_option__impossible_calendar_date_is_refused(nightly: Schedule, argv: list[str]) -> None:
    # Given a schedule, When a date option names February 30th
    message = refused(*argv)
    # Then the one line says why
    assert f"'{NOT_A_DATE}' is not an ISO-8601 date or time (day is out of range for month)" in message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["executions", "list", "--since", "0001-01-01T00:00:00+05:00"], "date value out of range"),
        (
            ["backfill", "nightly", "--start", "1900-01-01", "--end", "1900-01-02"],
            "out of range; expected a time from 1970-01-01",
        ),
        (
            ["schedules", "update", "nightly", "--end", "9999-12-31T23:59:59Z"],
            "out of range; expected a time from 1970-01-01",
        ),
    ],
)
def test_date_option__outside_the_years_schedules_handle_is_refused(
    nightly: Schedule, argv: list[str], message: str
) -> None:
    assert message in refused(*argv)


# --- numbers too large for their column -------------------------------------------------


def test_prune__duration_too_long_is_refused() -> None:
    assert "--older-than '99999999999999d' is out of range; expected at most 36500d" in refused(
        "prune_executions", "--older-than", "99999999999999d"
    )


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--every", HUGE, "1 to 2147483647"),
        ("--every", "2147483648", "1 to 2147483647"),
        ("--max-runs", HUGE, "1 to 2147483647"),
        ("--timeout", "2147483648", "1 to 2147483647"),
        ("--catchup-window", HUGE, "0 to 2147483647"),
        ("--jitter", HUGE, "0 to 2147483647"),
        ("--max-retries", HUGE, "0 to 2147483647"),
        ("--retry-backoff", HUGE, "0 to 2147483647"),
        ("--pause-after-failures", HUGE, "1 to 2147483647"),
        ("--priority", "32768", "0 to 32767"),
    ],
)
@pytest.mark.parametrize("action", ["create", "update"])
def test_schedules__integer_beyond_its_column_is_refused_with_the_range(
    nightly: Schedule, action: str, option: str, value: str, expected: str
) -> None:
    name = "new" if action == "create" else "nightly"
    timing = ["--every", "60"] if option != "--every" else []
    argv = ["schedules", action, name, "--task", "scheduler.echo", *timing, option, value]
    assert f"argument {option}: {value} is out of range; expected {expected}" in refused(*argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["executions", "show", HUGE], "out of range; expected 0 to 9223372036854775807"),
        (["executions", "list", "--limit", HUGE], "out of range; expected 0 to 2147483647"),
        (
            ["backfill", "nightly", "--start", "2026-01-01", "--end", "2026-01-02", "--limit", HUGE],
            "expected 0 to 2147483647",
        ),
        (
            ["backfill", "nightly", "--start", "2026-01-01", "--end", "2026-01-02", "--rate", "inf"],
            "'inf' is not a finite number",
        ),
        (
            ["backfill", "nightly", "--start", "2026-01-01", "--end", "2026-01-02", "--rate", "nan"],
            "'nan' is not a finite number",
        ),
        (["alive", "--role", "beat", "--within", "1e300"], "out of range; expected at most 1000000000"),
        (["prune_executions", "--older-than", "30d", "--keep-last", HUGE], "expected 0 to 2147483647"),
        (
            ["schedules", "create", "new", "--task", "scheduler.echo", "--every", "5", "--args", "[" * 100_000],
            "--args is not valid JSON",
        ),
        (["schedules", "show", "night\x00ly"], "arguments cannot contain NUL characters"),
    ],
)
def test_command__hostile_number_or_text_is_refused(nightly: Schedule, argv: list[str], message: str) -> None:
    assert message in refused(*argv)


def test_model__integer_beyond_its_column_is_refused_on_every_database() -> None:
    # Given a schedule whose max_runs would fit SQLite's 64-bit integer but not PostgreSQL's column
    schedule = Schedule(name="big", task="scheduler.echo", interval=60, max_runs=2**31)
    # When / Then validation refuses it the same way on both
    with pytest.raises(ValidationError) as caught:
        schedule.full_clean()
    assert caught.value.message_dict == {"max_runs": ["Ensure this value is less than or equal to 2147483647."]}


# --- schedule names --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "name: This field cannot be blank."),
        ("   ", "name: This field cannot be blank."),
        (LONG_NAME, "name: Ensure this value has at most 200 characters (it has 300)."),
    ],
    ids=["empty", "blank", "300-chars"],
)
def test_schedules_create__blank_or_long_name_is_refused(name: str, message: str) -> None:
    assert message in refused("schedules", "create", name, "--task", "scheduler.echo", "--every", "60")


# --- catchup_window=0 ------------------------------------------------------------------


@pytest.mark.parametrize("action", ["create", "update"])
def test_schedules__catchup_window_zero_is_refused(nightly: Schedule, action: str) -> None:
    name = "new" if action == "create" else "nightly"
    message = refused("schedules", action, name, "--task", "scheduler.echo", "--every", "60", "--catchup-window", "0")
    assert "catchup_window: Must be at least 1 second" in message and "set misfire to skip" in message


# --- admin -----------------------------------------------------------------------------


def test_admin_add__the_valid_form_saves(staff: Client) -> None:
    # Guards the cases below: they fail for their one bad field, not for a form that never worked
    response = staff.post("/admin/scheduler/schedule/add/", schedule_form())
    assert response.status_code == 302
    assert Schedule.objects.filter(name="new").exists()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": ""}, "This field is required."),
        ({"name": "   "}, "This field is required."),
        ({"name": LONG_NAME}, "Ensure this value has at most 200 characters (it has 300)."),
        ({"catchup_window": "0"}, "Must be at least 1 second"),
        ({"max_runs": "2147483648"}, "Ensure this value is less than or equal to 2147483647."),
        ({"interval": HUGE}, "Ensure this value is less than or equal to "),
        ({"start_at_0": "2026-02-30", "start_at_1": "00:00:00"}, "Enter a valid date."),
        ({"start_at_0": "1900-01-01", "start_at_1": "00:00:00"}, "Must be from 1970-01-01 to 8999-12-31."),
    ],
    ids=["empty-name", "blank-name", "300-char-name", "catchup-0", "max-runs-2**31", "huge-interval", "feb-30", "1900"],
)
def test_admin_add__bad_field_is_a_form_error_and_saves_nothing(
    staff: Client, fields: dict[str, str], message: str
) -> None:
    # When the add form is posted with one bad field
    response = staff.post("/admin/scheduler/schedule/add/", schedule_form(**fields))
    # Then the form comes back with the error, and no schedule exists
    assert response.status_code == 200
    assert message in response.content.decode()
    assert not Schedule.objects.exists()


@pytest.mark.parametrize(
    ("start", "message"),
    [
        ("2026-02-30 00:00:00", "Enter a valid date/time."),
        ("0001-01-01 00:00:00", "Must be from 1970-01-01 to 8999-12-31."),
    ],
)
def test_admin_backfill__impossible_or_ancient_start_is_a_form_error(
    staff: Client, nightly: Schedule, start: str, message: str
) -> None:
    response = staff.post(
        f"/admin/scheduler/schedule/{nightly.pk}/backfill/",
        {"start": start, "end": "2026-01-01 00:00:00", "confirm": "1"},
    )
    assert response.status_code == 200
    assert message in response.content.decode()
    assert not Execution.objects.exists()


def test_admin_backfill__broker_down_records_pending_and_says_so(
    staff: Client, nightly: Schedule, broker_down: None, redis_client: redis.Redis
) -> None:
    # Given a schedule with 3 past hourly slots in range, and no broker at the configured address
    now = dbclock.now()
    start = (now - timedelta(hours=3, minutes=1)).strftime("%Y-%m-%d %H:%M:%S")
    end = (now - timedelta(minutes=1)).strftime("%Y-%m-%d %H:%M:%S")
    # When the backfill is confirmed
    response = staff.post(
        f"/admin/scheduler/schedule/{nightly.pk}/backfill/", {"start": start, "end": end, "confirm": "1"}, follow=True
    )
    # Then the page explains, and every slot is recorded pending for the leader to send
    page = response.content.decode()
    assert response.status_code == 200
    assert "3 execution(s) recorded" in page and "0 sent" in page
    assert "The broker is unreachable" in page and "the beat leader sends them once it is back" in page
    assert list(Execution.objects.values_list("status", flat=True)) == [Status.PENDING] * 3
    assert redis_client.llen("celery") == 0


def test_backfill__broker_down_under_a_rate_stops_after_the_failed_batch(nightly: Schedule, broker_down: None) -> None:
    # Given 4 past slots, and a rate of 1 per second (one slot per batch)
    now = dbclock.now()
    start, end = now - timedelta(hours=4, minutes=1), now - timedelta(minutes=1)
    # When the broker is unreachable
    report = backfill(nightly, start=start, end=end, now=now, rate=1, app=app)
    # Then the first batch is recorded pending, the rest not at all (the leader would outrun the rate)
    assert report.broker_error
    assert (report.created, report.published, report.not_recorded, report.already_present) == (1, 0, 3, 0)
    assert list(Execution.objects.values_list("status", flat=True)) == [Status.PENDING]


def test_backfill_command__broker_down_under_a_rate_exits_1_saying_what_is_left(
    nightly: Schedule, broker_down: None
) -> None:
    now = dbclock.now()
    start = (now - timedelta(hours=2, minutes=1)).isoformat()
    end = (now - timedelta(minutes=1)).isoformat()
    code, out, err = manage("backfill", "nightly", "--start", start, "--end", end, "--rate", "1")
    assert code == 1
    assert "1 recorded, 0 sent" in out
    assert (
        err.strip()
        == "CommandError: 1 slot(s) not recorded: the broker is unreachable; run the same backfill again once it is back"
    )


def test_backfill_command__broker_down_records_pending_and_exits_0(nightly: Schedule, broker_down: None) -> None:
    now = dbclock.now()
    start = (now - timedelta(hours=2, minutes=1)).isoformat()
    end = (now - timedelta(minutes=1)).isoformat()
    code, out, err = manage("backfill", "nightly", "--start", start, "--end", end)
    assert code == 0, err
    assert "2 recorded, 0 sent" in out and "stay pending; the beat leader sends them once it is back" in out
    assert Execution.objects.filter(status=Status.PENDING).count() == 2


# --- the generated sweep ---------------------------------------------------------------


def _targets() -> list[tuple[list[str], argparse.ArgumentParser, bool]]:
    """Every (argv prefix, parser, is a scheduler command) of this project's commands and sub-commands."""
    found = []
    for name in sorted(find_commands(str(Path(scheduler.__file__).parent / "management"))):
        command = load_command_class("scheduler", name)
        parser = command.create_parser("manage.py", name)
        ours = isinstance(command, SchedulerCommand)
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs:
            found += [([name, sub], subparser, ours) for sub, subparser in subs[0].choices.items()]
        else:
            found.append(([name], parser, ours))
    return found


HOSTILE = [
    NOT_A_DATE,
    "2026-13-01",
    "0000-00-00",
    "9999-12-31T23:59:59-05:00",
    "0001-01-01T00:00:00+05:00",
    "1969-12-31",
    "2026-03-01T25:61:00",
    HUGE,
    "-" + HUGE,
    "2147483648",
    "32768",
    "-1",
    "0",
    "1e309",
    "inf",
    "nan",
    "9" * 5000,
    "99999999999999d",
    "0d",
    "-5d",
    "",
    " ",
    LONG_NAME,
    "名前",
    "🙂",
    "\u202e",
    "\x00",
    "a\x00b",
    "{",
    "[1,",
    '{"a": NaN}',
    "null",
    "[]",
    "{}",
    "[" * 5000,
    "*/0 * * * *",
    "61 * * * *",
    "Mars/Olympus",
    "Europe",
]
PLAUSIBLE = [
    "nightly",
    "scheduler.echo",
    "2026-03-01T00:00:00Z",
    "2026-03-02",
    "5",
    "60",
    "30d",
    "UTC",
    "Europe/Berlin",
    "*/5 * * * *",
    "[1]",
    '{"a": 1}',
    "beat",
    "1",
]
UNKNOWN_FLAGS = ["--bogus", "-x", "--", "-", "--json=1"]


def _value() -> st.SearchStrategy[str]:
    text = st.text(max_size=30).filter(lambda s: not s.startswith("--"))
    return st.one_of(st.sampled_from(HOSTILE), st.sampled_from(PLAUSIBLE), text, st.integers().map(str))


def _argv_for(prefix: list[str], parser: argparse.ArgumentParser) -> st.SearchStrategy[list[str]]:
    """Argv lists for one (sub-)command: its positionals and real options with hostile values, in any order."""
    options = [a for a in parser._actions if a.option_strings and not set(a.option_strings) & set(PROCESS_OPTIONS)]
    positionals = [a for a in parser._actions if not a.option_strings and a.dest != "args"]

    def option(action: argparse.Action) -> st.SearchStrategy[list[str]]:
        flag = st.sampled_from(action.option_strings)
        if action.nargs == 0:
            return flag.map(lambda f: [f])
        values = (
            _value() if not action.choices else st.one_of(st.sampled_from([str(c) for c in action.choices]), _value())
        )
        return st.tuples(flag, values).map(list)

    picked = st.lists(
        st.one_of([option(a) for a in options] + [st.sampled_from(UNKNOWN_FLAGS).map(lambda f: [f])]), max_size=6
    )
    # Positionals name the seeded rows half of the time, so that options get looked at too.
    heads = st.tuples(*[st.one_of(st.sampled_from(["nightly", "1"]), _value()) for _ in positionals])
    extra = st.lists(_value(), max_size=1)
    return st.tuples(heads, extra, picked).map(
        lambda parts: [*prefix, *parts[0], *parts[1], *(word for chunk in parts[2] for word in chunk)]
    )


TARGETS = _targets()
OURS = {tuple(prefix[:1]) for prefix, _, ours in TARGETS if ours}
ARGV = st.one_of([_argv_for(prefix, parser) for prefix, parser, _ in TARGETS])


@pytest.fixture
def seeded(nightly: Schedule, redis_client: redis.Redis, settings: Any, tmp_path: Path) -> None:
    """A schedule and an execution to act on; ``demo`` writes its password file under tmp_path."""
    settings.VAR_DIR = tmp_path
    Execution.objects.create(
        idempotency_key="seed",
        schedule=nightly,
        task="scheduler.echo",
        scheduled_for=dbclock.now(),
        status=Status.FAILED,
    )


@hypothesis.settings(
    max_examples=1000,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(argv=ARGV)
@example(argv=["backfill", "nightly", "--start", NOT_A_DATE, "--end", "2026-03-01"])
@example(argv=["executions", "list", "--since", NOT_A_DATE])
@example(argv=["schedules", "create", "x", "--task", "scheduler.echo", "--at", NOT_A_DATE])
@example(argv=["schedules", "update", "nightly", "--start", NOT_A_DATE, "--end", NOT_A_DATE])
@example(argv=["prune_executions", "--older-than", "99999999999999d"])
@example(argv=["schedules", "create", "x", "--task", "scheduler.echo", "--every", HUGE])
@example(argv=["schedules", "update", "nightly", "--every", HUGE])
@example(argv=["schedules", "create", "", "--task", "scheduler.echo", "--every", "5"])
@example(argv=["schedules", "create", LONG_NAME, "--task", "scheduler.echo", "--every", "5"])
@example(argv=["schedules", "create", "x", "--task", "scheduler.echo", "--every", "5", "--catchup-window", "0"])
@example(argv=["schedules", "update", "nightly", "--catchup-window", "0"])
@example(argv=["demo", "--username", LONG_NAME])
@example(argv=["demo", "--username", "a\x00b"])
def test_sweep__no_command_ends_in_a_traceback_or_a_half_change(seeded: None, argv: list[str]) -> None:
    # Given the rows before
    before = counts()
    # When
    code, out, err = manage(*argv)
    # Then it succeeded, or failed cleanly and changed no row
    assert "Traceback" not in out + err, (argv, err)
    if code != 0:
        assert counts() == before, (argv, err)
        assert err.strip(), argv
        if tuple(argv[:1]) in OURS:
            assert len(err.strip().splitlines()) == 1, (argv, err)
