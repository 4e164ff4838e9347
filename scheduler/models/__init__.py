"""The scheduler's tables: what should run, what did run, who leads."""

from __future__ import annotations

from scheduler.models.api_token import ApiToken
from scheduler.models.audit_event import AuditEvent
from scheduler.models.calendar import Calendar
from scheduler.models.concurrency_limit import ConcurrencyLimit
from scheduler.models.execution import Execution
from scheduler.models.instance import Instance
from scheduler.models.lease import Lease
from scheduler.models.notification import Incident, Notification, NotificationTarget
from scheduler.models.operator_profile import OperatorProfile
from scheduler.models.pause_rule import PauseRule
from scheduler.models.rate_limit import RateLimit, RateLimitKey
from scheduler.models.schedule import Schedule
from scheduler.models.shard_layout import ShardLayout
from scheduler.models.tally import DurationTally, ExecutionTally

__all__ = (
    "ApiToken",
    "AuditEvent",
    "Calendar",
    "ConcurrencyLimit",
    "DurationTally",
    "Execution",
    "ExecutionTally",
    "Incident",
    "Instance",
    "Lease",
    "Notification",
    "NotificationTarget",
    "OperatorProfile",
    "PauseRule",
    "RateLimit",
    "RateLimitKey",
    "Schedule",
    "ShardLayout",
)
