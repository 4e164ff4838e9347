"""Django's admin autodiscovery imports ``<app>.admin``: the pages live in ``scheduler.web.admin``."""

from scheduler.web import admin, notification_admin, pause_admin, rule_admin  # noqa: F401
