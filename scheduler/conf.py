"""Scheduler settings with their defaults, read lazily from Django settings.

Every setting is ``SCHEDULER_<NAME>`` in Django settings and ``<NAME>`` here.
Values are looked up on each attribute access so that ``override_settings``
and pytest-django's ``settings`` fixture take effect without a reload.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings


class Defaults:
    #: Name of the lease row the beat replicas compete for.
    LEASE_NAME: str = "beat"
    #: Shards the schedules are split into, each fenced by its own lease
    #: ``<LEASE_NAME>:<k>`` and dispatched by whichever replica holds it
    #: (``scheduler.shards``); 1 keeps one leader and the one ``LEASE_NAME`` lease.
    #: The first beat replica stores it in the database when no count is stored
    #: yet; from then on every replica follows the stored count and this is only
    #: compared with it (``manage.py shards --set N`` changes the count).
    SHARDS: int = 1
    #: How long a lease is valid after each acquire or renew.
    LEASE_TTL_SECONDS: float = 10.0
    #: How often the leader renews its lease.
    LEASE_RENEW_SECONDS: float = 2.0
    #: How often a follower tries to take the lease.
    FOLLOWER_RETRY_SECONDS: float = 1.0
    #: Longest the beat sleeps between ticks.
    MAX_INTERVAL_SECONDS: float = 1.0
    #: How long before its instant the leader commits an interval schedule's slot
    #: (``pending``, not sent before the instant): at the instant only the message is
    #: left to send. Any edit of the schedule, and the leader's shutdown, give the
    #: slot back first. 0 commits every slot at its instant.
    COMMIT_AHEAD_SECONDS: float = 0.2
    #: Due schedules read per query by the leader.
    DISPATCH_BATCH_SIZE: int = 500
    #: Default catch-up window for new schedules: older slots are recorded as missed.
    DEFAULT_CATCHUP_WINDOW_SECONDS: int = 300
    #: How long a worker's claim on a running execution lasts without renewal;
    #: after that the execution may be claimed again (its worker is presumed dead),
    #: and a body its worker cannot confirm the claim for is stopped. An execution
    #: with a ``timeout`` keeps its claim at least until its hard time limit.
    CLAIM_SECONDS: float = 30.0
    #: Whether the worker runs its per-task statements (claim, outcome) as prepared
    #: statements on PostgreSQL: planned once per connection instead of on every call.
    #: False behind a transaction pooler that does not keep them (PgBouncer in
    #: transaction mode before 1.21, or with ``max_prepared_statements = 0``).
    PREPARED_STATEMENTS: bool = True
    #: How often each worker process renews the claims of the executions it runs.
    CLAIM_RENEW_SECONDS: float = 10.0
    #: Seconds between a task's soft time limit (its ``timeout``) and the hard kill.
    TIMEOUT_GRACE_SECONDS: float = 10.0
    #: Attempts lost with their worker (killed, frozen, cut off) that are run
    #: again beyond ``max_retries``: a dying worker is not the task failing.
    #: Lost attempts and the task's own errors are counted apart.
    LOST_RETRIES: int = 3
    #: Seconds a worker process keeps its database connection across tasks
    #: (Django's ``CONN_MAX_AGE`` for worker processes only, checked before
    #: reuse); 0 opens one per task, as plain Celery does.
    WORKER_CONN_MAX_AGE: float = 300.0
    #: Longest delay between two retry attempts, whatever the backoff says.
    RETRY_BACKOFF_MAX_SECONDS: float = 3600.0
    #: How often the leader runs reconcile; 0 turns that off.
    RECONCILE_INTERVAL_SECONDS: float = 60.0
    #: ``pending`` executions older than this are published by reconcile.
    RECONCILE_PENDING_AFTER_SECONDS: float = 60.0
    #: ``queued`` executions not claimed this long after being sent are re-published
    #: (on Redis, only while their queue holds no other messages), at every broker
    #: check: with ``BROKER_CHECK_SECONDS`` a message lost where the check cannot see
    #: it runs within 60 s (SPEC guarantee 9).
    RECONCILE_QUEUED_AFTER_SECONDS: float = 45.0
    #: How often the leader asks the broker whether it lost its messages (a Redis
    #: restarted empty) and, if so, sends the waiting executions again, and re-publishes
    #: what waited past ``RECONCILE_QUEUED_AFTER_SECONDS`` (its own thread); 0 turns that off.
    BROKER_CHECK_SECONDS: float = 5.0
    #: Instances not seen for this long are removed from the registry.
    RECONCILE_INSTANCE_STALE_SECONDS: float = 3600.0
    #: The cluster page warns about a queue whose oldest ``queued`` execution has waited this long.
    QUEUED_WARNING_SECONDS: float = 300.0
    #: How often the leader delivers the notifications due (its own thread); 0 turns delivery off.
    NOTIFY_INTERVAL_SECONDS: float = 2.0
    #: The first retry of a notification that could not be delivered waits this long, each next one twice as long.
    NOTIFY_RETRY_SECONDS: float = 10.0
    #: Attempts to deliver one notification before it is given up (shown in the admin).
    NOTIFY_MAX_ATTEMPTS: int = 8
    #: How long one delivery may take (an HTTP request, a mail), in seconds.
    NOTIFY_TIMEOUT_SECONDS: float = 10.0
    #: A lease that fences dispatch (the leadership, a shard's) without a holder this long is
    #: announced to the deployer's notification targets, by the leader or any worker; 0: never.
    NOTIFY_LEADERLESS_SECONDS: float = 60.0
    #: ``/metrics`` exposes one ``scheduler_schedule_last_success_timestamp_seconds`` series per
    #: schedule only while there are at most this many schedules (label cardinality).
    METRICS_PER_SCHEDULE_LIMIT: int = 1000
    #: Largest ``args`` (and, separately, ``kwargs``) of a schedule or a submission, in bytes of compact JSON.
    ARGS_MAX_BYTES: int = 65536
    #: Deepest nesting of lists and objects in ``args`` or ``kwargs`` (``[]`` is one level).
    #: The API refuses a request body nested more than twice this deep before it reaches a field.
    ARGS_MAX_DEPTH: int = 32
    #: Most slots one backfill may cover, so most executions it records: the API and the
    #: admin refuse a larger range, ``manage.py backfill`` too unless given ``--max-slots``.
    BACKFILL_MAX_SLOTS: int = 10_000
    #: Bearer token ``/metrics`` and ``/healthz/schedules`` require (``Authorization: Bearer <token>``);
    #: empty (the default): both are open, as Prometheus expects.
    METRICS_TOKEN: str = ""
    #: Create the built-in housekeeping schedules when a beat starts (if missing).
    BUILTIN_SCHEDULES: bool = True
    #: The daily prune deletes finished executions older than this many days ...
    PRUNE_OLDER_THAN_DAYS: int = 30
    #: ... keeping the newest this many of each schedule whatever their age.
    PRUNE_KEEP_LAST: int = 100
    #: Requests each API token (or session user) may make, as ``N/second|minute|hour|day``.
    API_THROTTLE_RATE: str = "1200/minute"
    #: What tenants may schedule, beyond the reserved ``celery.*`` and ``scheduler.*``
    #: that no tenant may: ``{tenant: [glob, ...]}``, with ``"*"`` as the default for
    #: tenants not listed. Empty (the default): any task that is not reserved.
    TENANT_TASKS: dict[str, list[str]] = {}
    #: Dotted path of the Celery app the admin, the API, the probes and the commands
    #: send through (``"mysite.celery:app"``); empty (the default): Celery's current
    #: app, which in a Django project is the one ``mysite/celery.py`` creates.
    #: Workers and beats always use the app they run (``scheduler.celery_app``).
    CELERY_APP: str = ""


#: Deprecated names still read when the new one is not set: {old name: new name}.
#: "Lease" means the beat's leadership only; a worker holds a claim.
#: They are read until the release ``DEPRECATED_UNTIL`` (CHANGELOG.md, "Deprecation policy").
DEPRECATED_UNTIL = "0.3.0"
DEPRECATED_NAMES = {
    "EXECUTION_LEASE_SECONDS": "CLAIM_SECONDS",
    "EXECUTION_RENEW_SECONDS": "CLAIM_RENEW_SECONDS",
}
_OLD_NAMES = {new: old for old, new in DEPRECATED_NAMES.items()}


class Settings:
    """Attribute access to ``SCHEDULER_<NAME>`` with the defaults above."""

    def __getattr__(self, name: str) -> Any:
        if not hasattr(Defaults, name):
            raise AttributeError(f"Unknown scheduler setting: {name}")
        default = getattr(Defaults, name)
        if name in _OLD_NAMES:
            default = getattr(django_settings, f"SCHEDULER_{_OLD_NAMES[name]}", default)
        return getattr(django_settings, f"SCHEDULER_{name}", default)


settings = Settings()
