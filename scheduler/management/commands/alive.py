"""``manage.py alive``: exit 0 when a process of this host wrote its heartbeat recently (container healthcheck)."""

from __future__ import annotations

import socket
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import CommandError, CommandParser

from scheduler import dbclock
from scheduler.management.base import SchedulerCommand, positive_number
from scheduler.models import Instance


class Command(SchedulerCommand):
    help = """Exit 0 when a beat replica or worker on this host wrote its heartbeat within N seconds, else 1.

Meant for container healthchecks: each replica runs in its own container,
so "this host" is this replica. A worker's heartbeat is written only after
a probe it sent itself through the broker came back through its consumer,
so a worker whose process is up but consumes nothing (broker gone, a deaf
consumer) fails too.

examples:
  manage.py alive --role beat --within 30
  manage.py alive --role worker --within 30"""

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--role", choices=Instance.Role.values, required=True, help="which kind of process to check"
        )
        parser.add_argument(
            "--within",
            type=positive_number,
            default=30.0,
            metavar="SECONDS",
            help="the newest heartbeat must be younger than this (default: 30)",
        )
        parser.add_argument("--hostname", default=socket.gethostname(), help="default: this host")

    def handle(self, *args: Any, role: str, within: float, hostname: str, **options: Any) -> None:
        now = dbclock.now()
        latest = Instance.objects.filter(role=role, hostname=hostname).order_by("-last_seen").first()
        if latest is None or latest.last_seen < now - timedelta(seconds=within):
            raise CommandError(self._why(role, hostname, within, latest, now=now))
        self.stdout.write(f"{role} on {hostname} is alive")

    @staticmethod
    def _why(role: str, hostname: str, within: float, latest: Instance | None, *, now: datetime) -> str:
        if role == Instance.Role.BEAT:
            return f"no {role} on {hostname} wrote a heartbeat in the last {within:g}s"
        last = "never" if latest is None else f"last {(now - latest.last_seen).total_seconds():.0f}s ago"
        return (
            f"no worker on {hostname} received its own probe back through the broker in the last {within:g}s "
            f"({last}): the broker is unreachable, its consumer is deaf, or the worker is not running"
        )
