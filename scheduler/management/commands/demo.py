"""Create the local admin login and the demo schedules (used by ``make run``)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, cast

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Field

from scheduler.models import Schedule
from scheduler.ops import audit, operations

DEMO_SCHEDULES: tuple[dict[str, Any], ...] = (
    {"name": "demo: echo every 5 seconds", "task": "scheduler.echo", "interval": 5, "args": ["hello"]},
    {"name": "demo: sleep every minute", "task": "scheduler.sleep", "cron": "* * * * *", "kwargs": {"seconds": 2}},
)


class Command(BaseCommand):
    help = "Create an admin login (password kept in var/admin-password.txt) and two demo schedules."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--username", default="admin", help="the admin login to create (default: admin)")

    def handle(self, *args: Any, username: str, **options: Any) -> None:
        # The login's audit event (scheduler.ops.access_audit) names the command line.
        with audit.acting(audit.CLI):
            self._handle(username)

    def _handle(self, username: str) -> None:
        password_file = Path(settings.VAR_DIR) / "admin-password.txt"
        User = get_user_model()
        try:
            # A name the table cannot hold (too long, a NUL) would otherwise fail in the database.
            cast("Field[Any, Any]", User._meta.get_field(User.USERNAME_FIELD)).clean(username, None)
        except ValidationError as exc:
            raise CommandError(f"--username {username!r}: {' '.join(exc.messages)}") from None
        user = User.objects.filter(username=username).first()
        if user is None or not password_file.exists():
            password = secrets.token_urlsafe(9)
            user = user or User(username=username, is_staff=True, is_superuser=True)
            user.set_password(password)
            user.save()
            password_file.parent.mkdir(parents=True, exist_ok=True)
            password_file.write_text(password + "\n")
        password = password_file.read_text().strip()
        for values in DEMO_SCHEDULES:
            if not Schedule.objects.filter(name=values["name"]).exists():
                schedule = Schedule(**values)
                schedule.full_clean()
                operations.save_schedule(schedule, actor=audit.CLI)
        self.stdout.write(
            f"Admin: http://127.0.0.1:{os.environ.get('WEB_PORT', '8000')}/admin/  login {username} / {password}\n"
            f"Demo schedules: {', '.join(v['name'] for v in DEMO_SCHEDULES)}"
        )
