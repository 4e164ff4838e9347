"""The Celery app the admin, the API, the probes and the commands send through.

Code that runs inside a worker or a beat is handed its app by Celery (the
task's ``self.app``, the scheduler's ``self.app``). Web and command processes
are not: they use the app named by ``SCHEDULER_CELERY_APP`` (``"mysite.celery:app"``
or ``"mysite.celery.app"``) when it is set, else Celery's current app. In a
Django project that is the app ``mysite/celery.py`` creates (Celery's Django
fix-up makes the first app the default in every thread), so the setting is
needed only when a process holds more than one app.
"""

from __future__ import annotations

from celery import Celery, current_app
from django.core.exceptions import ImproperlyConfigured
from kombu.utils.imports import symbol_by_name

from scheduler.conf import settings


def celery_app() -> Celery:
    """The host's Celery app: ``SCHEDULER_CELERY_APP`` if set, else ``celery.current_app``."""
    path = settings.CELERY_APP
    if not path:
        # current_app is a proxy; celery-types declares it as the Celery app itself.
        app: Celery = current_app._get_current_object()  # type: ignore[attr-defined]
        return app
    try:
        named = symbol_by_name(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ImproperlyConfigured(f"SCHEDULER_CELERY_APP = {path!r} names no importable object: {exc}") from None
    if not isinstance(named, Celery):
        raise ImproperlyConfigured(f"SCHEDULER_CELERY_APP = {path!r} is a {type(named).__name__}, not a Celery app")
    return named
