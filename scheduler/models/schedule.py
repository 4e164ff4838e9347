"""Schedule: what should run and when, with its policies and running state."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, cast

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import connection, models, transaction
from django.db.models import BooleanField, ExpressionWrapper, F, Q
from django.db.models.functions import Now

from scheduler import limits, shards, timing
from scheduler.conf import settings
from scheduler.exceptions import ScheduleInvalid, ScheduleWriteRefused
from scheduler.timing import calendars

#: The one message for a schedule with no timing, or more than one.
TIMING_REQUIRED = "Set exactly one of cron, interval or run at."

#: Fields whose change means ``next_run_at`` must be recomputed.
TIMING_FIELDS = (
    "cron",
    "interval",
    "run_at",
    "timezone",
    "start_at",
    "end_at",
    "max_runs",
    "dst_gap",
    "dst_fold",
    "exclude_calendars",
    "only_calendar",
    "enabled",
    "paused_reason",
)
#: The policy fields, in the order the admin and the API show them.
POLICY_FIELDS = (
    "overlap",
    "catchup_window",
    "misfire",
    "jitter",
    "dst_gap",
    "dst_fold",
    "timeout",
    "max_retries",
    "retry_backoff",
    "pause_after_failures",
    "alert_after",
)
#: Celery's message options the executions of a schedule are sent with.
MESSAGE_OPTION_FIELDS = ("expires", "headers", "exchange", "routing_key")
#: Message headers Celery's protocol or this scheduler sets: a schedule's own may not name them.
RESERVED_HEADERS = frozenset(
    {
        "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries", "timelimit",
        "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result", "stamped_headers",
        "stamps", "replaced_task_nesting", "traceparent", "tracestate", "execution_id",
    }
)  # fmt: skip
#: Fields whose change moves the dead man's switch deadline (``overdue_at``).
DEADLINE_FIELDS = (*TIMING_FIELDS, "alert_after")
#: Timing fields whose edit starts the schedule afresh: slots before the edit are no longer owed.
OWED_FIELDS = ("cron", "interval", "run_at", "timezone", "start_at", "dst_gap", "dst_fold")

#: Largest value of each integer column type on PostgreSQL. SQLite stores more,
#: so ``clean()`` holds every database to the same bound.
COLUMN_MAX = {"PositiveIntegerField": limits.INTEGER_MAX, "PositiveSmallIntegerField": 32_767}

#: Times a schedule may name: nothing is scheduled before the Unix epoch, and
#: slot arithmetic near year 9999 overflows.
EARLIEST = datetime(1970, 1, 1, tzinfo=timezone.utc)
LATEST = datetime(9000, 1, 1, tzinfo=timezone.utc)


def integer_range(field_name: str) -> tuple[int, int]:
    """Return the lowest and highest value validation accepts for an integer field of Schedule."""
    field = cast("models.Field[Any, Any]", Schedule._meta.get_field(field_name))
    # Only the validators the field declares: `validators` adds the database column range.
    declared = field._validators  # type: ignore[attr-defined]  # noqa: SLF001 -- see above; not in the stubs
    lows = [validator.limit_value for validator in declared if isinstance(validator, MinValueValidator)]
    return max([0, *lows]), COLUMN_MAX[field.get_internal_type()]


def default_catchup_window() -> int:
    return settings.DEFAULT_CATCHUP_WINDOW_SECONDS


class ScheduleQuerySet(models.QuerySet):
    def active(self) -> ScheduleQuerySet:
        """Return schedules the beat may fire: enabled and not paused."""
        return self.filter(enabled=True, paused_reason="")

    def due(self, *, now: datetime) -> ScheduleQuerySet:
        """Return active schedules whose next slot is at or before ``now``, earliest first.

        Served by the partial index ``schedule_due`` in one index range scan.
        """
        return self.active().filter(next_run_at__lte=now).order_by("next_run_at", "id")

    def bulk_create(self, objs: Any, *args: Any, **kwargs: Any) -> list[Schedule]:
        """Insert as Django does, then put each new row in its shard (its id was unknown before)."""
        created = super().bulk_create(objs, *args, **kwargs)
        if shards.is_sharded():
            pks = [schedule.pk for schedule in created if schedule.pk is not None]
            self.filter(pk__in=pks).update(shard=F("id") % shards.count())
            for schedule in created:
                if schedule.pk is not None:
                    schedule.shard = shards.shard_of(schedule.pk)
        return created

    def delete(self) -> tuple[int, dict[str, int]]:
        """Delete as Django does, having locked the schedule rows first (in id order).

        Django's delete detaches the executions (``SET NULL``) before it
        deletes the schedules, which would lock executions before their
        schedule: the opposite of the lock order everything else follows
        (``scheduler.owners.executions``), a deadlock against a worker finishing a run.
        """
        # _fields: set by values()/values_list(), as Django's own delete() checks; not in the stubs.
        if self.query.is_sliced or self._fields is not None:  # type: ignore[attr-defined]
            return super().delete()  # which refuses it
        with transaction.atomic(using=self.db):
            locked = self.model._base_manager.using(self.db).select_for_update().filter(pk__in=self.values("pk"))
            list(locked.order_by("pk").values_list("pk", flat=True))
            return super().delete()

    delete.alters_data = True  # type: ignore[attr-defined]  # as Django marks QuerySet.delete
    delete.queryset_only = True  # type: ignore[attr-defined]  # not on the manager, as Django's

    def overdue(self, *, now: datetime | Now) -> ScheduleQuerySet:
        """Return active schedules without a success for longer than their window (``scheduler.timing.overdue``).

        Served by the partial index ``schedule_overdue`` in one index range
        scan. ``now`` may be ``Now()``: the database clock, read in the same query.
        """
        return self.filter(_overdue(now))

    def not_overdue(self, *, now: datetime | Now) -> ScheduleQuerySet:
        """Return the schedules ``overdue`` leaves out."""
        return self.exclude(_overdue(now))

    def with_overdue_flag(self) -> ScheduleQuerySet:
        """Annotate ``is_overdue``: whether each schedule is overdue on the database clock."""
        return self.annotate(is_overdue=ExpressionWrapper(_overdue(Now()), output_field=BooleanField()))


def _overdue(now: datetime | Now) -> Q:
    """The filter for overdue schedules at ``now`` (it matches the ``schedule_overdue`` index)."""
    return Q(enabled=True, paused_reason="", overdue_at__isnull=False, overdue_at__lte=now)


#: How messages name a schedule's ``headers``.
HEADERS_LABEL = "Message headers"


def header_problems(headers: Any) -> list[str]:
    """Return why ``headers`` cannot be a schedule's extra message headers (none: they can)."""
    if not isinstance(headers, dict):
        return ["Must be a JSON object."]
    problem = limits.argument_problem(headers, label=HEADERS_LABEL)
    if problem:
        return [problem]
    reserved = sorted(RESERVED_HEADERS & set(headers))
    return [f"Celery or the scheduler sets these headers: {', '.join(reserved)}."] if reserved else []


def argument_shape_problems(holder: Any) -> dict[str, str]:
    """Return {field: message} for ``holder.args`` that is not a list or ``holder.kwargs`` not a dict."""
    problems = {}
    if not isinstance(holder.args, list):
        problems["args"] = 'Arguments must be a JSON list, for example [1, "two"].'
    if not isinstance(holder.kwargs, dict):
        problems["kwargs"] = 'Keyword arguments must be a JSON object, for example {"key": 1}.'
    return problems


class Schedule(models.Model):
    class Overlap(models.TextChoices):
        #: Start a new run even while earlier ones are still running.
        ALLOW = "allow", "allow"
        #: Record the slot as skipped while an earlier run is still running.
        SKIP = "skip", "skip"
        #: Keep at most one run waiting; send it when the running one ends.
        BUFFER_ONE = "buffer_one", "buffer one"
        #: Cancel the running one, then start the new one.
        CANCEL_PREVIOUS = "cancel_previous", "cancel previous"

    class Origin(models.TextChoices):
        #: Made in the admin, the API or the command line.
        MANUAL = "manual", "admin, API or command line"
        #: An entry of Celery's ``beat_schedule`` setting: the code owns it.
        SETTINGS = "settings", "beat_schedule setting"
        #: One of the app's own housekeeping schedules.
        BUILTIN = "builtin", "built-in"
        #: Imported from django-celery-beat or a schedules file.
        IMPORT = "import", "import"

    class Misfire(models.TextChoices):
        #: Run every missed slot inside the catch-up window.
        RUN_ALL = "run_all", "run all"
        #: Run only the latest missed slot; record the others as missed.
        RUN_ONCE = "run_once", "run once"
        #: Run none of the missed slots; move on to the next one.
        SKIP = "skip", "skip"

    class DstGap(models.TextChoices):
        #: A local time that does not exist runs at the first instant after the gap.
        SHIFT = "shift", "shift to after the gap"
        #: A local time that does not exist does not run that day.
        SKIP = "skip", "skip"

    class DstFold(models.TextChoices):
        #: A local time that occurs twice runs at its first occurrence.
        FIRST = "first", "first occurrence"
        #: ... at its last occurrence.
        LAST = "last", "last occurrence"
        #: ... at both occurrences.
        BOTH = "both", "both occurrences"

    #: Unique within its tenant (``schedule_name_per_tenant``), so one tenant can neither learn nor block another's names.
    name = models.CharField(max_length=200)
    task = models.CharField(max_length=255, help_text="Dotted name of the Celery task.")
    args = models.JSONField(default=list, blank=True, help_text="JSON list of positional arguments.")
    kwargs = models.JSONField(default=dict, blank=True, help_text="JSON object of keyword arguments.")
    queue = models.CharField(max_length=200, blank=True, default="")
    priority = models.PositiveSmallIntegerField(null=True, blank=True)
    # Celery's message options (``apply_async``'s), sent as they are: ``beat_schedule`` entries carry them.
    expires = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Seconds after its slot past which a worker does not start an execution (recorded cancelled).",
    )
    # Database defaults too: an older release's replica writes schedules without these columns during a rolling upgrade.
    headers = models.JSONField(
        default=dict, db_default={}, blank=True, help_text="JSON object of extra message headers."
    )
    exchange = models.CharField(max_length=200, blank=True, default="", db_default="")
    routing_key = models.CharField(max_length=200, blank=True, default="", db_default="")
    description = models.TextField(blank=True, default="")
    tenant = models.CharField(max_length=100, blank=True, default="")
    #: Where its notifications go; none chosen: its tenant's default targets, else the deployer's.
    notify = models.ManyToManyField("scheduler.NotificationTarget", blank=True, related_name="schedules")
    #: Where the schedule came from; a ``settings`` one is turned off when its entry leaves ``beat_schedule``.
    origin = models.CharField(
        max_length=20, choices=Origin.choices, default=Origin.MANUAL, db_default=Origin.MANUAL, editable=False
    )

    # Timing: exactly one of cron, interval, run_at.
    cron = models.CharField(
        max_length=200,
        blank=True,
        default="",
        help_text="5 fields (minute hour day month weekday), or 6 with seconds first.",
    )
    interval = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Seconds."
    )
    run_at = models.DateTimeField(null=True, blank=True, help_text="Run once at this time.")
    timezone = models.CharField(max_length=64, default="UTC", help_text="IANA time zone name.")
    start_at = models.DateTimeField(null=True, blank=True)
    end_at = models.DateTimeField(null=True, blank=True)
    max_runs = models.PositiveIntegerField(null=True, blank=True, validators=[MinValueValidator(1)])
    #: Calendars whose days it does not fire on, by name, separated by ``;`` (its tenant's, or every tenant's).
    exclude_calendars = models.CharField(
        max_length=500,
        blank=True,
        default="",
        db_default="",
        help_text="Calendars whose days it does not fire on, separated by ; (holidays; company-shutdown).",
    )
    #: The calendar it fires on only ("" : every day).
    only_calendar = models.CharField(
        max_length=100, blank=True, default="", db_default="", help_text="Fire only on this calendar's days."
    )

    # Policies.
    overlap = models.CharField(max_length=20, choices=Overlap.choices, default=Overlap.ALLOW)
    catchup_window = models.PositiveIntegerField(
        default=default_catchup_window,
        help_text="Seconds. Slots older than this are recorded as missed, not run.",
    )
    misfire = models.CharField(max_length=20, choices=Misfire.choices, default=Misfire.RUN_ALL)
    jitter = models.PositiveIntegerField(default=0, help_text="Seconds, deterministic per slot.")
    dst_gap = models.CharField(max_length=10, choices=DstGap.choices, default=DstGap.SHIFT)
    dst_fold = models.CharField(max_length=10, choices=DstFold.choices, default=DstFold.FIRST)
    timeout = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Seconds per execution; empty means no time limit.",
    )
    max_retries = models.PositiveIntegerField(default=0)
    retry_backoff = models.PositiveIntegerField(
        default=1, help_text="Seconds; the base of the exponential backoff between retries."
    )
    pause_after_failures = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Pause the schedule after this many consecutive failures.",
    )
    alert_after = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Seconds without a success after which the schedule is overdue; "
        "empty: twice the longest gap between its slots.",
    )

    # State.
    enabled = models.BooleanField(default=True)
    #: Why the schedule turned itself off: its one-off ran, it used its
    #: ``max_runs``, or it passed its ``end_at``. Cleared when it is enabled again.
    disabled_reason = models.TextField(blank=True, default="", editable=False)
    paused_reason = models.TextField(blank=True, default="")
    next_run_at = models.DateTimeField(null=True, blank=True, editable=False)
    #: ``id % SCHEDULER_SHARDS``: which shard lease fences its dispatch (``scheduler.shards``).
    shard = models.PositiveSmallIntegerField(default=0, editable=False)
    last_run_at = models.DateTimeField(null=True, blank=True, editable=False)
    #: Final status of the last run (kept here so the admin can filter on it cheaply).
    last_status = models.CharField(max_length=20, blank=True, default="", editable=False)
    total_runs = models.PositiveIntegerField(default=0, editable=False)
    #: Slots not run because they were older than the catch-up window or
    #: dropped by the misfire policy, whether or not each got a ``missed`` row.
    total_missed = models.PositiveIntegerField(default=0, editable=False)
    #: Slots the beat committed to run (not missed, skipped, run-now, retry or
    #: backfill rows); ``max_runs`` and one-off completion count these. Only
    #: the dispatch transaction changes it, with an ``F()`` update.
    slots_committed = models.PositiveIntegerField(default=0, editable=False, db_column="slots_sent")
    #: Slots before this instant are not owed: reconcile's audit starts here.
    #: Moved forward on resume, re-enable and timing edits.
    owed_since = models.DateTimeField(null=True, blank=True, editable=False)
    #: The newest slot whose execution a prune deleted (``scheduler.ops.prune``, in the
    #: deleting transaction; it never moves back). Reconcile's audit starts after it:
    #: a slot that ran and was since pruned is never taken for a missing one.
    pruned_through = models.DateTimeField(null=True, blank=True, editable=False)
    consecutive_failures = models.PositiveIntegerField(default=0, editable=False)
    #: When a run last succeeded (set by the finish path in ``scheduler.owners.executions``).
    last_success_at = models.DateTimeField(null=True, blank=True, editable=False)
    #: Twice the longest gap between consecutive slots, in seconds; empty for a one-off.
    #: Derived from the timing on save; ``alert_after`` overrides it.
    cadence = models.PositiveIntegerField(null=True, blank=True, editable=False)
    #: When the schedule becomes overdue unless a run succeeds first (``scheduler.timing.overdue``);
    #: moved forward by every success and recomputed on timing, state and ``alert_after`` edits.
    overdue_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_error = models.TextField(blank=True, default="", editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ScheduleQuerySet.as_manager()

    class Meta:
        ordering = ("name",)
        # Each index is written by every fire (a new ``next_run_at`` is never a
        # HOT update), so none is kept that another serves: the unique
        # (tenant, name) serves a tenant's lookups, and name and task get
        # plain indexes, not Django's extra pattern (LIKE) index per CharField.
        indexes = [
            models.Index(fields=["name"], name="schedule_name"),
            models.Index(fields=["task"], name="schedule_task"),
            # "Enabled schedules due now, ordered by next_run_at" is one range
            # scan of this partial index; schedules that are not due cost nothing.
            # The id breaks ties in the index's order: a pass reads its batch and
            # stops, where a burst due at one instant was otherwise sorted whole.
            models.Index(
                fields=["next_run_at", "id"],
                name="schedule_due",
                condition=Q(enabled=True, paused_reason="", next_run_at__isnull=False),
            ),
            # The admin at a million rows: sort by next run, filter by last
            # status or paused, each an index range instead of a sort of the table.
            # (the admin breaks ties newest id first)
            # The same per shard, for a replica that dispatches only the shards it holds.
            models.Index(
                fields=["shard", "next_run_at"],
                name="schedule_shard_due",
                condition=Q(enabled=True, paused_reason="", next_run_at__isnull=False),
            ),
            models.Index(fields=["next_run_at", "-id"], name="schedule_next_run"),
            models.Index(fields=["last_status", "name"], name="schedule_last_status"),
            models.Index(fields=["name"], name="schedule_paused", condition=~Q(paused_reason="")),
            # Overdue schedules (metrics, /healthz/schedules, the admin filter): an index range up to now.
            models.Index(
                fields=["overdue_at"],
                name="schedule_overdue",
                condition=Q(enabled=True, paused_reason="", overdue_at__isnull=False),
            ),
        ]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="schedule_name_per_tenant"),
            models.CheckConstraint(
                name="schedule_exactly_one_timing",
                condition=(
                    (~Q(cron="") & Q(interval__isnull=True, run_at__isnull=True))
                    | Q(cron="", interval__isnull=False, run_at__isnull=True)
                    | Q(cron="", interval__isnull=True, run_at__isnull=False)
                ),
            ),
            models.CheckConstraint(name="schedule_interval_positive", condition=Q(interval__gt=0)),
            models.CheckConstraint(name="schedule_max_runs_positive", condition=Q(max_runs__gt=0)),
            models.CheckConstraint(name="schedule_timeout_positive", condition=Q(timeout__gt=0)),
            models.CheckConstraint(
                name="schedule_end_after_start",
                condition=Q(start_at__isnull=True) | Q(end_at__isnull=True) | Q(end_at__gt=models.F("start_at")),
            ),
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: What the row held when this object was read: ``save`` writes only the differences.
        self._loaded = self._stored()

    def __str__(self) -> str:
        return self.name

    # --- timing ---------------------------------------------------------------

    @property
    def is_paused(self) -> bool:
        return bool(self.paused_reason)

    def is_overdue_at(self, now: datetime) -> bool:
        """Return whether this schedule, as loaded, is overdue at ``now``: the row's twin of ``objects.overdue``."""
        return self.enabled and not self.is_paused and self.overdue_at is not None and self.overdue_at <= now

    @property
    def timing(self) -> timing.Timing:
        """Return the pure timing description of this schedule."""
        return timing.Timing(
            cron=self.cron or None,
            interval=self.interval,
            run_at=self.run_at,
            timezone=self.timezone,
            start_at=self.start_at,
            end_at=self.end_at,
            max_runs=self.max_runs,
            dst_gap=self.dst_gap,
            dst_fold=self.dst_fold,
            hash_key=self.hash_key,
            days=self._days(),
        )

    @property
    def calendar_names(self) -> list[str]:
        """The calendars it excludes, by name."""
        return [name.strip() for name in self.exclude_calendars.split(";") if name.strip()]

    def _days(self, max_age: float = 1.0) -> calendars.DayFilter | None:
        """The days its calendars keep it from firing on, as read at most ``max_age`` s ago (``owners.calendars``)."""
        if not self.exclude_calendars.strip() and not self.only_calendar:
            return None
        from scheduler.owners import calendars as calendar_owner  # the model is imported by the owners

        return calendar_owner.day_filter(
            self.tenant, exclude=self.calendar_names, only=self.only_calendar, max_age=max_age
        )

    @property
    def hash_key(self) -> str:
        """What its cron's ``H`` fields are hashed from: its tenant and name, so every process computes the same slots."""
        return f"{self.tenant}/{self.name}"

    def next_slot_after(self, after: datetime) -> datetime | None:
        """Return this schedule's first slot strictly after ``after`` (``max_runs`` counts the slots sent)."""
        return timing.next_slot(self.timing, after=after, runs_so_far=self.slots_committed)

    def compute_next_run_at(self, *, now: datetime) -> datetime | None:
        """Return the slot the beat should fire next, seen from ``now``.

        A one-off that has not run yet keeps its ``run_at`` even when it is in
        the past, so the catch-up window decides whether it still runs.
        """
        if not self.enabled or self.is_paused:
            return None
        if self.run_at is not None:
            return self.run_at if self.slots_committed == 0 else None
        return self.next_slot_after(now)

    def next_fire_times(self, count: int, *, after: datetime) -> list[datetime]:
        """Return up to ``count`` slots after ``after`` (aware UTC), ignoring enabled/paused."""
        if self.run_at is not None:
            return [self.run_at] if self.run_at > after else []
        times: list[datetime] = []
        slot = self.next_slot_after(after)
        while slot is not None and len(times) < count:
            times.append(slot)
            slot = timing.next_slot(self.timing, after=slot, runs_so_far=self.slots_committed + len(times))
        return times

    def preview_fire_times(self, count: int, *, after: datetime) -> list[tuple[datetime, str | None]]:
        """Up to ``count`` slots after ``after``, those its calendars keep out too, each with that calendar's name."""
        if self.run_at is not None:
            return [(self.run_at, None)] if self.run_at > after else []
        return timing.excluded_slots(self.timing, after=after, count=count, runs_so_far=self.slots_committed)

    def _stored(self) -> dict[str, Any]:
        """Return the loaded value of each field present (deferred ones are left out).

        JSON values are copied: an edit in place must still show as a change.
        """
        return {
            field.attname: copy.deepcopy(self.__dict__[field.attname])
            if isinstance(field, models.JSONField)
            else self.__dict__[field.attname]
            for field in self._meta.concrete_fields
            if field.attname in self.__dict__
        }

    def changed_fields(self) -> set[str]:
        """Return the fields set to another value than the one loaded (or last saved)."""
        return {
            field.name
            for field in self._meta.concrete_fields
            if field.attname in self.__dict__
            and (field.attname not in self._loaded or self.__dict__[field.attname] != self._loaded[field.attname])
        }

    def refresh_from_db(self, using: str | None = None, fields: Any = None, from_queryset: Any = None) -> None:
        super().refresh_from_db(using=using, fields=fields, from_queryset=from_queryset)
        fresh = self._stored()
        self._loaded.update(fresh if fields is None else {name: fresh[name] for name in fields if name in fresh})

    def mark_saved(self, fields: Any = None) -> None:
        """Take ``fields`` (default: all) as what the row now holds: they no longer count as changed."""
        stored = self._stored()
        self._loaded.update(stored if fields is None else {name: stored[name] for name in fields if name in stored})

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Refuse: ``scheduler.owners.schedules`` writes schedule rows (``create``, ``save``), so their derived fields stay right."""
        raise ScheduleWriteRefused()

    def delete(self, using: str | None = None, keep_parents: bool = False) -> tuple[int, dict[str, int]]:
        """Refuse: ``scheduler.owners.schedules.delete`` deletes a schedule, its row locked first."""
        raise ScheduleWriteRefused()

    # --- validation -----------------------------------------------------------

    def get_constraints(self) -> list[tuple[type[models.Model], Sequence[models.BaseConstraint]]]:
        """Return the constraints ``full_clean`` checks: none of these, ``clean()`` states each in words.

        Checking a check constraint too would repeat its message with the
        constraint's internal name; the name's uniqueness is checked on the
        name, within the tenant, even when a form leaves the tenant out. The
        constraints stay the database's guard.
        """
        return [
            (model, [c for c in constraints if not isinstance(c, (models.CheckConstraint, models.UniqueConstraint))])
            for model, constraints in super().get_constraints()
        ]

    def clean_fields(self, exclude: Any = None) -> None:
        """Validate each field, the size limits (``scheduler.limits``) first.

        Arguments past their depth limit are not handed to the field's own
        validation: it encodes them with ``json.dumps``, which recurses.
        """
        exclude = set(exclude or ())
        errors: dict[str, list[Any]] = {}
        for field, label in limits.ARGUMENT_LABELS.items():
            problem = None if field in exclude else limits.argument_problem(getattr(self, field), label=label)
            if problem:
                errors[field] = [problem]
                exclude.add(field)
        for field, limit in (
            ("description", limits.DESCRIPTION_MAX_CHARS),
            ("paused_reason", limits.PAUSED_REASON_MAX_CHARS),
        ):
            problems = [] if field in exclude else limits.text_problems(getattr(self, field), limit)
            if problems:
                errors[field] = problems
        try:
            super().clean_fields(exclude=exclude)
        except ValidationError as exc:
            errors = exc.update_error_dict(errors)
        if errors:
            raise ValidationError(errors)

    def clean(self) -> None:
        """Validate what field validators cannot: timing, zone, JSON shapes, bounds."""
        errors: dict[str, list[str]] = {}

        def add(field: str, message: str) -> None:
            errors.setdefault(field, []).append(message)

        timing_set = [bool(self.cron), self.interval is not None, self.run_at is not None]
        if sum(timing_set) != 1:
            add(NON_FIELD_ERRORS, TIMING_REQUIRED)
        if self.cron:
            try:
                timing.validate_cron(self.cron, hash_key=self.hash_key)
            except ScheduleInvalid as exc:
                add("cron", str(exc))
            else:
                if problem := timing.cron_dates_problem(self.cron, hash_key=self.hash_key):
                    add("cron", problem)
        try:
            timing.validate_timezone(self.timezone)
        except ScheduleInvalid as exc:
            add("timezone", str(exc))
        for field, message in argument_shape_problems(self).items():
            add(field, message)
        for message in header_problems(self.headers):
            add("headers", message)
        if self.exclude_calendars.strip() or self.only_calendar:
            try:
                self._days(max_age=0)
            except ScheduleInvalid as exc:  # a name its tenant has no calendar of
                add(
                    "only_calendar"
                    if self.only_calendar and str(exc).endswith(f"{self.only_calendar!r}.")
                    else "exclude_calendars",
                    str(exc),
                )
        if self.start_at and self.end_at and self.end_at <= self.start_at:
            add("end_at", "End must be after start.")
        for field in ("run_at", "start_at", "end_at"):
            moment = getattr(self, field)
            if isinstance(moment, datetime) and not EARLIEST <= moment < LATEST:
                add(field, "Must be from 1970-01-01 to 8999-12-31.")
        if self.name and not self.name.strip():
            add("name", "This field cannot be blank.")
        elif self.name and Schedule.objects.filter(tenant=self.tenant, name=self.name).exclude(pk=self.pk).exists():
            # Only this tenant's names are looked at: the message tells nothing of another's.
            add("name", "Schedule with this Name already exists.")
        if self.catchup_window == 0:
            add(
                "catchup_window",
                "Must be at least 1 second: with 0 every slot would be missed. "
                "To run only slots that are on time, set misfire to skip.",
            )
        for model_field in self._meta.concrete_fields:
            kind = model_field.get_internal_type()
            if kind not in COLUMN_MAX:
                continue
            high, value = COLUMN_MAX[kind], getattr(self, model_field.attname)
            # Above the database's own range the field's validator already said so.
            if isinstance(value, int) and high < value <= connection.ops.integer_field_range(kind)[1]:
                add(model_field.name, MaxValueValidator(high).message % {"limit_value": high})
        if errors:
            raise ValidationError(errors)
