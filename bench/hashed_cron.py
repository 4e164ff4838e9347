"""Hashed cron spread: how ``H`` spreads many schedules over their slots, against the same schedules without it.

For N schedules (default 1,000) named ``team/job-<n>``, each expression's
first slot after a fixed instant is computed as a schedule's timing computes
it (``scheduler.timing``, hashed from the schedule's tenant and name). Reported
per expression: the distinct slots used, the most schedules that share one,
and the least. No peer is compared: neither django-celery-beat nor
celery-redbeat accepts ``H``.

Run: ``python -m bench.hashed_cron [--schedules 1000]``. Writes ``bench/results/hashed_cron.json``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from datetime import datetime, timezone
from typing import Any

from bench.common import ROOT, machine
from scheduler import timing

#: (hashed expression, the expression every schedule would share without H)
EXPRESSIONS = (
    ("H * * * *", "0 * * * *"),
    ("H H * * *", "0 0 * * *"),
    ("H(0-29)/10 H(1-5) * * *", "0 1 * * *"),
)
AFTER = datetime(2026, 3, 2, tzinfo=timezone.utc)


def spread(expression: str, schedules: int) -> dict[str, Any]:
    """The first slot of each of ``schedules`` schedules of ``expression``, counted by slot."""
    counts = Counter(
        timing.next_slot(timing.Timing(cron=expression, hash_key=f"team/job-{n}"), after=AFTER)
        for n in range(schedules)
    )
    return {
        "expression": expression,
        "schedules": schedules,
        "distinct_slots": len(counts),
        "most_per_slot": max(counts.values()),
        "least_per_slot": min(counts.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=1000)
    options = parser.parse_args()
    rows = [spread(expression, options.schedules) for pair in EXPRESSIONS for expression in pair]
    print(f"{'expression':<26} {'schedules':>9} {'slots':>6} {'most/slot':>9} {'least/slot':>10}")
    for row in rows:
        print(
            f"{row['expression']:<26} {row['schedules']:>9} {row['distinct_slots']:>6} "
            f"{row['most_per_slot']:>9} {row['least_per_slot']:>10}"
        )
    result = {"machine": machine(), "after": AFTER.isoformat(), "rows": rows}
    path = ROOT / "bench" / "results" / "hashed_cron.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
