"""Settings for plain Celery beat in bench.end_to_end: the project's, with Celery's own scheduler.

``BENCH_PLAIN_TASKS`` entries of ``bench.noop_plain``, each a crontab for the
minute ``BENCH_PLAIN_DUE`` (ISO 8601, UTC), so all fall due at that instant.
"""

import os
from datetime import datetime

from celery.schedules import crontab

from project.settings import *  # noqa: F403

_due = datetime.fromisoformat(os.environ["BENCH_PLAIN_DUE"])
CELERY_BEAT_SCHEDULER = "celery.beat:PersistentScheduler"
CELERY_BEAT_SCHEDULE = {
    f"e2e-{number}": {"task": "bench.noop_plain", "schedule": crontab(minute=_due.minute, hour=_due.hour)}
    for number in range(int(os.environ["BENCH_PLAIN_TASKS"]))
}
# scheduler.E002 refuses any beat scheduler but the project's own; this one is the baseline.
SILENCED_SYSTEM_CHECKS = ["scheduler.E002"]
