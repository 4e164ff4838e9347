"""The project's Celery app, configured from Django settings (``CELERY_`` namespace)."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

# Every task runs under the execution guard (claim once, time limits, retries).
app = Celery("project", task_cls="scheduler.worker:ExecutionTask")
app.config_from_object("django.conf:settings", namespace="CELERY")
# A worker's heartbeat is written only after its consumer received a probe it
# sent itself through the broker: this step consumes the probes (scheduler/worker/heartbeat.py).
app.steps["consumer"].add("scheduler.worker.heartbeat:ProbeConsumer")
app.autodiscover_tasks()
