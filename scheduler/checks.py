"""Django system checks that catch scheduler misconfiguration at startup, not in production.

Ids never change once released: ``scheduler.E001`` ... for errors, ``scheduler.W001`` ... for warnings.
"""

from __future__ import annotations

import math
import re
import typing
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.conf import settings as django_settings
from django.core.checks import Error, Tags, Warning, register
from django.core.checks.registry import registry
from django.db import DatabaseError

from scheduler import shards
from scheduler.conf import DEPRECATED_NAMES, DEPRECATED_UNTIL, Defaults, settings
from scheduler.ops import cluster

#: The beat scheduler every replica must run: anything else fires without the lease.
LEADER_SCHEDULER = "scheduler.beat:LeaderScheduler"
#: Longest a slot may be committed before its instant: half the shortest interval (1 s), so a schedule has one slot ahead at most.
MAX_COMMIT_AHEAD_SECONDS = 0.5
#: Most shards: ``Schedule.shard`` is a small integer, and each shard is a lease row every replica reads per tick.
MAX_SHARDS = 1024
#: The longest ``SCHEDULER_LEASE_NAME``: a shard's lease ``<name>:<k>`` (k up to 1023) fits the lease's 100 characters.
MAX_LEASE_NAME_LENGTH = 100 - len(f":{MAX_SHARDS - 1}")


#: Numeric settings that must be above 0: at 0 they would stall, or refuse everything, instead of turning
#: something off. The other numbers may be 0 (several say 0 turns their work off).
POSITIVE_SETTINGS = frozenset(
    {
        "LEASE_TTL_SECONDS",
        "LEASE_RENEW_SECONDS",
        "FOLLOWER_RETRY_SECONDS",
        "MAX_INTERVAL_SECONDS",
        "DISPATCH_BATCH_SIZE",
        "DEFAULT_CATCHUP_WINDOW_SECONDS",
        "CLAIM_SECONDS",
        "CLAIM_RENEW_SECONDS",
        "NOTIFY_RETRY_SECONDS",
        "NOTIFY_MAX_ATTEMPTS",
        "NOTIFY_TIMEOUT_SECONDS",
        "ARGS_MAX_BYTES",
        "ARGS_MAX_DEPTH",
        "BACKFILL_MAX_SLOTS",
    }
)
#: Text settings read in a format: the format, and how the error names it.
_FORMATS = {"API_THROTTLE_RATE": (re.compile(r"[0-9]+/[smhd][a-z]*"), "a rate as N/second, N/minute, N/hour or N/day")}
#: Settings a check of their own holds to more than their type.
_CHECKED_APART = frozenset({"SHARDS", "COMMIT_AHEAD_SECONDS", "PREPARED_STATEMENTS", "LEASE_NAME"})


def errors_at_start() -> list[str]:
    """The scheduler's errors among the system checks, one line each: a beat or a worker does not start with any.

    ``manage.py check`` reports them too, but nobody runs it before each start.
    (The checks that read the database are left to it: a beat or worker reads
    no table before it starts.)
    """
    ours = [
        check
        for check in registry.get_checks(include_deployment_checks=False)
        if check.__module__ == __name__ and Tags.database not in check.tags
    ]
    return [f"{message.id}: {message.msg}" for check in ours for message in check(None) if message.is_serious()]


def refuse_to_start_on_errors(role: str) -> None:
    """Stop this process, in one line, if ``errors_at_start`` finds any."""
    errors = errors_at_start()
    if errors:
        raise SystemExit(f"scheduler: the {role} does not start: {' '.join(errors)} (manage.py check says more)")


@register()
def check_setting_types(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """Every ``SCHEDULER_*`` setting has its default's type, and a number is finite and not negative.

    A value read from the environment in a project's own settings is text:
    without this check, the first comparison with it fails deep in a beat
    or a worker, or in ``manage.py check`` itself.
    """
    errors = []
    for name, kind in typing.get_type_hints(Defaults).items():
        if name in _CHECKED_APART:
            continue
        value = getattr(settings, name)
        wanted = _type_problem(kind, value, positive=name in POSITIVE_SETTINGS)
        if not wanted and name in _FORMATS and value is not None and not _FORMATS[name][0].fullmatch(value):
            wanted = _FORMATS[name][1]  # (a rate Django REST framework cannot read would answer 500 to every call)
        if wanted:
            errors.append(Error(f"SCHEDULER_{name} must be {wanted}, got {value!r}.", id="scheduler.E011"))
    return errors


def _type_problem(kind: Any, value: Any, *, positive: bool) -> str:
    """What ``value`` must be to be a setting of type ``kind``; "" when it is."""
    if kind is bool:
        return "" if isinstance(value, bool) else "True or False"
    if kind is str:  # None, as os.environ.get() gives for an unset variable, reads as "" (off, or the default)
        return "" if value is None or isinstance(value, str) else "text"
    if kind is int or kind is float:
        noun = "a whole number" if kind is int else "a number"
        bound = "above 0" if positive else "from 0"
        taken = (int,) if kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, taken) or not math.isfinite(value):
            return f"{noun} {bound}"
        return "" if (value > 0 if positive else value >= 0) else f"{noun} {bound}"
    return ""  # a mapping (TENANT_TASKS) is checked where it is read


@register()
def check_lease_timing(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """The lease must outlive at least two missed renewals, or a healthy leader loses it."""
    ttl, renew = settings.LEASE_TTL_SECONDS, settings.LEASE_RENEW_SECONDS
    if _type_problem(float, ttl, positive=True) or _type_problem(float, renew, positive=True):
        return []  # check_setting_types says so
    if ttl <= 2 * renew:
        return [
            Error(
                f"SCHEDULER_LEASE_TTL_SECONDS ({ttl}) must be greater than twice "
                f"SCHEDULER_LEASE_RENEW_SECONDS ({renew}).",
                hint="With the defaults, TTL 10 s and renewals every 2 s, a leader may miss four renewals.",
                id="scheduler.E001",
            )
        ]
    return []


@register()
def check_shards(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """``SCHEDULER_SHARDS`` (the count stored when none is) is a whole number from 1 to ``MAX_SHARDS``."""
    configured = settings.SHARDS
    if isinstance(configured, bool) or not isinstance(configured, int) or not 1 <= configured <= MAX_SHARDS:
        return [
            Error(
                f"SCHEDULER_SHARDS must be a whole number from 1 to {MAX_SHARDS}, got {configured!r}.",
                hint="1 runs one leader; more split the schedules across the beat replicas.",
                id="scheduler.E006",
            )
        ]
    return []


@register()
def check_lease_name(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """``SCHEDULER_LEASE_NAME`` is text a lease row holds, its shards' names included (else every tick fails)."""
    name = settings.LEASE_NAME
    if not isinstance(name, str) or not 0 < len(name) <= MAX_LEASE_NAME_LENGTH or "\x00" in name:
        return [
            Error(
                f"SCHEDULER_LEASE_NAME must be text of 1 to {MAX_LEASE_NAME_LENGTH} characters without a NUL, "
                f"got {name!r}.",
                hint="Replicas that share a lease name share one leadership; the default is 'beat'.",
                id="scheduler.E010",
            )
        ]
    return []


@register()
def check_commit_ahead(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """``SCHEDULER_COMMIT_AHEAD_SECONDS`` is a number of seconds from 0 to ``MAX_COMMIT_AHEAD_SECONDS``."""
    ahead = settings.COMMIT_AHEAD_SECONDS
    if isinstance(ahead, bool) or not isinstance(ahead, int | float) or not 0 <= ahead <= MAX_COMMIT_AHEAD_SECONDS:
        return [
            Error(
                f"SCHEDULER_COMMIT_AHEAD_SECONDS must be a number of seconds from 0 to {MAX_COMMIT_AHEAD_SECONDS}, "
                f"got {ahead!r}.",
                hint="0 commits every slot at its instant; the default, 0.2, leaves only the message to send then.",
                id="scheduler.E008",
            )
        ]
    return []


@register()
def check_prepared_statements(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """``SCHEDULER_PREPARED_STATEMENTS`` is True or False: a string such as "false" would read as true."""
    prepared = settings.PREPARED_STATEMENTS
    if not isinstance(prepared, bool):
        return [
            Error(
                f"SCHEDULER_PREPARED_STATEMENTS must be True or False, got {prepared!r}.",
                hint="False behind a transaction pooler that does not keep prepared statements (PgBouncer in "
                "transaction mode before 1.21).",
                id="scheduler.E009",
            )
        ]
    return []


@register(Tags.database)
def check_stranded_schedules(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[Warning]:
    """No active schedule sits in a shard past the shard count, where nothing dispatches it.

    A database check (``manage.py check --database default``, and
    ``migrate``): one probe of the index on ``(shard, next_run_at)``.
    """
    if not databases or check_shards():
        return []
    for alias in databases:
        try:
            stranded = cluster.stranded().using(alias).exists()
        except DatabaseError:  # not migrated yet, or unreachable: other checks and commands say so
            continue
        if stranded:
            return [
                Warning(
                    f"Active schedules are in a shard >= the shard count ({shards.count()}) on database {alias!r}: "
                    "no beat replica dispatches them.",
                    hint="Run `manage.py shards --assign` (`manage.py shards` counts them).",
                    id="scheduler.W001",
                )
            ]
    return []


@register()
def check_beat_scheduler(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    configured = getattr(django_settings, "CELERY_BEAT_SCHEDULER", None)
    if configured != LEADER_SCHEDULER:
        return [
            Error(
                f"CELERY_BEAT_SCHEDULER is {configured!r}; it must be {LEADER_SCHEDULER!r}.",
                hint="Any other beat scheduler sends tasks without holding the lease, so replicas fire twice.",
                id="scheduler.E002",
            )
        ]
    return []


@register()
def check_broker(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    if not getattr(django_settings, "CELERY_BROKER_URL", None):
        return [
            Error(
                "CELERY_BROKER_URL is not set.",
                hint="Set REDIS_URL (or CELERY_BROKER_URL) in the environment.",
                id="scheduler.E003",
            )
        ]
    return []


@register()
def check_time_zones(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    errors = []
    for name in ("TIME_ZONE", "CELERY_TIMEZONE"):
        value = getattr(django_settings, name, None)
        if value is None:
            continue
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a folder of zones ('Europe')
            errors.append(Error(f"{name} {value!r} is not an IANA time zone.", id="scheduler.E004"))
    if not django_settings.USE_TZ:
        errors.append(
            Error("USE_TZ is off; schedules, leases and executions need aware datetimes.", id="scheduler.E005")
        )
    return errors


@register(Tags.security, deploy=True)
def check_metrics_token(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """In production, ``/metrics`` and ``/healthz/schedules`` should take a token (``manage.py check --deploy``)."""
    if django_settings.DEBUG or (settings.METRICS_TOKEN or "").strip():
        return []
    return [
        Warning(
            "SCHEDULER_METRICS_TOKEN is not set: /metrics and /healthz/schedules name every tenant's "
            "schedules, tasks, queues and hosts to anyone who can reach the web.",
            hint="Set SCHEDULER_METRICS_TOKEN and give Prometheus the same token (authorization: credentials_file), "
            "or add scheduler.W002 to SILENCED_SYSTEM_CHECKS if only your monitoring can reach the web.",
            id="scheduler.W002",
        )
    ]


@register()
def check_celery_app(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """``SCHEDULER_CELERY_APP``, when set, names an importable Celery app."""
    from django.core.exceptions import ImproperlyConfigured

    from scheduler.celery_app import celery_app

    try:
        celery_app()
    except ImproperlyConfigured as exc:
        return [
            Error(
                str(exc),
                hint='Name the app as "module:attribute" (e.g. "mysite.celery:app"), or leave it empty for the current app.',
                id="scheduler.E007",
            )
        ]
    return []


@register()
def check_deprecated_settings(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """A deprecated setting name still works, until the release that drops it: say so while there is time."""
    return [
        Warning(
            f"SCHEDULER_{old} is deprecated and stops being read in {DEPRECATED_UNTIL}.",
            hint=f"Rename it to SCHEDULER_{new}.",
            id="scheduler.W003",
        )
        for old, new in DEPRECATED_NAMES.items()
        if hasattr(django_settings, f"SCHEDULER_{old}")
    ]


@register(Tags.database)
def check_sqlite_sharing(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """SQLite, shared by the beat replicas, the workers and the web, needs WAL and IMMEDIATE transactions."""
    warnings = []
    for alias, database in django_settings.DATABASES.items():
        if database.get("ENGINE") != "django.db.backends.sqlite3":
            continue
        options = database.get("OPTIONS") or {}
        immediate = str(options.get("transaction_mode", "")).upper() == "IMMEDIATE"
        wal = "journal_mode=wal" in str(options.get("init_command", "")).lower().replace(" ", "")
        if immediate and wal:
            continue
        warnings.append(
            Warning(
                f"SQLite database {alias!r} is shared by several processes without WAL and IMMEDIATE transactions: "
                "a write waits behind every reader, and a transaction that reads before it writes fails with "
                "'database is locked' while another holds the write lock, so a worker can fail to record an outcome.",
                hint=f'Set DATABASES[{alias!r}]["OPTIONS"] = {{"transaction_mode": "IMMEDIATE", "timeout": 20, '
                '"init_command": "PRAGMA journal_mode=WAL;"}, or use PostgreSQL.',
                id="scheduler.W004",
            )
        )
    return warnings
