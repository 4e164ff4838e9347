"""URL routes: the admin, the HTTP API, the health, readiness and leader probes, Prometheus metrics."""
from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from scheduler import health, metrics

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include("scheduler.api.urls")),
    path("healthz", health.healthz, name="healthz"),
    path("healthz/schedules", health.schedules, name="healthz-schedules"),
    path("readyz", health.readyz, name="readyz"),
    path("leaderz", health.leaderz, name="leaderz"),
    path("metrics", metrics.metrics, name="metrics"),
]
