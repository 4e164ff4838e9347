"""OpenTelemetry traces from real processes: one trace from the beat's tick to the worker's outcome.

The processes run with ``OTEL_TRACES_EXPORTER=console``, which prints one
JSON object per span and line; the tests read them back from the logs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

import scheduler
from scheduler.models import Execution
from scheduler.owners import schedules
from tests.support import tasks as test_tasks
from tests.support.processes import ROOT, CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

#: A parent span of the caller, as a client sends it in ``traceparent``.
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def process_env(process_env: dict[str, str]) -> dict[str, str]:
    # Export within a tenth of a second, so a test never waits on the batch delay.
    return {**process_env, "OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"}


def spans_in(text: str) -> list[dict[str, Any]]:
    """Return the spans the console exporter printed in ``text`` (one JSON object per line)."""
    spans = []
    for line in text.splitlines():
        if line.startswith('{"name"'):
            spans.append(json.loads(line))
    return spans


def by_id(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {span["context"]["span_id"]: span for span in spans}


def ancestry(span: dict[str, Any], spans: dict[str, dict[str, Any]]) -> list[str]:
    """Return the names from ``span`` up to its trace's root (as far as the spans given reach)."""
    names = [span["name"]]
    while span["parent_id"] is not None and span["parent_id"] in spans:
        span = spans[span["parent_id"]]
        names.append(span["name"])
    return names


def finish_of(spans: list[dict[str, Any]], execution_id: int) -> dict[str, Any] | None:
    return next(
        (
            s
            for s in spans
            if s["name"] == "scheduler.finish" and s["attributes"].get("scheduler.execution.id") == execution_id
        ),
        None,
    )


def test_tracing__one_trace_links_tick_to_finish_for_a_slot(celery_processes: Callable[..., CeleryProcess]) -> None:
    # Given a schedule of a tenant, a beat and a worker that trace to the console
    schedules.create(name="traced", task="scheduler.echo", interval=1, tenant="team-a")
    beat = celery_processes("beat", "beat1")
    worker = celery_processes("worker", "worker1")

    # When a slot has run and its outcome is recorded
    assert wait_until(lambda: Execution.objects.filter(status=Execution.Status.SUCCEEDED).exists(), timeout=60), (
        beat.log()[-3000:] + worker.log()[-3000:]
    )
    execution = Execution.objects.filter(status=Execution.Status.SUCCEEDED).order_by("id").first()

    def chain() -> tuple[list[str], list[dict[str, Any]], dict[str, Any] | None]:
        """Return the finish span's ancestry, its trace's spans and the finish span, as exported so far."""
        everything = spans_in(beat.log()) + spans_in(worker.log())
        finish = finish_of(everything, execution.pk)
        if finish is None:
            return [], [], None
        trace = [s for s in everything if s["context"]["trace_id"] == finish["context"]["trace_id"]]
        return ancestry(finish, by_id(trace)), trace, finish

    # Then one trace holds its tick, commit, publish, claim, run and finish, each the child of the one before
    expected_chain = [
        "scheduler.finish",
        "run/scheduler.echo",
        "scheduler.publish",
        "scheduler.dispatch.commit",
        "scheduler.tick",
    ]
    assert wait_until(lambda: chain()[0] == expected_chain, timeout=30), (chain()[0], worker.log()[-3000:])
    _, trace, finish = chain()
    spans = by_id(trace)
    task_run = spans[finish["parent_id"]]
    publish = spans[task_run["parent_id"]]
    commit = spans[publish["parent_id"]]
    below_task_run = {s["name"]: s for s in trace if s["parent_id"] == task_run["context"]["span_id"]}
    assert set(below_task_run) == {"scheduler.claim", "scheduler.run", "scheduler.finish"}

    # And each carries the scheduler's attributes
    named = {name: span["attributes"] for name, span in below_task_run.items()}
    named |= {s["name"]: s["attributes"] for s in (publish, commit, spans[commit["parent_id"]])}
    lease_token = named["scheduler.dispatch.commit"]["scheduler.lease.token"]
    assert named["scheduler.tick"]["scheduler.instance.id"]
    assert named["scheduler.tick"]["scheduler.lease.name"] == "beat"
    assert named["scheduler.dispatch.commit"]["scheduler.lease.name"] == "beat"
    slot = execution.scheduled_for.isoformat()
    expected = {
        "scheduler.execution.id": execution.pk,
        "scheduler.schedule.id": execution.schedule_id,
        "scheduler.schedule.name": "traced",
        "scheduler.slot": slot,
        "scheduler.tenant": "team-a",
    }
    assert named["scheduler.publish"] | expected == named["scheduler.publish"]
    assert named["scheduler.publish"]["scheduler.lease.token"] == lease_token
    assert named["scheduler.claim"] | expected == named["scheduler.claim"]
    assert named["scheduler.claim"]["scheduler.attempt"] == 1
    assert named["scheduler.claim"]["scheduler.worker"].startswith("worker1@")
    assert named["scheduler.run"]["scheduler.attempt"] == 1
    assert named["scheduler.finish"]["scheduler.status"] == "succeeded"
    assert named["scheduler.finish"]["scheduler.execution.id"] == execution.pk


def test_tracing__submit_in_a_request_continues_the_request_trace(
    celery_processes: Callable[..., CeleryProcess], process_env: dict[str, str]
) -> None:
    # Given a worker that traces, and a web request that carries its caller's traceparent
    worker = celery_processes("worker", "worker1")
    worker.wait_for_log("ready", timeout=60)

    # When the request's view calls submit()
    web = subprocess.run(
        [sys.executable, "-m", "tests.support.trace_request", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"],
        env=process_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert web.returncode == 0, web.stderr[-3000:]
    printed = re.search(r"^execution (\d+)$", web.stdout, re.MULTILINE)
    assert printed, web.stdout[-3000:]
    execution_id = int(printed[1])

    # Then the request's server span is the caller's child, and the publish hangs below it
    web_spans = [s for s in spans_in(web.stdout) if s["context"]["trace_id"] == f"0x{CALLER_TRACE}"]
    spans = by_id(web_spans)
    publish = next(s for s in web_spans if s["name"] == "scheduler.publish")
    assert publish["attributes"]["scheduler.execution.id"] == execution_id
    chain = [spans[span_id] for span_id in _parent_ids(publish, spans)]
    assert [s["name"] for s in chain] == ["scheduler.publish.batch", "POST submit"]
    assert chain[-1]["parent_id"] == f"0x{CALLER_SPAN}"

    # And the worker's run of that execution continues the same trace
    def finish_and_its_parent() -> bool:
        finish = finish_of(spans_in(worker.log()), execution_id)
        return finish is not None and finish["parent_id"] in by_id(spans_in(worker.log()))

    assert wait_until(finish_and_its_parent, timeout=60), worker.log()[-3000:]
    worker_spans = by_id(spans_in(worker.log()))
    finish = finish_of(list(worker_spans.values()), execution_id)
    assert finish["context"]["trace_id"] == f"0x{CALLER_TRACE}"
    run = worker_spans[finish["parent_id"]]
    assert run["name"] == "run/scheduler.echo" and run["parent_id"] == publish["context"]["span_id"]
    claim = next(
        s
        for s in worker_spans.values()
        if s["name"] == "scheduler.claim" and s["parent_id"] == run["context"]["span_id"]
    )
    assert claim["attributes"]["scheduler.tenant"] == "team-web"
    assert claim["attributes"]["scheduler.trigger"] == "submit"


def _parent_ids(span: dict[str, Any], spans: dict[str, dict[str, Any]]) -> list[str]:
    ids = []
    while span["parent_id"] in spans:
        ids.append(span["parent_id"])
        span = spans[span["parent_id"]]
    return ids


def test_tracing__retry__next_attempt_continues_the_trace(celery_processes: Callable[..., CeleryProcess]) -> None:
    # Given a worker that traces, and a task that fails its first attempt
    worker = celery_processes("worker", "worker1")
    worker.wait_for_log("ready", timeout=60)

    execution = scheduler.submit(test_tasks.flaky, args=["traced", 1], max_retries=1, retry_backoff=1)

    # When the second attempt succeeds
    def outcomes() -> dict[tuple[str, int], dict[str, Any]]:
        return {
            (s["name"], s["attributes"]["scheduler.attempt"]): s
            for s in spans_in(worker.log())
            if s["name"] in ("scheduler.retry", "scheduler.finish")
            and s["attributes"].get("scheduler.execution.id") == execution.pk
        }

    assert wait_until(lambda: ("scheduler.finish", 2) in outcomes(), timeout=60), worker.log()[-3000:]

    # Then the first attempt's retry and the second attempt's outcome are in one trace
    found = outcomes()
    assert found["scheduler.retry", 1]["context"]["trace_id"] == found["scheduler.finish", 2]["context"]["trace_id"]
    assert found["scheduler.finish", 2]["attributes"]["scheduler.status"] == "succeeded"
