"""``manage.py api_tokens``: create, list and revoke the HTTP API's bearer tokens."""

from __future__ import annotations

from typing import Any, cast

from django.core.management.base import CommandError, CommandParser
from django.db import transaction

from scheduler import dbclock
from scheduler.management.base import SchedulerCommand, parse_duration, text_table, text_value
from scheduler.models import ApiToken
from scheduler.ops import audit, operations

#: Longest name and tenant a token takes (their columns' lengths).
# CharFields: their max_length is set.
NAME_MAX = cast(int, ApiToken._meta.get_field("name").max_length)
TENANT_MAX = cast(int, ApiToken._meta.get_field("tenant").max_length)


class Command(SchedulerCommand):
    help = """Create, list and revoke API tokens (Authorization: Bearer <token>).

A token is printed once, when created; only its hash is stored. Each token
is bound explicitly: to one tenant (--tenant T) or to every tenant
(--all-tenants, which may also schedule the platform's own tasks).

examples:
  manage.py api_tokens create deploy-team-a --role operator --tenant team-a --expires 90d
  manage.py api_tokens create dashboard --role viewer --all-tenants
  manage.py api_tokens list
  manage.py api_tokens revoke dashboard"""

    def add_arguments(self, parser: CommandParser) -> None:
        subs = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        create = subs.add_parser("create", help="create a token and print it once")
        create.add_argument("name", metavar="NAME", help="a unique name, e.g. the team or service using it")
        create.add_argument(
            "--role", required=True, choices=ApiToken.Role.values, help="viewer reads; operator also writes"
        )
        binding = create.add_mutually_exclusive_group()
        binding.add_argument("--tenant", default="", metavar="T", help="only this tenant's schedules and executions")
        binding.add_argument(
            "--all-tenants", action="store_true", help="every tenant's rows, and the platform's own tasks"
        )
        create.add_argument("--expires", metavar="DURATION", help="expire after e.g. 90d, 12h, 2w (default: never)")
        create.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
        listing = subs.add_parser("list", help="list the tokens (never the tokens themselves)")
        listing.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
        revoke = subs.add_parser("revoke", help="revoke a token: it stops working at once")
        revoke.add_argument("name", metavar="NAME", help="the name given at create")
        revoke.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")

    def handle(self, *args: Any, action: str, **options: Any) -> None:
        getattr(self, f"_{action}")(**options)

    def _create(
        self, *, name: str, role: str, tenant: str, all_tenants: bool, expires: str | None, json: bool, **options: Any
    ) -> None:
        name, tenant = name.strip(), tenant.strip()
        if not name or len(name) > NAME_MAX:
            raise CommandError(f"NAME must be 1 to {NAME_MAX} characters")
        if len(tenant) > TENANT_MAX:
            raise CommandError(f"--tenant must be at most {TENANT_MAX} characters")
        if not tenant and not all_tenants:
            # A token bound to nothing would see nothing: refuse it rather than guess a scope.
            raise CommandError("give --tenant T or --all-tenants: a token is bound to one tenant or to every tenant")
        now = dbclock.now()
        expires_at = None
        if expires is not None:
            age = parse_duration(expires, name="--expires")
            if not age:
                raise CommandError("--expires must be longer than 0")
            expires_at = now + age
        with transaction.atomic():
            if ApiToken.objects.filter(name=name).exists():
                raise CommandError(f"a token named {name!r} exists already; revoke it or choose another name")
            token, raw = operations.issue_token(
                name, actor=audit.CLI, role=role, tenant=tenant, all_tenants=all_tenants, expires_at=expires_at
            )
        data = {
            "name": name,
            "role": role,
            "tenant": tenant,
            "all_tenants": all_tenants,
            "expires_at": expires_at,
            "token": raw,
        }
        self.emit(
            data,
            as_json=json,
            text=[
                f"Created token {name!r} ({role}, {_binding(token)}, "
                f"{'expires ' + expires_at.isoformat() if expires_at else 'never expires'}).",
                "It is shown only now; store it safely:",
                raw,
            ],
        )

    def _list(self, *, json: bool, **options: Any) -> None:
        now = dbclock.now()
        tokens = list(ApiToken.objects.order_by("name"))
        rows = [
            {
                "name": t.name,
                "role": t.role,
                "tenant": t.tenant,
                "all_tenants": t.all_tenants,
                "created_at": t.created_at,
                "expires_at": t.expires_at,
                "last_used_at": t.last_used_at,
                "revoked_at": t.revoked_at,
                "usable": t.is_usable(now=now),
            }
            for t in tokens
        ]
        headers = ("NAME", "ROLE", "TENANT", "EXPIRES", "LAST USED", "STATE")
        cells = [
            (
                t.name,
                t.role,
                "(all)" if t.all_tenants else t.tenant or "(none)",
                text_value(t.expires_at),
                text_value(t.last_used_at),
                "revoked" if t.revoked_at else "usable" if t.is_usable(now=now) else "expired",
            )
            for t in tokens
        ]
        self.emit(rows, as_json=json, text=text_table(headers, cells) if tokens else "No API tokens.")

    def _revoke(self, *, name: str, json: bool, **options: Any) -> None:
        with transaction.atomic():
            token = ApiToken.objects.select_for_update().filter(name=name).first()
            if token is None:
                raise CommandError(f"no token named {name!r}")
            if token.revoked_at is not None:
                raise CommandError(f"token {name!r} was revoked already, at {token.revoked_at.isoformat()}")
            operations.revoke_token(token, actor=audit.CLI)
        self.emit({"name": name, "revoked_at": token.revoked_at}, as_json=json, text=f"Revoked token {name!r}.")


def _binding(token: ApiToken) -> str:
    return "all tenants" if token.all_tenants else f"tenant {token.tenant}" if token.tenant else "no tenant"
