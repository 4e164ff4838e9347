"""Routes of the API (``/api/v1/``), its OpenAPI schema (``/api/schema/``) and docs (``/api/docs/``)."""

from __future__ import annotations

from typing import Any

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.permissions import AllowAny
from rest_framework.routers import SimpleRouter

from scheduler.web.api import views
from scheduler.web.api.policies import OwnSchemaGenerator

#: The schema and its docs page are public (the schema describes the API, it holds no data), and
#: set their own policies, whatever the host's REST_FRAMEWORK says (scheduler.web.api.policies).
PUBLIC: dict[str, Any] = {"permission_classes": [AllowAny], "authentication_classes": [], "versioning_class": None}

router = SimpleRouter()
router.register("schedules", views.ScheduleViewSet, basename="schedule")
router.register("executions", views.ExecutionViewSet, basename="execution")
router.register("audit-events", views.AuditEventViewSet, basename="auditevent")
router.register("calendars", views.CalendarViewSet, basename="calendar")
router.register("pauses", views.PauseViewSet, basename="pause")
router.register("notification-targets", views.NotificationTargetViewSet, basename="notificationtarget")

urlpatterns = [
    path("v1/", include(router.urls)),
    path("v1/cluster/", views.ClusterView.as_view(), name="api-cluster"),
    path("v1/reconcile/", views.ReconcileView.as_view(), name="api-reconcile"),
    path("v1/stats/", views.StatsView.as_view(), name="api-stats"),
    path("schema/", SpectacularAPIView.as_view(generator_class=OwnSchemaGenerator, **PUBLIC), name="api-schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="api-schema", **PUBLIC), name="api-docs"),
]
