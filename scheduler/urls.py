"""The app's routes for a host to mount: ``path("scheduler/", include("scheduler.urls"))``.

The HTTP API and its schema under ``api/``, the probes (``healthz``,
``readyz``, ``leaderz``, ``healthz/schedules``) and Prometheus ``metrics``.
The admin pages come with the host's own ``admin.site.urls``.
"""

from __future__ import annotations

from django.urls import include, path

from scheduler.web import health, metrics

urlpatterns = [
    path("api/", include("scheduler.web.api.urls")),
    path("healthz", health.healthz, name="healthz"),
    path("healthz/schedules", health.schedules, name="healthz-schedules"),
    path("readyz", health.readyz, name="readyz"),
    path("leaderz", health.leaderz, name="leaderz"),
    path("metrics", metrics.metrics, name="metrics"),
]
