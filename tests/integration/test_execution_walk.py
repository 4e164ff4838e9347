"""One execution's walk from its slot to its final status: the modules it passes through, and no return trips.

A real execution, in this process: the leader's tick records it and
publishes it to the suite's Redis, then the guard runs it as a worker's
pool process would. A profiler notes every call that enters one module of
the package from another. The walk is the modules in the order the
execution first reaches them, leaving out the shared ground every layer
calls (settings, clocks, shards, tracing, logs, failpoints, the models) and
the fast paths, which are the owners' SQL and the outbox's wire. A return
trip is a call into a module that is already further down the stack: a
callback from a module back into one that called it.

docs/architecture.md writes this walk out; the test fails when the code and
the page part ways.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from scheduler import dbclock, timing
from scheduler import tasks as builtin_tasks
from scheduler.models import Execution, Schedule
from tests.support.factories import make_schedule
from tests.support.replicas import TICK_SLEEP, BeatReplica

pytestmark = pytest.mark.django_db(transaction=True)

#: The walk docs/architecture.md describes, in order.
WALK = [
    "scheduler.beat.dispatch",
    "scheduler.owners.work_rules",
    "scheduler.timing",
    "scheduler.owners.leases",
    "scheduler.owners.executions",
    "scheduler.owners.schedules",
    "scheduler.outbox",
    "scheduler.worker.task",
    "scheduler.worker.renewer",
]
SHARED_GROUND = (
    "scheduler.conf",
    "scheduler.clock",
    "scheduler.dbclock",
    "scheduler.shards",
    "scheduler.process_ids",
    "scheduler.tracing",
    "scheduler.logs",
    "scheduler.failpoints",
    "scheduler.session_limits",
    "scheduler.exceptions",
    "scheduler.limits",
    "scheduler.signals",
    "scheduler.models",
    "scheduler.fastpath",
)
#: Where the execution's path starts in the tick: the rest of a tick (holding the lease, housekeeping) is not about it.
ENTRIES = {"dispatch_due", "publish_pending"}
ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _module(frame: FrameType) -> str:
    name = frame.f_globals.get("__name__", "")
    if not name.startswith("scheduler.") or name.startswith(SHARED_GROUND) or name == builtin_tasks.__name__:
        return ""
    if frame.f_code.co_name == "__getattr__":  # a package's lazy name (scheduler.worker.ExecutionTask), not a step
        return ""
    return name


class Walk:
    """The modules reached, in order, and the return trips seen."""

    def __init__(self) -> None:
        self.modules: list[str] = []
        self.return_trips: list[str] = []

    def profiler(self, *, entries: set[str] | None) -> Callable[[FrameType, str, Any], None]:
        def profile(frame: FrameType, event: str, arg: Any) -> None:
            if event != "call":
                return
            callee = _module(frame)
            if not callee:
                return
            stack = []  # the walk's modules below this call, nearest first
            inside = entries is None
            back = frame.f_back
            while back is not None:
                inside = inside or back.f_code.co_name in (entries or ())
                module = _module(back)
                if module and (not stack or stack[-1] != module):
                    stack.append(module)
                back = back.f_back
            if not inside and frame.f_code.co_name not in (entries or ()):
                return
            if stack and callee != stack[0] and callee in stack[1:]:
                self.return_trips.append(f"{stack[0]} -> {callee}.{frame.f_code.co_name}")
            if callee not in self.modules:
                self.modules.append(callee)

        return profile

    @contextmanager
    def following(self, *, entries: set[str] | None) -> Iterator[None]:
        sys.setprofile(self.profiler(entries=entries))
        try:
            yield
        finally:
            sys.setprofile(None)


def documented_walk() -> list[str]:
    """The modules the architecture page's walk names, in order (its numbered list, first module of each line)."""
    text = ARCHITECTURE.read_text()
    section = text.split("## One execution's walk", 1)[1].split("\n## ", 1)[0]
    paths = re.findall(r"^\d+\. `(scheduler/[\w/]+\.py)`", section, flags=re.M)
    return [path.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for path in paths]


def test_one_execution_walks_through_the_documented_modules_with_no_return_trip(
    beat_replica: BeatReplica, settings: Any
) -> None:
    # Given a leader holding the lease and a schedule due now
    settings.SCHEDULER_CLAIM_RENEW_SECONDS = 3600  # the guard's renewer thread would add its own calls
    make_schedule("walk", interval=60)
    # (its first slot an hour away, nothing is committed ahead of its instant either)
    Schedule.objects.update(next_run_at=dbclock.now() + timedelta(hours=1))
    beat = beat_replica(max_interval=TICK_SLEEP)  # a tick's sleep (PostgreSQL) is not the walk's
    walk = Walk()
    beat.tick()  # takes the lease; nothing is due yet
    Schedule.objects.update(next_run_at=dbclock.now().replace(second=0, microsecond=0))
    beat.leadership._last_renew = time.monotonic()  # type: ignore[attr-defined]  # no renewal inside the walk
    timing.zone_is_valid.cache_clear()  # the first execution of a process: what it checks once, it checks here

    # When the tick records and publishes it, and the guard runs it
    with walk.following(entries=ENTRIES):
        beat.tick()
    beat.close()
    execution = Execution.objects.get()
    assert execution.status == Execution.Status.QUEUED
    with walk.following(entries=None):
        builtin_tasks.echo.apply(
            args=execution.args,
            kwargs=execution.kwargs,
            task_id=execution.celery_task_id,
            headers={Execution.MESSAGE_HEADER: execution.pk},
            throw=True,
        )

    # Then it ended succeeded, through the documented modules, with no return trip
    execution.refresh_from_db()
    assert execution.status == Execution.Status.SUCCEEDED
    assert walk.modules == WALK, "\n".join(walk.modules)
    assert walk.return_trips == [], "\n".join(walk.return_trips)
    assert documented_walk() == ["scheduler.beat.scheduler", *WALK]


def test_a_call_back_into_a_module_down_the_stack_is_a_return_trip() -> None:
    # Given a function of one module that calls another module, which calls back into the first
    first: dict[str, Any] = {"__name__": "scheduler.first"}
    second: dict[str, Any] = {"__name__": "scheduler.second"}
    exec("def start(middle, back):\n    return middle(back)\n\ndef back():\n    return 1\n", first)
    exec("def middle(callback):\n    return callback()\n", second)
    walk = Walk()

    # When the walk is followed
    with walk.following(entries=None):
        first["start"](second["middle"], first["back"])

    # Then both modules are in it, and the call back is a return trip
    assert walk.modules == ["scheduler.first", "scheduler.second"]
    assert walk.return_trips == ["scheduler.second -> scheduler.first.back"]
