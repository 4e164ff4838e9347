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

from scheduler.models import ApiToken
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
    raw = json.loads(run("create", "ci", "--role", "operator", "--json"))["token"]
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
        (("create", "x", "--role", "viewer", "--expires", "soon"), "is not a duration"),
        (("create", "x", "--role", "viewer", "--expires", "0d"), "longer than 0"),
        (("create", " ", "--role", "viewer"), "NAME must be"),
        (("create", "x", "--role", "viewer", "--tenant", "t" * 101), "at most 100"),
        (("revoke", "missing"), "no token named 'missing'"),
    ],
)
def test_api_tokens__bad_input_is_one_line_and_changes_nothing(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        run(*argv)
    assert not ApiToken.objects.exists()


def test_api_tokens__duplicate_name_and_double_revoke_are_refused() -> None:
    run("create", "dup", "--role", "viewer")
    with pytest.raises(CommandError, match="exists already"):
        run("create", "dup", "--role", "operator")
    run("revoke", "dup")
    with pytest.raises(CommandError, match="revoked already"):
        run("revoke", "dup")
    assert ApiToken.objects.get(name="dup").role == "viewer"


def test_api_tokens__bad_role_from_the_shell_exits_non_zero_with_one_line(process_env: dict[str, str]) -> None:
    # When: the command runs as a process with a role that does not exist
    done = subprocess.run(
        [sys.executable, "manage.py", "api_tokens", "create", "x", "--role", "admin"],
        env=process_env, capture_output=True, text=True, timeout=60,
    )

    # Then: exit 2 and one line naming the choices
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "invalid choice: 'admin'" in lines[0]
