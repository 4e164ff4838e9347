"""OperatorProfile: the tenant a staff user is bound to, for the admin and the API."""
from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models


class OperatorProfile(models.Model):
    """A staff user with a profile whose tenant is set sees and changes only that tenant's rows.

    A user without a profile (or with an empty tenant) and every superuser see all.
    """

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="operator_profile")
    tenant = models.CharField(max_length=100, blank=True, default="")

    class Meta:
        verbose_name = "operator profile"

    def __str__(self) -> str:
        return f"{self.user} ({self.tenant or 'all tenants'})"


def tenant_of(user: Any) -> str:
    """Return the tenant ``user`` is bound to; empty for superusers and unscoped users."""
    if not getattr(user, "is_authenticated", False) or getattr(user, "is_superuser", False) or not user.pk:
        return ""
    return OperatorProfile.objects.filter(user_id=user.pk).values_list("tenant", flat=True).first() or ""
