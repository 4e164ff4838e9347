"""``manage.py api_tokens``: create (printed once, stored hashed), list, revoke, and bad input."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from django.core.cache import cache
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from scheduler.models import ApiToken, AuditEvent
from scheduler.models.api_token import hash_token

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_throttle() -> None:
    cache.clear()


def run(*argv: str) -> str:
    out = io.StringIO()
    call_command("api_tokens", *argv, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_api_tokens__create_prints_the_token_once_and_stores_its_hash() -> None:
    # When: a token is created
    data = json.loads(run("create", "dash", "--role", "viewer", "--tenant", "team-a", "--expires", "90d", "--json"))

    # Then: the token is printed, only its hash is stored, and it authenticates
    token = ApiToken.objects.get(name="dash")
    assert token.token_hash == hash_token(data["token"]) and data["token"] not in token.token_hash
    assert (token.role, token.tenant) == ("viewer", "team-a")
    assert 89 <= (token.expires_at - token.created_at).days <= 90
    client = Client(HTTP_AUTHORIZATION=f"Bearer {data['token']}")
    assert client.get("/api/v1/schedules/").status_code == 200
    # And list never shows it
    listing = run("list")
    assert "dash" in listing and data["token"] not in listing


def test_api_tokens__revoked_and_expired_tokens_answer_401() -> None:
    # Given: a token in use
    raw = json.loads(run("create", "ci", "--role", "operator", "--all-tenants", "--json"))["token"]
    client = Client(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert client.get("/api/v1/executions/").status_code == 200

    # When: it is revoked; Then: 401, and list says so
    run("revoke", "ci")
    assert client.get("/api/v1/executions/").status_code == 401
    assert json.loads(run("list", "--json"))[0]["usable"] is False
    # And an unknown token or a malformed header is 401 too
    assert Client(HTTP_AUTHORIZATION="Bearer nope").get("/api/v1/executions/").status_code == 401
    assert Client(HTTP_AUTHORIZATION="Bearer a b").get("/api/v1/executions/").status_code == 401


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("create", "x", "--role", "viewer", "--all-tenants", "--expires", "soon"), "is not a duration"),
        (("create", "x", "--role", "viewer", "--all-tenants", "--expires", "0d"), "longer than 0"),
        (("create", " ", "--role", "viewer", "--all-tenants"), "NAME must be"),
        (("create", "x", "--role", "viewer", "--tenant", "t" * 101), "at most 100"),
        (("create", "x", "--role", "viewer"), "give --tenant T or --all-tenants"),
        (("create", "x", "--role", "viewer", "--tenant", "  "), "give --tenant T or --all-tenants"),
        (("create", "x", "--role", "viewer", "--tenant", "a", "--all-tenants"), "not allowed with argument"),
        (("revoke", "missing"), "no token named 'missing'"),
    ],
)
def test_api_tokens__bad_input_is_one_line_and_changes_nothing(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(CommandError, match=message) as raised:
        run(*argv)
    assert len(str(raised.value).splitlines()) == 1
    assert not ApiToken.objects.exists()
    assert not AuditEvent.objects.exists()


def test_api_tokens__duplicate_name_and_double_revoke_are_refused() -> None:
    run("create", "dup", "--role", "viewer", "--all-tenants")
    with pytest.raises(CommandError, match="exists already"):
        run("create", "dup", "--role", "operator", "--all-tenants")
    run("revoke", "dup")
    with pytest.raises(CommandError, match="revoked already"):
        run("revoke", "dup")
    assert ApiToken.objects.get(name="dup").role == "viewer"


def test_api_tokens__create_binds_one_tenant_or_every_tenant_explicitly() -> None:
    # When: one token is made for a tenant and one for every tenant
    bound = json.loads(run("create", "team", "--role", "operator", "--tenant", "team-a", "--json"))
    unscoped = json.loads(run("create", "platform", "--role", "viewer", "--all-tenants", "--json"))

    # Then: each is stored with its binding, and says so
    assert (bound["tenant"], bound["all_tenants"]) == ("team-a", False)
    assert (unscoped["tenant"], unscoped["all_tenants"]) == ("", True)
    assert ApiToken.objects.filter(name="team", tenant="team-a", all_tenants=False).exists()
    assert ApiToken.objects.filter(name="platform", tenant="", all_tenants=True).exists()
    assert "all tenants" in run("create", "other", "--role", "viewer", "--all-tenants")
    assert "tenant team-a" in run("create", "other-a", "--role", "viewer", "--tenant", "team-a")


def test_api_tokens__list_tells_all_tenants_from_none() -> None:
    # Given: a token of a tenant, one of every tenant, and one bound to nothing (made before binding was required)
    run("create", "team", "--role", "viewer", "--tenant", "team-a")
    run("create", "platform", "--role", "viewer", "--all-tenants")
    ApiToken.issue("legacy", role="viewer")

    # When: they are listed
    rows = {line.split()[0]: line.split()[2] for line in run("list").splitlines()[1:]}
    data = {row["name"]: row for row in json.loads(run("list", "--json"))}

    # Then: "(all)" only for the all-tenants token, "(none)" for the unbound one
    assert rows == {"legacy": "(none)", "platform": "(all)", "team": "team-a"}
    assert [(data[n]["tenant"], data[n]["all_tenants"]) for n in ("legacy", "platform", "team")] == [
        ("", False),
        ("", True),
        ("team-a", False),
    ]


def test_api_tokens__bad_role_from_the_shell_exits_non_zero_with_one_line(process_env: dict[str, str]) -> None:
    # When: the command runs as a process with a role that does not exist
    done = subprocess.run(
        [sys.executable, "manage.py", "api_tokens", "create", "x", "--role", "admin"],
        env=process_env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    # Then: exit 2 and one line naming the choices
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "invalid choice: 'admin'" in lines[0]
