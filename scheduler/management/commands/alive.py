"""``manage.py alive``: exit 0 when a process of this host wrote its heartbeat recently (container healthcheck)."""
from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

from django.core.management.base import CommandError, CommandParser

from scheduler import leases
from scheduler.management.base import SchedulerCommand, positive_number
from scheduler.models import Instance


class Command(SchedulerCommand):
    help = """Exit 0 when a beat replica or worker on this host wrote its heartbeat within N seconds, else 1.

Meant for container healthchecks: each replica runs in its own container,
so "this host" is this replica.

examples:
  manage.py alive --role beat --within 30
  manage.py alive --role worker --within 60"""

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--role", choices=Instance.Role.values, required=True)
        parser.add_argument("--within", type=positive_number, default=30.0, metavar="SECONDS")
        parser.add_argument("--hostname", default=socket.gethostname(), help="default: this host")

    def handle(self, *args: Any, role: str, within: float, hostname: str, **options: Any) -> None:
        since = leases.db_now() - timedelta(seconds=within)
        seen = Instance.objects.filter(role=role, hostname=hostname, last_seen__gte=since).exists()
        if not seen:
            raise CommandError(f"no {role} on {hostname} wrote a heartbeat in the last {within:g}s")
        self.stdout.write(f"{role} on {hostname} is alive")
