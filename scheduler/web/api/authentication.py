"""Who is calling: an API token (``Authorization: Bearer <token>``) or a staff user's session.

``caller(request)`` turns either into one ``Caller`` with a role and a
tenant; permissions, querysets and the audit trail read only that.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db.models import Q
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from scheduler import dbclock
from scheduler.models import ApiToken, AuditEvent
from scheduler.models.api_token import hash_token
from scheduler.ops import audit
from scheduler.tenancy import Scope, scope_of_token, scope_of_user
from scheduler.web.permissions import OPERATOR_GROUP, VIEWER_GROUP

#: ``last_used_at`` is kept to this precision.
LAST_USED_RESOLUTION = timedelta(minutes=1)


class TokenUser:
    """``request.user`` for a token: authenticated, not a Django user."""

    is_authenticated = True
    is_anonymous = False
    is_staff = False
    is_superuser = False
    pk = None

    def __init__(self, token: ApiToken) -> None:
        self.token = token

    def __str__(self) -> str:
        return f"token {self.token.name}"

    def get_username(self) -> str:
        return self.token.name


class BearerTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer <token>``: an unrevoked, unexpired ``ApiToken``."""

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[TokenUser, ApiToken] | None:
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Invalid Authorization header: expected 'Bearer <token>'.")
        try:
            raw = header[1].decode()
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("Invalid token.") from None
        token = ApiToken.objects.filter(token_hash=hash_token(raw)).first()
        now = dbclock.now()
        if token is None or not token.is_usable(now=now):
            raise exceptions.AuthenticationFailed("Invalid, expired or revoked token.")
        # At most one write per token a minute: a read must not queue behind
        # other writers (SQLite has one writer at a time) on every request.
        stale = Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - LAST_USED_RESOLUTION)
        ApiToken.objects.filter(stale, pk=token.pk).update(last_used_at=now)
        return TokenUser(token), token

    def authenticate_header(self, request: Request) -> str:
        # Present, so that a missing or bad token answers 401 rather than 403.
        return f'{self.keyword} realm="api"'


@dataclass(frozen=True)
class Caller:
    """An authenticated caller as the API sees it."""

    #: ``viewer``, ``operator``, or empty for a user in neither group (no access).
    role: str
    scope: Scope
    actor: audit.Actor

    @property
    def is_operator(self) -> bool:
        return self.role == ApiToken.Role.OPERATOR


#: Where ``caller()`` caches its answer on the request.
_CALLER_ATTRIBUTE = "_scheduler_caller"


def caller(request: Request) -> Caller:
    """Return the caller of an authenticated request (cached on the request)."""
    cached = getattr(request, _CALLER_ATTRIBUTE, None)
    if cached is not None:
        return cached
    if isinstance(request.auth, ApiToken):
        token = request.auth
        result = Caller(
            token.role, scope_of_token(token), audit.Actor(AuditEvent.ActorType.TOKEN, token.name, token.tenant)
        )
    else:
        result = Caller(user_role(request.user), scope_of_user(request.user), audit.user_actor(request.user))
    setattr(request, _CALLER_ATTRIBUTE, result)
    return result


def user_role(user: Any) -> str:
    """Return a session user's role from its groups: superusers and the operator group operate, the viewer group views.

    Being staff alone grants nothing: it only lets a user log in to the admin.
    """
    if not user.is_active or not user.is_staff:
        return ""
    if user.is_superuser:
        return ApiToken.Role.OPERATOR
    groups = set(user.groups.filter(name__in=(OPERATOR_GROUP, VIEWER_GROUP)).values_list("name", flat=True))
    if OPERATOR_GROUP in groups:
        return ApiToken.Role.OPERATOR
    return ApiToken.Role.VIEWER if VIEWER_GROUP in groups else ""
