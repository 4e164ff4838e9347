"""The API's views: schedules, executions, audit events, cluster, reconcile and stats.

Every queryset is scoped to the caller's tenant first, so another tenant's
object answers 404 everywhere, actions included. Writes go through
``scheduler.ops.operations`` (as in the admin and the CLI) and each leaves an
``AuditEvent`` in the same transaction; a backfill and a reconcile, many
transactions each, commit theirs before the work and complete it after.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any, TypeVar
from zoneinfo import ZoneInfo

from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction
from django.db.models import Count, Min, Q, QuerySet
from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework import exceptions, mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.generics import get_object_or_404
from rest_framework.pagination import Cursor, CursorPagination, PageNumberPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer
from rest_framework.views import APIView

from scheduler import dbclock, limits, task_policy, timing
from scheduler.celery_app import celery_app
from scheduler.conf import settings
from scheduler.exceptions import BackfillRefused, BackfillTooLarge, ScheduleInvalid, TaskRefused
from scheduler.models import AuditEvent, Calendar, Execution, Lease, NotificationTarget, PauseRule, Schedule
from scheduler.ops import audit, bulk, cluster, operations
from scheduler.web.api import serializers as s
from scheduler.web.api.authentication import caller
from scheduler.web.api.filters import AuditEventFilter, ExecutionFilter, ScheduleFilter
from scheduler.web.api.permissions import HasRole, Unscoped
from scheduler.web.api.policies import OwnPolicies, extend_schema

_QS = TypeVar("_QS", bound=QuerySet[Any])

#: Executions whose dispatch lag ``stats`` summarises, newest first.
LAG_SAMPLE = 10_000
#: ``stats`` window when none is given.
DEFAULT_WINDOW = timedelta(hours=24)

IF_MATCH = OpenApiParameter(
    "If-Match",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    description="The ETag of the schedule as read; a schedule changed since answers 412 and is not changed.",
)


class Refused(exceptions.APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_detail = "The action was refused."
    default_code = "refused"


class PreconditionFailed(exceptions.APIException):
    status_code = status.HTTP_412_PRECONDITION_FAILED
    default_detail = "The schedule changed since you read it (its ETag differs): read it again, then retry."
    default_code = "precondition_failed"


class Pages(PageNumberPagination):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500


class NewestFirst(CursorPagination):
    """Stable pages over a table that grows while it is read: newest first, by id."""

    ordering = ("-id",)
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500

    def decode_cursor(self, request: Request) -> Cursor | None:
        cursor = super().decode_cursor(request)
        # DRF checks a cursor's offset, not its position, and the caller writes both (base64 of a query
        # string): a position that is no id would reach the id lookup and fail there, a 500.
        if cursor is not None and cursor.position is not None and not limits.is_key_text(str(cursor.position)):
            raise exceptions.NotFound(self.invalid_cursor_message)
        return cursor


def scoped(queryset: _QS, request: Request) -> _QS:
    """Return ``queryset`` narrowed to the caller's scope (all rows for an unscoped caller, none for an unbound one)."""
    return caller(request).scope.filter(queryset)


def ensure_task_allowed(request: Request, task: str, *, tenant: str) -> None:
    """Answer 400 with a field error on ``task`` unless the caller may run ``task`` for a row of ``tenant``."""
    try:
        task_policy.ensure_scope_allows(task, tenant=tenant, scope=caller(request).scope)
    except TaskRefused as exc:
        raise exceptions.ValidationError({"task": [str(exc)]}) from None


#: The fields a write of the API changes (the serializer's writable ones, the actions' enabled and paused_reason).
_EDITABLE = tuple(name for name, field in s.ScheduleSerializer().fields.items() if not field.read_only)


def etag(schedule: Schedule) -> str:
    """Return the version of what an operator can change of ``schedule`` (its writable fields) as a strong ETag.

    Not its runs: the workers count those into the row all the time, and an
    every-second schedule would never match the version its editor read.
    """
    state = {name: getattr(schedule, name) for name in _EDITABLE}
    stamp = f"{schedule.pk}:{json.dumps(state, sort_keys=True, cls=DjangoJSONEncoder)}"
    return '"' + hashlib.sha256(stamp.encode()).hexdigest()[:20] + '"'


def _matches(header: str, current: str) -> bool:
    tags = [tag.strip().removeprefix("W/") for tag in header.split(",")]
    return "*" in tags or current in tags


class ScopedViewSet(OwnPolicies, viewsets.GenericViewSet):
    permission_classes = (HasRole,)
    filter_backends = (DjangoFilterBackend,)

    def get_queryset(self) -> QuerySet[Any]:
        return scoped(super().get_queryset(), self.request)

    def locked(self) -> Any:
        """Return the row of the URL with its lock held until the transaction ends (404 if not visible).

        A change read from the row as stored under its lock writes back
        nothing another caller changed meanwhile.
        """
        return get_object_or_404(self.get_queryset().select_for_update(), pk=self.kwargs["pk"])


@extend_schema(tags=["schedules"])
class ScheduleViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    ScopedViewSet,
):
    """Schedules of the caller's tenant: CRUD, the operator actions, upcoming fire times and backfill."""

    queryset = Schedule.objects.order_by("name")
    serializer_class = s.ScheduleSerializer
    filterset_class = ScheduleFilter
    pagination_class = Pages
    # Partial updates only: a PUT would reset every field left out.
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        schedule = self.get_object()
        return Response(self.get_serializer(schedule).data, headers={"ETag": etag(schedule)})

    def perform_create(self, serializer: BaseSerializer[Any]) -> None:
        serializer.save()  # audited by the serializer's action

    @extend_schema(parameters=[IF_MATCH], responses={200: s.ScheduleSerializer, 412: s.ErrorSerializer})
    def partial_update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Change the given fields. With ``If-Match``, only if the schedule is still the version read.

        The ETag is compared and the change written in one transaction with
        the row locked, so of two writers holding the same ETag one wins and
        the other gets 412.
        """
        with transaction.atomic():
            schedule = self.locked()
            expected = request.headers.get("If-Match")
            if expected is not None and not _matches(expected, etag(schedule)):
                raise PreconditionFailed()
            serializer = self.get_serializer(schedule, data=request.data, partial=True)
            serializer.is_valid(raise_exception=True)
            schedule = serializer.save()
        return Response(self.get_serializer(schedule).data, headers={"ETag": etag(schedule)})

    def perform_destroy(self, instance: Schedule) -> None:
        operations.delete_schedule(instance, actor=caller(self.request).actor)

    def _change(
        self,
        request: Request,
        change: Callable[[Schedule, audit.Actor, datetime], None],
        *,
        runs: bool = False,
    ) -> Response:
        """Apply ``change`` (an action, given who acts and now) to the locked schedule; ``runs``: it lets the schedule fire."""
        with transaction.atomic():
            schedule = self.locked()
            if runs:
                ensure_task_allowed(request, schedule.task, tenant=schedule.tenant)
            change(schedule, caller(request).actor, dbclock.now())
        return Response(self.get_serializer(schedule).data, headers={"ETag": etag(schedule)})

    @extend_schema(request=s.PauseSerializer, responses=s.ScheduleSerializer)
    @action(detail=True, methods=["post"])
    def pause(self, request: Request, pk: str) -> Response:
        """Pause with a reason; slots that fall in the pause are not owed later."""
        params = s.PauseSerializer(data=request.data)
        params.is_valid(raise_exception=True)
        reason = params.validated_data["reason"].strip() or f"Paused by {caller(request).actor.name} through the API"
        return self._change(
            request, lambda schedule, actor, now: operations.pause_schedule(schedule, reason, actor=actor, now=now)
        )

    @extend_schema(request=None, responses=s.ScheduleSerializer)
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, pk: str) -> Response:
        """Resume from the next slot after now; reset the failure count."""
        return self._change(
            request, lambda schedule, actor, now: operations.resume_schedule(schedule, actor=actor, now=now), runs=True
        )

    @extend_schema(request=None, responses=s.ScheduleSerializer)
    @action(detail=True, methods=["post"])
    def enable(self, request: Request, pk: str) -> Response:
        """Turn on; it fires from its next slot after now."""
        return self._change(
            request,
            lambda schedule, actor, now: operations.set_schedule_enabled(schedule, True, actor=actor, now=now),
            runs=True,
        )

    @extend_schema(request=None, responses=s.ScheduleSerializer)
    @action(detail=True, methods=["post"])
    def disable(self, request: Request, pk: str) -> Response:
        """Turn off, keeping the history."""
        return self._change(
            request,
            lambda schedule, actor, now: operations.set_schedule_enabled(schedule, False, actor=actor, now=now),
        )

    @extend_schema(request=s.BulkRequestSerializer, responses=s.BulkReportSerializer)
    @action(detail=False, methods=["post"])
    def bulk(self, request: Request) -> Response:
        """Pause, resume, enable, disable or run now every schedule the filter matches, in batches.

        Only the caller's tenant's schedules are matched. ``dry_run`` (the
        default) counts what matches and what would change, and lists the
        first names; the action itself is audited as one operation.
        """
        params = s.BulkRequestSerializer(data=request.data)
        params.is_valid(raise_exception=True)
        options = params.validated_data
        try:
            report = operations.bulk_action(
                options["action"],
                bulk.Filter.from_mapping(dict(options["filter"])),
                app=celery_app(),
                scope=caller(request).scope,
                actor=caller(request).actor,
                reason=options["reason"],
                dry_run=options["dry_run"],
            )
        except bulk.BulkRefused as exc:
            raise exceptions.ValidationError({"filter": [str(exc)]}) from None
        return Response(s.BulkReportSerializer(asdict(report)).data)

    @extend_schema(request=s.RunNowRequestSerializer, responses={201: s.ActionResultSerializer})
    @action(detail=True, methods=["post"], url_path="run-now")
    def run_now(self, request: Request, pk: str) -> Response:
        """Record an execution for now, outside the timing, and send it once recorded.

        A body may override ``args``, ``kwargs``, ``queue`` and ``priority``
        for this run only; they are checked as the schedule's own values are.
        """
        schedule = self.get_object()
        params = s.RunNowRequestSerializer(data=request.data)
        params.is_valid(raise_exception=True)
        overrides = params.validated_data
        return _recorded(
            request, schedule, lambda source, **how: operations.run_now(source, overrides=overrides, **how)
        )

    @extend_schema(parameters=[s.NextQuerySerializer], responses=s.NextSerializer)
    @action(detail=True, methods=["get"])
    def next(self, request: Request, pk: str) -> Response:
        """The next ``n`` fire times, in UTC and in the schedule's zone."""
        schedule = self.get_object()
        params = s.NextQuerySerializer(data=request.query_params)
        params.is_valid(raise_exception=True)
        try:
            timing.validate_timezone(schedule.timezone)
        except ScheduleInvalid as exc:  # valid when saved, since dropped from the tzdata: the beat pauses it
            note = f"{exc}: the schedule does not fire until its timezone is corrected."
            return Response(s.NextSerializer({"times": [], "excluded": [], "note": note}).data)
        zone = ZoneInfo(schedule.timezone)
        count = params.validated_data["n"]
        times = schedule.next_fire_times(count, after=dbclock.now())
        kept_out = [
            (t, calendar)
            for t, calendar in schedule.preview_fire_times(count, after=dbclock.now())
            if calendar is not None and (not times or t < times[-1])
        ]
        note = (
            ""
            if schedule.enabled and not schedule.is_paused
            else "The schedule is off: it does not fire until turned on."
        )

        def local(moment: datetime) -> str:
            return moment.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S %Z")

        data = {
            "times": [{"utc": t, "local": local(t)} for t in times],
            "excluded": [{"utc": t, "local": local(t), "calendar": calendar} for t, calendar in kept_out],
            "note": note,
        }
        return Response(s.NextSerializer(data).data)

    @extend_schema(request=s.BackfillRequestSerializer, responses=s.BackfillReportSerializer)
    @action(detail=True, methods=["post"])
    def backfill(self, request: Request, pk: str) -> Response:
        """Preview (``dry_run``, the default) or record one execution per past slot in [start, end] that has none."""
        schedule = self.get_object()
        ensure_task_allowed(request, schedule.task, tenant=schedule.tenant)
        params = s.BackfillRequestSerializer(data=request.data)
        params.is_valid(raise_exception=True)
        options = params.validated_data
        try:
            report = operations.backfill_range(
                schedule,
                actor=caller(request).actor,
                start=options["start"],
                end=options["end"],
                dry_run=options["dry_run"],
                limit=options["limit"],
                app=celery_app(),
            )
        except BackfillTooLarge as exc:
            raise exceptions.ValidationError({"end": [str(exc)]}) from None
        except BackfillRefused as exc:
            raise Refused(str(exc)) from None
        return Response(s.BackfillReportSerializer(asdict(report)).data)


def _action_result(result: operations.ActionResult) -> dict[str, Any]:
    # Not asdict(): it would deep-copy the Execution the serializer reads.
    return {"execution": result.execution, "broker_error": result.broker_error}


def _recorded(request: Request, source: Any, action: Callable[..., operations.ActionResult]) -> Response:
    """Take ``action`` (run now, retry) on ``source``, a schedule or an execution; answer 201 with what it recorded."""
    ensure_task_allowed(request, source.task, tenant=source.tenant)
    try:
        result = action(source, app=celery_app(), scope=caller(request).scope, actor=caller(request).actor)
    except operations.ActionRefused as exc:
        raise Refused(str(exc)) from None
    except DjangoValidationError as exc:
        raise s.drf_errors(exc) from None
    return Response(s.ActionResultSerializer(_action_result(result)).data, status=status.HTTP_201_CREATED)


@extend_schema(tags=["pauses"])
class PauseViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ScopedViewSet):
    """The caller's tenant's pauses (every pause, for a caller of every tenant): create one to hold or drain work, delete it to resume.

    A pause of every tenant is a row of no tenant: like such schedules, only
    a caller of every tenant sees and lifts it (the admin's banner shows it
    to everyone whose work it holds).
    """

    queryset = PauseRule.objects.order_by("pk")
    serializer_class = s.PauseRuleSerializer

    @extend_schema(request=s.PauseRequestSerializer, responses={201: s.PauseResultSerializer})
    def create(self, request: Request) -> Response:
        """Hold (or drain) the work of a queue, tasks matching a pattern, a tenant, or everything."""
        params = s.PauseRequestSerializer(data=request.data)
        params.is_valid(raise_exception=True)
        try:
            result = operations.pause_work(
                actor=caller(request).actor, scope=caller(request).scope, **params.validated_data
            )
        except operations.ActionRefused as exc:
            raise Refused(str(exc)) from None
        except DjangoValidationError as exc:
            raise s.drf_errors(exc) from None
        data = {"rule": result.rule, "cancelled": result.cancelled}
        return Response(s.PauseResultSerializer(data).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: s.ResumeResultSerializer})
    def destroy(self, request: Request, pk: str) -> Response:
        """Lift the pause and send again what it held."""
        rule = self.get_object()
        sent = operations.resume_work(rule, actor=caller(request).actor, app=celery_app())
        return Response(s.ResumeResultSerializer({"resumed": rule.describe(), "sent": sent}).data)


@extend_schema(tags=["notifications"])
class NotificationTargetViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    ScopedViewSet,
):
    """Where notifications go: the caller's tenant's targets to read; only an operator of every tenant changes them.

    A webhook's URL is fetched from inside the deployer's network, so a
    caller bound to a tenant may not point one anywhere (as in the admin).
    Every change is audited; the secret is masked in the audit trail.
    """

    queryset = NotificationTarget.objects.order_by("tenant", "name")
    serializer_class = s.NotificationTargetSerializer
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_permissions(self) -> list[Any]:
        if self.request.method in ("GET", "HEAD", "OPTIONS"):
            return [HasRole()]
        return [HasRole(), Unscoped()]

    def perform_create(self, serializer: BaseSerializer[Any]) -> None:
        target = NotificationTarget(**serializer.validated_data)
        operations.save_target(target, actor=caller(self.request).actor)
        serializer.instance = target

    def perform_update(self, serializer: BaseSerializer[Any]) -> None:
        with transaction.atomic():
            target: NotificationTarget = self.locked()
            for name, value in serializer.validated_data.items():
                setattr(target, name, value)
            operations.save_target(target, actor=caller(self.request).actor)
        serializer.instance = target

    def perform_destroy(self, instance: NotificationTarget) -> None:
        operations.delete_target(instance, actor=caller(self.request).actor)


@extend_schema(tags=["calendars"])
class CalendarViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    ScopedViewSet,
):
    """Calendars: the caller's tenant's and every tenant's to read; an operator keeps its own tenant's.

    Every change is audited. A calendar a schedule or another calendar names
    is not deleted: the refusal (400) names them.
    """

    queryset = Calendar.objects.order_by("tenant", "name")
    serializer_class = s.CalendarSerializer
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_queryset(self) -> QuerySet[Calendar]:
        scope = caller(self.request).scope
        rows = Calendar.objects.order_by("tenant", "name")
        if scope.every_tenant:
            return rows
        return rows.filter(Q(every_tenant=True) | Q(tenant=scope.tenant)) if scope.tenant else rows.none()

    def _keep(self, serializer: BaseSerializer[Any], calendar: Calendar) -> None:
        for name, value in serializer.validated_data.items():
            setattr(calendar, name, value)
        who = caller(self.request)
        try:
            operations.save_calendar(calendar, actor=who.actor, scope=who.scope)
        except operations.ActionRefused as exc:
            raise exceptions.PermissionDenied(str(exc)) from None
        except DjangoValidationError as exc:
            raise s.drf_errors(exc) from None
        serializer.instance = calendar

    def perform_create(self, serializer: BaseSerializer[Any]) -> None:
        self._keep(serializer, Calendar())

    def perform_update(self, serializer: BaseSerializer[Any]) -> None:
        with transaction.atomic():
            self._keep(serializer, self.locked())

    def perform_destroy(self, instance: Calendar) -> None:
        who = caller(self.request)
        if instance.every_tenant and not who.scope.every_tenant:
            raise exceptions.PermissionDenied("A calendar of every tenant is deleted by a user of every tenant only.")
        try:
            operations.delete_calendar(instance, actor=who.actor, scope=who.scope)
        except operations.ActionRefused as exc:
            raise Refused(str(exc)) from None


@extend_schema(tags=["executions"])
class ExecutionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ScopedViewSet):
    """Executions of the caller's tenant, newest first, and the retry and cancel actions."""

    queryset = Execution.objects.all()
    serializer_class = s.ExecutionSerializer
    filterset_class = ExecutionFilter
    pagination_class = NewestFirst

    @extend_schema(request=None, responses={201: s.ActionResultSerializer})
    @action(detail=True, methods=["post"])
    def retry(self, request: Request, pk: str) -> Response:
        """Record a new execution that re-runs this finished (or lost) one now."""
        return _recorded(request, self.get_object(), operations.retry_execution)

    @extend_schema(request=None, responses=s.ActionResultSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str) -> Response:
        """Cancel this waiting or running execution, then revoke its Celery task."""
        execution = self.get_object()
        try:
            result = operations.cancel_execution(execution, app=celery_app(), actor=caller(request).actor)
        except operations.ActionRefused as exc:
            raise Refused(str(exc)) from None
        return Response(s.ActionResultSerializer(_action_result(result)).data)


@extend_schema(tags=["audit"])
class AuditEventViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ScopedViewSet):
    """The audit trail of the caller's tenant, newest first; read-only."""

    queryset = AuditEvent.objects.all()
    serializer_class = s.AuditEventSerializer
    filterset_class = AuditEventFilter
    pagination_class = NewestFirst


@extend_schema(tags=["cluster"], responses=s.ClusterSerializer)
class ClusterView(OwnPolicies, APIView):
    """Leases (one, or one per shard), who holds them, and every instance's heartbeat."""

    permission_classes = (HasRole,)

    def get(self, request: Request) -> Response:
        now = dbclock.now()
        rows = list(Lease.objects.order_by("name"))
        for lease in rows:
            expires_at = lease.expires_at
            lease.held = bool(lease.holder) and expires_at is not None and expires_at > now
            lease.seconds_left = (expires_at - now).total_seconds() if expires_at is not None and lease.held else None
        members = cluster.members(leaders={lease.holder for lease in rows if lease.held}, now=now)
        instances = [
            {
                **{
                    field: getattr(m.instance, field)
                    for field in ("instance_id", "role", "hostname", "pid", "version", "started_at", "last_seen")
                },
                "is_leader": m.is_leader,
                "heartbeat_age_seconds": m.age,
                "is_stale": m.is_stale,
            }
            for m in members
        ]
        shards = sum(1 for lease in rows if lease.name.startswith(f"{settings.LEASE_NAME}:"))
        data = {"db_now": now, "shards": shards, "leases": rows, "instances": instances}
        return Response(s.ClusterSerializer(data).data)


@extend_schema(tags=["reconcile"], request=s.ReconcileRequestSerializer, responses=s.ReconcileReportSerializer)
class ReconcileView(OwnPolicies, APIView):
    """Run one reconcile pass; a dry run unless ``{"dry_run": false}``. It touches every tenant."""

    permission_classes = (HasRole, Unscoped)

    def post(self, request: Request) -> Response:
        params = s.ReconcileRequestSerializer(data=request.data)
        params.is_valid(raise_exception=True)
        options = params.validated_data
        report = operations.reconcile_pass(
            actor=caller(request).actor, dry_run=options["dry_run"], repair=options["repair"], app=celery_app()
        )
        return Response(s.ReconcileReportSerializer({**report.as_dict(), "summary": report.summary()}).data)


@extend_schema(tags=["stats"], parameters=[s.StatsQuerySerializer], responses=s.StatsSerializer)
class StatsView(OwnPolicies, APIView):
    """Executions by status in a window (by slot time), dispatch lag, and the backlog now."""

    permission_classes = (HasRole,)

    def get(self, request: Request) -> Response:
        params = s.StatsQuerySerializer(data=request.query_params)
        params.is_valid(raise_exception=True)
        options = params.validated_data
        now = dbclock.now()
        until = options.get("until") or now
        since = options.get("since") or until - DEFAULT_WINDOW
        executions = scoped(Execution.objects.all(), request)
        schedules = scoped(Schedule.objects.all(), request)
        if "schedule" in options:
            schedules = schedules.filter(pk=options["schedule"])
            if not schedules.exists():
                raise exceptions.NotFound("No such schedule.")
            executions = executions.filter(schedule_id=options["schedule"])
        for field in ("queue", "task"):
            if field in options:
                executions = executions.filter(**{field: options[field]})
                schedules = schedules.filter(**{field: options[field]})
        window = executions.filter(scheduled_for__gte=since, scheduled_for__lt=until)
        by_status = dict(window.order_by().values_list("status").annotate(n=Count("id")))
        lags = sorted(
            (sent - slot).total_seconds()
            for slot, sent in window.filter(enqueued_at__isnull=False)
            .order_by("-scheduled_for")
            .values_list("scheduled_for", "enqueued_at")[:LAG_SAMPLE]
        )
        oldest = executions.filter(status=Execution.Status.QUEUED).aggregate(at=Min("enqueued_at"))["at"]
        data = {
            "since": since,
            "until": until,
            "by_status": by_status,
            "dispatch_lag": {
                "count": len(lags),
                "p50_seconds": _quantile(lags, 0.5),
                "p95_seconds": _quantile(lags, 0.95),
                "max_seconds": lags[-1] if lags else None,
            },
            "backlog": {
                "due_schedules": schedules.due(now=now).count(),
                "pending": executions.filter(status=Execution.Status.PENDING).count(),
                "queued": executions.filter(status=Execution.Status.QUEUED).count(),
                "oldest_queued_age_seconds": (now - oldest).total_seconds() if oldest else None,
            },
        }
        return Response(s.StatsSerializer(data).data)


def _quantile(ordered: list[float], q: float) -> float | None:
    """Return the ``q`` quantile of an ascending list (nearest rank), or None for none."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]
