"""Failpoints: the ``SCHEDULER_FAILPOINTS`` syntax, and each action in a process of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from scheduler import failpoints
from scheduler.failpoints import Action, parse
from tests.support.processes import process_state

ROOT = Path(__file__).resolve().parents[2]
#: Longest a child process of these tests may take (Python start-up and the action itself).
CHILD_TIMEOUT = 30


def run_child(code: str, failpoints_value: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python with ``SCHEDULER_FAILPOINTS`` set; return it finished."""
    child_env = {key: value for key, value in os.environ.items() if not key.startswith("SCHEDULER_FAILPOINTS")}
    child_env.update(SCHEDULER_FAILPOINTS=failpoints_value, **env)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=CHILD_TIMEOUT
    )


def hit_code(name: str, times: int = 1) -> str:
    """Code that hits ``name`` ``times`` times, printing what each hit did, then prints "done"."""
    return (
        "from scheduler.failpoints import failpoint\n"
        f"for n in range(1, {times} + 1):\n"
        "    try:\n"
        f"        failpoint({name!r})\n"
        "        print(n, 'passed', flush=True)\n"
        "    except Exception as exc:\n"
        "        print(n, type(exc).__module__ + '.' + type(exc).__name__, flush=True)\n"
        "print('done', flush=True)\n"
    )


# --- the syntax --------------------------------------------------------------------------------


def test_parse__every_action_with_its_seconds_and_hit() -> None:
    parsed = parse(
        " dispatch.commit.after_fence=crash; worker.after_body=freeze 40 ;publish.send=error@2;"
        "worker.renew = delay 0.5 @3;"
    )
    assert parsed == {
        "dispatch.commit.after_fence": Action("crash"),
        "worker.after_body": Action("freeze", 40.0),
        "publish.send": Action("error", hit=2),
        "worker.renew": Action("delay", 0.5, 3),
    }
    assert [str(action) for action in parsed.values()] == ["crash", "freeze 40", "error@2", "delay 0.5@3"]


def test_parse__empty_means_no_failpoint() -> None:
    assert parse("") == {} and parse(" ; ") == {}


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("dispatch.commit.after_fenc=crash", "unknown failpoint 'dispatch.commit.after_fenc'"),
        ("worker.after_body", "is not <name>=<action>"),
        ("worker.after_body=explode", "the action is one of"),
        ("worker.after_body=freeze", "freeze and delay take seconds"),
        ("worker.after_body=crash 3", "freeze and delay take seconds"),
        ("worker.after_body=delay -1", "the action is one of"),
        ("worker.after_body=crash@0", "counts hits from 1"),
    ],
)
def test_parse__refuses_what_would_inject_nothing(text: str, complaint: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=complaint):
        parse(text)


def test_a_malformed_variable_stops_the_process_at_import() -> None:
    child = run_child("import scheduler.failpoints", "worker.after_bdy=crash")
    assert child.returncode == 1
    assert "ImproperlyConfigured" in child.stderr and "unknown failpoint 'worker.after_bdy'" in child.stderr


def test_every_failpoint_names_the_peer_whose_error_it_raises() -> None:
    assert set(failpoints.POINTS.values()) == {failpoints.DATABASE, failpoints.BROKER, failpoints.OUTBOX}


def test_unset__failpoint_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failpoints, "_ACTIONS", {})
    assert failpoints.failpoint("worker.after_body") is None


# --- the actions, each in a process of its own --------------------------------------------------


def test_crash__the_process_dies_by_sigkill_at_the_failpoint() -> None:
    child = run_child(hit_code("worker.after_body"), "worker.after_body=crash")
    assert child.returncode == -signal.SIGKILL
    assert "passed" not in child.stdout and "done" not in child.stdout
    assert "failpoint worker.after_body: crash" in child.stderr


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("outcome.in_transaction", "django.db.utils.OperationalError"),
        ("publish.send", "kombu.exceptions.OperationalError"),
        ("reconcile.resend", "scheduler.exceptions.BrokerUnavailable"),
    ],
)
def test_error__raises_the_connection_error_of_the_failpoints_peer(name: str, error: str) -> None:
    child = run_child(hit_code(name), f"{name}=error")
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == [f"1 {error}", "done"]


def test_delay__sleeps_in_the_calling_thread_then_goes_on() -> None:
    code = (
        "import time\nstarted = time.monotonic()\n"
        + hit_code("worker.renew")
        + ("print(round(time.monotonic() - started, 2))\n")
    )
    child = run_child(code, "worker.renew=delay 0.6")
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert lines[:2] == ["1 passed", "done"]
    assert 0.6 <= float(lines[2]) < 5


def test_freeze__stops_the_whole_process_then_lets_it_go_on() -> None:
    # Given a process with a second thread that counts while it can run
    code = (
        "import threading, time\n"
        "ticks = []\n"
        "def count():\n"
        "    while True:\n"
        "        ticks.append(time.monotonic())\n"
        "        time.sleep(0.02)\n"
        "threading.Thread(target=count, daemon=True).start()\n"
        "time.sleep(0.2)\n"
        "print('freezing', flush=True)\n"
        + hit_code("dispatch.commit.after_fence")
        # the counting thread must run once after the freeze, or its last tick is the one before it
        + "time.sleep(0.1)\n"
        "gap = max(later - earlier for earlier, later in zip(ticks, ticks[1:]))\n"
        "print(round(gap, 2), flush=True)\n"
    )
    child_env = {key: value for key, value in os.environ.items() if not key.startswith("SCHEDULER_FAILPOINTS")}
    child_env["SCHEDULER_FAILPOINTS"] = "dispatch.commit.after_fence=freeze 1.5"
    process = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "freezing"
        # When it hits the failpoint, it is stopped (state T) ...
        deadline = time.monotonic() + 10
        while process_state(process.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert process_state(process.pid) == "T"
        # ... and then goes on by itself, its other thread stopped all along
        out, err = process.communicate(timeout=CHILD_TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    lines = out.splitlines()
    assert lines[:2] == ["1 passed", "done"]
    assert float(lines[2]) >= 1.4  # the counting thread froze too: not a sleep of one thread


def test_freeze__the_calling_thread_goes_no_further_than_the_failpoint_before_it_stops() -> None:
    # Given a process whose main thread sleeps (a body) while another thread hits the failpoint (the renewer):
    # a stop signal sent to the process may be taken by the main thread, and the calling thread, let run on
    # until that one stops it, would be frozen past the failpoint (in the next transaction, holding its locks).
    seconds = 0.05
    code = (
        "import threading, time\n"
        "from scheduler.failpoints import failpoint\n"
        "spans = []\n"
        "def hit():\n"
        "    for _ in range(15):\n"
        "        started = time.monotonic()\n"
        "        failpoint('worker.renew')\n"
        "        spans.append((started, time.monotonic()))\n"
        "thread = threading.Thread(target=hit)\n"
        "thread.start()\n"
        "while thread.is_alive():\n"
        "    time.sleep(0.01)\n"
        # Only the hits before any freeze's helper sends its late second SIGCONT (1 s on), which ends a freeze early.
        "print([round(end - started, 3) for started, end in spans if end < spans[0][0] + 1])\n"
    )
    child = run_child(code, f"worker.renew=freeze {seconds}")
    assert child.returncode == 0, child.stderr
    spans = json.loads(child.stdout.splitlines()[-1])
    assert spans
    assert min(spans) >= seconds, spans  # every hit returned only after the freeze


# --- hits ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("point", "times", "spec", "lines"),
    [
        (
            "publish.send",
            4,
            "publish.send=error@2",
            ["1 passed", "2 kombu.exceptions.OperationalError", "3 passed", "4 passed", "done"],
        ),
        (
            "worker.claim.before",
            2,
            "worker.claim.before=error",
            ["1 django.db.utils.OperationalError", "2 django.db.utils.OperationalError", "done"],
        ),
    ],
    ids=["at-k-fires-on-the-kth-hit-only", "without-at-k-fires-on-every-hit"],
)
def test_error__fires_on_the_hits_it_names(point: str, times: int, spec: str, lines: list[str]) -> None:
    child = run_child(hit_code(point, times=times), spec)
    assert child.stdout.splitlines() == lines


def test_shared_directory__counts_hits_across_processes_once_armed(tmp_path: Path) -> None:
    shared = {"SCHEDULER_FAILPOINTS_DIR": str(tmp_path)}
    # Given hits before the test arms the failpoint: not counted
    before = run_child(hit_code("reconcile.resend", times=2), "reconcile.resend=crash@2", **shared)
    assert before.stdout.splitlines() == ["1 passed", "2 passed", "done"]
    # When it is armed, the second hit in the cluster crashes (another process's), and only that one
    (tmp_path / "armed").touch()
    first = run_child(hit_code("reconcile.resend"), "reconcile.resend=crash@2", **shared)
    second = run_child(hit_code("reconcile.resend", times=2), "reconcile.resend=crash@2", **shared)
    third = run_child(hit_code("reconcile.resend"), "reconcile.resend=crash@2", **shared)
    assert (first.returncode, first.stdout.splitlines()) == (0, ["1 passed", "done"])
    assert second.returncode == -signal.SIGKILL and second.stdout == ""
    assert (third.returncode, third.stdout.splitlines()) == (0, ["1 passed", "done"])
    # Then the firing is recorded, with its process
    [fired] = [json.loads(line) for line in (tmp_path / "fired.jsonl").read_text().splitlines()]
    assert (fired["name"], fired["action"], fired["hit"], fired["pid"]) == (
        "reconcile.resend",
        "crash@2",
        2,
        second_pid(second),
    )


def second_pid(child: subprocess.CompletedProcess[str]) -> int:
    """The pid the failpoint logged (``subprocess.run`` does not keep it)."""
    marker = "pid "
    line = next(line for line in child.stderr.splitlines() if "failpoint reconcile.resend" in line)
    return int(line.rsplit(marker, 1)[1].rstrip(")"))
