"""The scheduler's tables: what should run, what did run, who leads."""
from __future__ import annotations

from scheduler.models.execution import Execution
from scheduler.models.instance import Instance
from scheduler.models.lease import Lease
from scheduler.models.schedule import Schedule

__all__ = ("Execution", "Instance", "Lease", "Schedule")
