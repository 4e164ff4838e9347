"""Tracing overhead on the beat's tick: the hooks' cost with tracing off (the default) and on.

A tick that commits and publishes N executions passes through these hooks:
``tracing.span("scheduler.tick")`` once, the ``@tracing.traced`` commit and
publish-batch wrappers once each (per batch), ``tracing.created(rows)``
once per commit and ``tracing.message_headers(row)`` once per message. Each
is timed with ``timeit`` in a process of its own, per call and for a whole
tick of N executions, against the same work without the hook (a bare
function call, an empty block). "On" uses the console exporter writing to
/dev/null through the batch processor, as a deployment would (the export
itself runs on the processor's thread, outside the tick, but it takes
the GIL to encode each span), and with every span sampled out
(``OTEL_TRACES_SAMPLER=always_off``): the SDK's cost without the export.

Run: ``python -m bench.tracing_overhead [--executions 1000]``. Writes ``bench/results/tracing_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.common import ROOT, django_env, table, write_results

REPEAT = 5
#: Each run's OTEL_* environment.
VARIANTS = {
    "off (default)": {"OTEL_TRACES_EXPORTER": "none"},
    "on, every span sampled out": {"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "always_off"},
    "on, console to /dev/null": {"OTEL_TRACES_EXPORTER": "console"},
}


# --- inside the child process --------------------------------------------------------------


def _best(statement: Any, number: int) -> float:
    """Return the best of ``REPEAT`` runs, in microseconds per call."""
    return min(timeit.repeat(statement, number=number, repeat=REPEAT)) / number * 1e6


def _measure(executions: int) -> dict[str, float]:
    import django

    django.setup()
    from scheduler import tracing

    schedule = SimpleNamespace(name="bench")
    rows = [
        SimpleNamespace(
            celery_task_id=f"task-{i}", schedule_id=1, schedule=schedule, tenant="", lease_token=1, trigger="scheduled"
        )
        for i in range(executions)
    ]
    messages = [
        {"id": i, "celery_task_id": f"task-{i}", "schedule_id": 1, "scheduled_for": None, "task": "t"}
        for i in range(executions)
    ]
    fence = SimpleNamespace(name="beat", token=1)

    def bare(chunk: Any, *, fence: Any) -> None:
        return None

    traced = tracing.traced("scheduler.dispatch.commit", tracing.commit_attributes)(bare)

    def tick_span() -> None:
        with tracing.span("scheduler.tick", instance_id="bench", lease_name="beat", lease_token=1):
            pass

    def tick() -> None:
        # One tick's hooks for ``executions`` messages, in the order the beat runs them.
        with tracing.span("scheduler.tick", instance_id="bench", lease_name="beat", lease_token=1):
            with tracing.span("scheduler.dispatch.commit", lease_name="beat", lease_token=1):
                tracing.created(rows)
            for message in messages:
                tracing.message_headers(message)

    return {
        "tracing_enabled": tracing.enabled(),
        "empty_block_us": _best(lambda: None, 100_000),
        "tick_span_us": _best(tick_span, 100_000),
        "bare_call_us": _best(lambda: bare(rows, fence=fence), 100_000),
        "traced_call_us": _best(lambda: traced(rows, fence=fence), 100_000 if not tracing.enabled() else 10_000),
        "message_headers_us": _best(
            lambda: tracing.message_headers(messages[0]), 100_000 if not tracing.enabled() else 5_000
        ),
        "tick_hooks_us": _best(tick, 200 if not tracing.enabled() else 5),
    }


# --- the parent ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=1000, help="messages one tick commits and publishes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.child).write_text(json.dumps(_measure(args.executions)))
        return
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = django_env(f"sqlite:///{tmp}/bench.sqlite3", "redis://127.0.0.1:1/0", Path(tmp))
        for label, variables in VARIANTS.items():
            out = Path(tmp) / "result.json"
            env = {**base, **variables}
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.tracing_overhead",
                    "--executions",
                    str(args.executions),
                    "--child",
                    str(out),
                ],
                cwd=ROOT,
                env=env,
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            results[label] = json.loads(out.read_text())
    rows = [
        [
            label,
            r["tick_span_us"] - r["empty_block_us"],
            r["traced_call_us"] - r["bare_call_us"],
            r["message_headers_us"],
            r["tick_hooks_us"],
        ]
        for label, r in results.items()
    ]
    print(
        table(["tracing", "tick span µs", "traced wrapper µs", "per message µs", f"tick of {args.executions} µs"], rows)
    )
    print()
    write_results("tracing_overhead", {"executions_per_tick": args.executions, "results": results})


if __name__ == "__main__":
    main()
