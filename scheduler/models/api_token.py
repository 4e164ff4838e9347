"""ApiToken: a bearer token of the HTTP API, stored as a hash, with a role, a tenant and an expiry."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from django.db import models

#: Prefix of every token, so a leaked one is recognisable in logs and scanners.
TOKEN_PREFIX = "sch_"


def hash_token(raw: str) -> str:
    """Return the stored form of a token: its SHA-256 in hex.

    Tokens are 32 random bytes, so a plain hash cannot be guessed back; no
    salt is needed, and the hash can be looked up with one index probe.
    """
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiToken(models.Model):
    class Role(models.TextChoices):
        #: Reads everything of its tenant; changes nothing.
        VIEWER = "viewer", "viewer"
        #: Also creates, edits and deletes schedules and runs the actions.
        OPERATOR = "operator", "operator"

    name = models.CharField(max_length=100, unique=True)
    #: ``hash_token`` of the token; the token itself is shown once, at creation.
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    role = models.CharField(max_length=10, choices=Role.choices)
    #: The one tenant the token reads and changes.
    tenant = models.CharField(max_length=100, blank=True, default="")
    #: Every tenant instead (an unscoped token); a token with neither sees nothing.
    all_tenants = models.BooleanField(default=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("name",)
        verbose_name = "API token"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def issue(
        cls, name: str, *, role: str, tenant: str = "", all_tenants: bool = False, expires_at: datetime | None = None
    ) -> tuple[ApiToken, str]:
        """Create a token; return the row and the token itself, which is stored nowhere."""
        if all_tenants and tenant:
            raise ValueError("A token is bound to one tenant or to all tenants, not both.")
        raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
        token = cls.objects.create(
            name=name,
            token_hash=hash_token(raw),
            role=role,
            tenant=tenant,
            all_tenants=all_tenants,
            expires_at=expires_at,
        )
        return token, raw

    def is_usable(self, *, now: datetime) -> bool:
        """Return whether the token is neither revoked nor expired at ``now``."""
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)
