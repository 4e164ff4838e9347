"""OperatorProfile: the tenant a staff user is bound to, for the admin and the API."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q


class OperatorProfile(models.Model):
    """A staff user sees and changes only the rows of the tenant its profile names, or every tenant's if marked so.

    Binding fails closed: a staff user without a profile, or with neither a
    tenant nor ``all_tenants``, sees no row (superusers see all regardless).
    """

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="operator_profile")
    tenant = models.CharField(max_length=100, blank=True, default="")
    #: Sees and changes every tenant's rows, and may schedule the platform's own tasks.
    all_tenants = models.BooleanField(
        default=False, help_text="Every tenant's rows, and the platform's own tasks. Leave the tenant empty."
    )

    class Meta:
        verbose_name = "operator profile"
        constraints = [
            models.CheckConstraint(condition=Q(all_tenants=False) | Q(tenant=""), name="operator_profile_one_binding"),
        ]

    def __str__(self) -> str:
        return f"{self.user} ({'all tenants' if self.all_tenants else self.tenant or 'no tenant'})"

    def clean(self) -> None:
        if self.all_tenants and self.tenant:
            raise ValidationError({"tenant": "Leave the tenant empty for a profile bound to all tenants."})
