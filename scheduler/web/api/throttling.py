"""Throttling per token (per user for sessions), at ``SCHEDULER_API_THROTTLE_RATE``."""

from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.throttling import SimpleRateThrottle

from scheduler.conf import settings
from scheduler.models import ApiToken


class PerCallerThrottle(SimpleRateThrottle):
    """One budget per token and one per user; anonymous requests are refused before they count."""

    scope = "caller"

    def get_rate(self) -> str:
        # Read on each request, so a changed setting applies at once (and in tests).
        return settings.API_THROTTLE_RATE

    def get_cache_key(self, request: Request, view: Any) -> str | None:
        if isinstance(request.auth, ApiToken):
            ident = f"token:{request.auth.pk}:{request.auth.token_hash[:16]}"
        elif request.user and request.user.is_authenticated:
            ident = f"user:{request.user.pk}"
        else:
            return None
        return self.cache_format % {"scope": self.scope, "ident": ident}
