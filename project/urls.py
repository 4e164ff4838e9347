"""URL routes: the admin, the health, readiness and leader probes, Prometheus metrics."""
from __future__ import annotations

from django.contrib import admin
from django.urls import path

from scheduler import health, metrics

urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("leaderz", health.leaderz, name="leaderz"),
    path("metrics", metrics.metrics, name="metrics"),
]
