"""A host's Celery app that guards no task by default (no ``task_cls``): only tasks with ``base=ExecutionTask`` are.

``tests/acceptance/test_guard_per_task.py`` runs a worker of it.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("plain")
app.config_from_object("django.conf:settings", namespace="CELERY")
