"""App configuration for the scheduler."""
from __future__ import annotations

from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    name = "scheduler"
    verbose_name = "Scheduler"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from scheduler import receivers  # noqa: F401 -- connects the Celery signal receivers
