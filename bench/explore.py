"""Fault exploration matrix: every failpoint × action in a small real cluster, against the guarantees.

For each failpoint of ``scheduler.failpoints`` and each action (crash,
freeze, error, delay) one scenario runs two beat replicas, two workers and
a handful of every-second schedules, lets one execution (or one commit, one
publish, one shard handover...) through the failpoint with that action, and
checks the invariants: one execution per slot, every execution final within
a bound after the fault, no body completing after its claim moved on,
Celery's stored result agreeing with each row, no on-time schedule stalled
past 2 × the lease TTL, leadership changing only
when the fault stopped a beat replica (``tests/support/explore.py`` says exactly how).

Run: ``python -m bench.explore [--database postgresql|sqlite] [--points NAME,...]
[--actions crash,...] [--fast] [--logs DIR]`` (``--markdown`` prints the stored matrix for docs/testing.md) (``make explore`` runs the
whole matrix on PostgreSQL). It starts its own PostgreSQL and Redis (SQLite:
a file in a temporary directory), prints one line per scenario as it ends,
then the matrix, and writes ``bench/results/explore.json``: per database,
one result per (failpoint, action), replacing the earlier result of the same
scenario and keeping the others. The processes' logs stay in ``--logs``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, django_env, migrate, table, write_results

RESULTS_NAME = "explore"


def _previous() -> dict[str, Any]:
    path = RESULTS_DIR / f"{RESULTS_NAME}.json"
    try:
        return json.loads(path.read_text()).get("databases", {})
    except (OSError, ValueError):
        return {}


def _save(database: str, results: list[dict[str, Any]], elapsed: float, explore: Any) -> Path:
    """Write the results of this run into ``explore.json``, over the earlier results of the same scenarios."""
    databases = _previous()
    earlier = {(r["point"], r["action"]): r for r in databases.get(database, {}).get("results", [])}
    earlier.update({(r["point"], r["action"]): r for r in results})
    order = {(point.name, action): n for n, (point, action) in enumerate(explore.scenarios())}
    merged = sorted(earlier.values(), key=lambda r: order.get((r["point"], r["action"]), len(order)))
    databases[database] = {
        "last_run_seconds": round(elapsed, 1),
        "last_run_scenarios": len(results),
        "passed": sum(1 for r in merged if r.get("passed")),
        "failed": sum(1 for r in merged if not r.get("passed")),
        "results": merged,
    }
    return write_results(
        RESULTS_NAME,
        {
            "settings": explore.SETTINGS,
            "fault_seconds": explore.FAULT_SECONDS,
            "final_bound_seconds": explore.FINAL_BOUND_SECONDS,
            "stall_bound_seconds": explore.STALL_BOUND_SECONDS,
            "databases": databases,
        },
    )


def markdown(databases: dict[str, Any]) -> str:
    """The stored matrix, one row per failpoint, one column per database and action: "ok 2.6" (seconds to final) or the failure."""
    actions = ("crash", "freeze", "error", "delay")
    by_point: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
    for database, stored in databases.items():
        for result in stored.get("results", []):
            by_point.setdefault(result["point"], {})[(database, result["action"])] = result
    columns = [(database, action) for database in databases for action in actions]
    lines = [
        "| failpoint | "
        + " | ".join(f"{'PG' if db == 'postgresql' else 'SQLite'} {action}" for db, action in columns)
        + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for point, results in by_point.items():
        cells = []
        for column in columns:
            result = results.get(column)
            if result is None:
                cells.append("")
            elif result.get("passed"):
                cells.append(f"ok {result['time_to_final']:.1f}")
            else:
                cells.append(
                    "**FAIL**: "
                    + ", ".join(
                        name
                        for name in ("slots", "final", "claims", "results", "stall", "leadership")
                        if not result.get(name)
                    )
                )
        lines.append(f"| `{point}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", choices=("postgresql", "sqlite"), default="postgresql")
    parser.add_argument("--points", default="", help="comma-separated failpoint names (default: all)")
    parser.add_argument("--actions", default="", help="comma-separated: crash, freeze, error, delay (default: all)")
    parser.add_argument("--fast", action="store_true", help="only the scenarios make test runs")
    parser.add_argument("--logs", default="", help="where the processes' logs go (default: a new temporary directory)")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the stored matrix as a Markdown table (docs/testing.md); run nothing",
    )
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(_previous()))
        return 0
    # SIGTERM becomes SystemExit, so the scenario's processes and the services are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    from tests.support.services import postgres_cluster, redis_server

    logs = Path(args.logs or tempfile.mkdtemp(prefix="explore-"))
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        redis_url = stack.enter_context(redis_server())
        if args.database == "postgresql":
            database_url = stack.enter_context(postgres_cluster())
        else:
            database_url = f"sqlite:///{logs / 'explore.sqlite3'}"
        env = django_env(database_url, redis_url, logs)
        migrate(env)
        os.environ.update(env)
        import django

        django.setup()
        from tests.support import explore

        chosen = explore.scenarios(
            [name for name in args.points.split(",") if name], [name for name in args.actions.split(",") if name]
        )
        if args.fast:
            chosen = [(point, action) for point, action in chosen if (point.name, action) in explore.FAST]
        print(f"{len(chosen)} scenario(s) on {args.database}; logs in {logs}", flush=True)
        for n, (point, action) in enumerate(chosen, 1):
            result = explore.run(point, action, env=env, workdir=logs)
            results.append(result)
            verdict = "passed" if result["passed"] else "FAILED: " + "; ".join(result["failures"])
            print(f"[{n}/{len(chosen)}] {point.name} {action}: {verdict} ({result['scenario_seconds']}s)", flush=True)
            _save(args.database, results, time.monotonic() - started, explore)
    elapsed = time.monotonic() - started
    _save(args.database, results, elapsed, explore)
    print()
    print(table(explore.HEADERS, [explore.row(result) for result in results]))
    passed = sum(1 for result in results if result["passed"])
    print(f"\n{passed}/{len(results)} scenarios passed on {args.database} in {elapsed / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
