"""A minimal Celery app for the RedBeat peer in ``bench.failover``: one every-second task.

Runs in ``bench/.venv-peers`` (celery-redbeat is not a project dependency):
``celery -A bench.redbeat_app beat -S redbeat.RedBeatScheduler``. The broker
and RedBeat's store are ``$REDIS_URL``; ``$REDBEAT_LOCK_TIMEOUT`` (seconds),
when set, replaces RedBeat's default lock timeout (5 × the beat's loop interval).
Log records carry their Unix time (``%(created)``) so sends can be timed
across processes.
"""

from __future__ import annotations

import os

from celery import Celery

#: Name of the beat entry whose sends the benchmark counts.
ENTRY = "failover-every-1s"

app = Celery("redbeat_peer")
app.conf.update(
    broker_url=os.environ["REDIS_URL"],
    redbeat_redis_url=os.environ["REDIS_URL"],
    beat_schedule={ENTRY: {"task": "bench.noop_plain", "schedule": 1.0}},
    worker_log_format="[%(created).3f: %(levelname)s/%(processName)s] %(message)s",
    broker_connection_retry_on_startup=True,
)
if os.environ.get("REDBEAT_LOCK_TIMEOUT"):
    app.conf.redbeat_lock_timeout = int(os.environ["REDBEAT_LOCK_TIMEOUT"])
