"""App configuration for the scheduler."""

from __future__ import annotations

from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    name = "scheduler"
    verbose_name = "Scheduler"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created
        from django.db.models.signals import post_migrate

        # Imported for their side effects: registering checks and signal receivers.
        from scheduler import checks, tracing  # noqa: F401
        from scheduler.ops import access_audit
        from scheduler.session_limits import bound_idle_transactions
        from scheduler.web.permissions import ensure_groups
        from scheduler.worker import receivers  # noqa: F401

        # Users, groups, permissions and operator profiles, whoever changes them.
        access_audit.connect()

        # After every app's post_migrate (the permissions exist by then).
        post_migrate.connect(ensure_groups, dispatch_uid="scheduler.ensure_groups")
        # Every PostgreSQL session, whatever the process: a frozen one holds no row for long.
        connection_created.connect(bound_idle_transactions, dispatch_uid="scheduler.session_limits.idle_transactions")
        tracing.setup()  # off unless OTEL_TRACES_EXPORTER names an exporter
