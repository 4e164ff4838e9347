"""Routes of the API (``/api/v1/``), its OpenAPI schema (``/api/schema/``) and docs (``/api/docs/``)."""
from __future__ import annotations

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.permissions import AllowAny
from rest_framework.routers import SimpleRouter

from scheduler.api import views

router = SimpleRouter()
router.register("schedules", views.ScheduleViewSet, basename="schedule")
router.register("executions", views.ExecutionViewSet, basename="execution")
router.register("audit-events", views.AuditEventViewSet, basename="auditevent")

urlpatterns = [
    path("v1/", include(router.urls)),
    path("v1/cluster/", views.ClusterView.as_view(), name="api-cluster"),
    path("v1/reconcile/", views.ReconcileView.as_view(), name="api-reconcile"),
    path("v1/stats/", views.StatsView.as_view(), name="api-stats"),
    # Public: the schema describes the API, it holds no data.
    path("schema/", SpectacularAPIView.as_view(permission_classes=[AllowAny]), name="api-schema"),
    path(
        "docs/",
        SpectacularSwaggerView.as_view(url_name="api-schema", permission_classes=[AllowAny]),
        name="api-docs",
    ),
]
