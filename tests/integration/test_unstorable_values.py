"""Values no database stores: a NUL (in no PostgreSQL text), a lone surrogate (not UTF-8), NaN or Infinity (not JSON).

What a user gives with one (a schedule's arguments or message headers, a
run now's, a submission, a checkpoint) is refused with a clear error, on
both databases alike, through the model, the API, the admin and the
command line. What a run leaves with one (a body's return value or error)
is recorded with it replaced: each NUL or lone surrogate by U+FFFD, each NaN or Infinity by
its name as a string; never a database error that would leave the
execution running. So is a plain Celery call's record of its arguments
(the body gets them as sent).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.test import Client

import scheduler
from scheduler import tasks as builtin_tasks
from scheduler.exceptions import CheckpointInvalid, SubmissionInvalid
from scheduler.models import Execution, Schedule
from tests.integration.command_support import refused
from tests.support.admin_forms import schedule_form
from tests.support.factories import make_schedule
from tests.support.in_process_guard import fresh, queued, run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("no_background_renewal")]

NUL = "\x00"
WITH_NUL = {"args": [f"a{NUL}b"], "kwargs": {"k": f"a{NUL}b"}, "headers": {"x-note": f"a{NUL}b"}}
WITH_NAN = {"args": [math.nan], "kwargs": {"k": math.inf}, "headers": {"x-rate": -math.inf}}
SURROGATE = "\ud800"  # half of a UTF-16 pair, alone: JSON's "\\ud800" decodes to it, and no UTF-8 encodes it
WITH_SURROGATE = {"args": [f"a{SURROGATE}b"], "kwargs": {"k": f"a{SURROGATE}b"}, "headers": {"x-note": SURROGATE}}


#: (the values, a word the refusal must contain), by kind.
UNSTORABLE = {
    "nul": (WITH_NUL, "NUL"),
    "nan": (WITH_NAN, "NaN or Infinity"),
    "surrogate": (WITH_SURROGATE, "surrogate"),
}
CASES = [(kind, field) for kind in UNSTORABLE for field in WITH_NUL]


@pytest.mark.parametrize(("kind", "field"), CASES)
def test_schedule__an_unstorable_value_in_its_json__a_field_error(kind: str, field: str) -> None:
    values, word = UNSTORABLE[kind]
    schedule = Schedule(name="bad", task="scheduler.echo", interval=60, **{field: values[field]})
    with pytest.raises(ValidationError) as refused:
        schedule.full_clean()
    assert word in " ".join(refused.value.message_dict[field])


@pytest.mark.parametrize("field", WITH_NUL)
def test_api__a_nul_in_a_schedules_json__400_and_nothing_saved(operator: Client, field: str) -> None:
    body = {"name": "nul", "task": "scheduler.echo", "interval": 60, field: WITH_NUL[field]}
    response = operator.post("/api/v1/schedules/", json.dumps(body), content_type="application/json")
    assert response.status_code == 400, response.content[:300]
    assert "NUL" in " ".join(response.json()[field])
    assert not Schedule.objects.exists()


def test_api__nan_in_a_body__400_and_nothing_saved(operator: Client) -> None:
    body = json.dumps({"name": "nan", "task": "scheduler.echo", "interval": 60, "args": WITH_NAN["args"]})
    response = operator.post("/api/v1/schedules/", body, content_type="application/json")
    assert response.status_code == 400 and "NaN" in response.json()["detail"]
    assert not Schedule.objects.exists()


def test_api__a_lone_surrogate_anywhere_in_a_body__400_and_nothing_saved(operator: Client) -> None:
    body = '{"name": "half\\ud800", "task": "scheduler.echo", "interval": 60}'  # the escape, as a client sends it
    response = operator.post("/api/v1/schedules/", body, content_type="application/json")
    assert response.status_code == 400 and "surrogate" in response.json()["detail"], response.content[:300]
    assert not Schedule.objects.exists()


def test_command__a_lone_surrogate_in_an_argument__refused() -> None:
    # (how Python hands a program an argument's bytes that are not UTF-8)
    assert "UTF-8" in refused("schedules", "show", "night\udcffly")


def test_api__a_nul_in_a_run_nows_arguments__400_and_nothing_recorded(operator: Client) -> None:
    schedule = make_schedule("stored", interval=60)
    body = json.dumps({"kwargs": WITH_NUL["kwargs"]})
    response = operator.post(f"/api/v1/schedules/{schedule.pk}/run-now/", body, content_type="application/json")
    assert response.status_code == 400, response.content[:300]
    assert "NUL" in " ".join(response.json()["kwargs"])
    assert not Execution.objects.exists()


@pytest.mark.parametrize(("kind", "field"), CASES)
def test_admin__an_unstorable_value_in_a_schedules_json__a_field_error_and_nothing_saved(kind: str, field: str) -> None:
    values, word = UNSTORABLE[kind]
    admin = Client()
    admin.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    form = schedule_form(**{field: json.dumps(values[field])})
    response = admin.post("/admin/scheduler/schedule/add/", form)
    assert response.status_code == 200
    assert word in " ".join(response.context["adminform"].form.errors[field])
    assert not Schedule.objects.exists()


@pytest.mark.parametrize("kind", UNSTORABLE)
def test_command__an_unstorable_value_in_a_schedules_json__refused_and_nothing_saved(kind: str) -> None:
    values, word = UNSTORABLE[kind]
    kwargs = json.dumps(values["kwargs"])
    assert word in refused(
        "schedules", "create", "bad", "--task", "scheduler.echo", "--every", "60", "--kwargs", kwargs
    )
    assert not Schedule.objects.exists()


@pytest.mark.parametrize("kind", UNSTORABLE)
def test_submit__an_unstorable_value_in_its_arguments__refused(kind: str) -> None:
    values, word = UNSTORABLE[kind]
    with pytest.raises(SubmissionInvalid, match=word):
        scheduler.submit("scheduler.echo", kwargs=values["kwargs"])
    assert not Execution.objects.exists()


def test_checkpoint__a_nul__refused_and_nothing_saved() -> None:
    execution = queued(progress={"done": 1})
    with pytest.raises(CheckpointInvalid, match="NUL"):
        run(execution, lambda: scheduler.current_execution().checkpoint({"cursor": f"a{NUL}b"}))
    assert fresh(execution).progress == {"done": 1}


def test_body__returns_a_nul__succeeded_with_it_replaced() -> None:
    execution = queued()
    run(execution, lambda: {f"k{NUL}": [f"a{NUL}b"]})
    done = fresh(execution)
    assert (done.status, done.result) == (Execution.Status.SUCCEEDED, {"k\ufffd": ["a\ufffdb"]})


def test_body__raises_with_a_nul__failed_with_it_replaced() -> None:
    def fail() -> Any:
        raise ValueError(f"bad{NUL}input")

    execution = queued()
    with pytest.raises(ValueError):
        run(execution, fail)
    done = fresh(execution)
    assert done.status == Execution.Status.FAILED
    assert done.error == "ValueError: bad\ufffdinput"
    assert NUL not in done.traceback and "bad\ufffdinput" in done.traceback


def test_plain_celery_call__a_nul_in_its_arguments__runs_as_sent_and_recorded_with_it_replaced() -> None:
    # When a guarded task is called the plain Celery way with a NUL in its arguments
    result = builtin_tasks.echo.apply(args=[f"a{NUL}b"], task_id="plain-call-with-a-nul")

    # Then the body got them as sent, and the call's record has each NUL replaced
    assert result.get() == {"args": [f"a{NUL}b"], "kwargs": {}}
    recorded = Execution.objects.get(celery_task_id="plain-call-with-a-nul")
    assert (recorded.status, recorded.args, recorded.result) == (
        Execution.Status.SUCCEEDED,
        ["a\ufffdb"],
        {"args": ["a\ufffdb"], "kwargs": {}},
    )


def test_body__returns_nan_and_infinity__succeeded_with_their_names() -> None:
    execution = queued()
    run(execution, lambda: {"rate": math.nan, "bounds": [-math.inf, math.inf], "n": 1.5})
    done = fresh(execution)
    assert (done.status, done.result) == (
        Execution.Status.SUCCEEDED,
        {"rate": "NaN", "bounds": ["-Infinity", "Infinity"], "n": 1.5},
    )


def test_plain_celery_call__nan_in_its_arguments__runs_as_sent_and_recorded_by_name() -> None:
    result = builtin_tasks.echo.apply(kwargs={"rate": math.nan}, task_id="plain-call-with-nan")
    assert math.isnan(result.get()["kwargs"]["rate"])
    recorded = Execution.objects.get(celery_task_id="plain-call-with-nan")
    assert (recorded.status, recorded.kwargs) == (Execution.Status.SUCCEEDED, {"rate": "NaN"})


def test_body__returns_and_raises_with_a_lone_surrogate__recorded_with_it_replaced() -> None:
    returned = queued()
    run(returned, lambda: {"k": f"a{SURROGATE}b"})
    assert (fresh(returned).status, fresh(returned).result) == (Execution.Status.SUCCEEDED, {"k": "a\ufffdb"})

    def fail() -> Any:
        raise ValueError(f"bad{SURROGATE}")

    raised = queued()
    with pytest.raises(ValueError):
        run(raised, fail)
    assert (fresh(raised).status, fresh(raised).error) == (Execution.Status.FAILED, "ValueError: bad\ufffd")
