"""With ``--json``, a command's error is JSON on stdout too, with the same exit status and stderr line."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable

import pytest

from scheduler.models import Schedule

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("argv", "returncode", "error"),
    [
        (["executions", "show", "999999", "--json"], 1, "No execution with id 999999"),
        (["schedules", "show", "missing", "--json"], 1, "No schedule named 'missing'"),
        (
            ["schedules", "create", "x", "--task", "scheduler.echo", "--at", "2020-01-01T00:00:00Z", "--json"],
            1,
            "The one-off time 2020-01-01 00:00:00 UTC is in the past",
        ),
        (
            ["schedules", "create", "x", "--task", "scheduler.echo", "--json"],
            2,
            "one of the arguments --cron --every --at --run-now is required",
        ),
        (["executions", "list", "--status", "nope", "--json"], 2, "argument --status: invalid choice: 'nope'"),
    ],
)
def test_json_errors__json_on_stdout_same_exit_status_and_stderr_line(
    manage: Callable[..., subprocess.CompletedProcess[str]], argv: list[str], returncode: int, error: str
) -> None:
    # When
    result = manage(*argv)
    # Then
    assert result.returncode == returncode, result.stderr
    printed = json.loads(result.stdout)
    assert list(printed) == ["error"] and error in printed["error"]
    assert not printed["error"].startswith(("CommandError", "manage.py"))
    assert len(result.stderr.splitlines()) == 1 and error in result.stderr and "Traceback" not in result.stderr
    assert not Schedule.objects.exists()


def test_json_errors__without_json_stdout_stays_empty(manage: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    result = manage("executions", "show", "999999")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == "CommandError: No execution with id 999999\n"


def test_json_errors__success_prints_only_the_result(manage: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    result = manage("schedules", "list", "--json")
    assert (result.returncode, json.loads(result.stdout), result.stderr) == (0, [], "")
