"""URL routes: the admin, and the scheduler's HTTP API, probes and metrics at the root (``scheduler.urls``)."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("scheduler.urls")),
]
