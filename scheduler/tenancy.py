"""Which tenants' rows a caller may see: one ``Scope`` per user or token, failing closed.

A caller is bound to one tenant, to every tenant, or to none. Nothing is
assumed: a staff user without an ``OperatorProfile`` and a token made
without a tenant see no row at all, until someone binds them explicitly.
Only superusers and callers bound to every tenant are trusted with the
platform's own tasks (``scheduler.task_policy``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from scheduler.models import ApiToken

_QS = TypeVar("_QS", bound="QuerySet[Any]")


@dataclass(frozen=True)
class Scope:
    """The tenants whose rows a caller may read and change."""

    #: The one tenant; ignored when ``every_tenant``.
    tenant: str = ""
    #: Every tenant, and the rows of no tenant: a superuser or an explicitly unscoped caller.
    every_tenant: bool = False

    @property
    def is_bound(self) -> bool:
        """Whether the caller is bound to exactly one tenant."""
        return not self.every_tenant and bool(self.tenant)

    @property
    def sees_nothing(self) -> bool:
        return not self.every_tenant and not self.tenant

    def filter(self, queryset: _QS) -> _QS:
        """Return ``queryset`` (of a model with a ``tenant`` field) narrowed to this scope."""
        if self.every_tenant:
            return queryset
        if not self.tenant:
            return queryset.none()
        return queryset.filter(tenant=self.tenant)

    def allows(self, tenant: str) -> bool:
        """Return whether a row of ``tenant`` is in this scope."""
        return self.every_tenant or (bool(self.tenant) and tenant == self.tenant)

    def describe(self) -> str:
        return "all tenants" if self.every_tenant else self.tenant or "no tenant (sees nothing)"


#: Every tenant: superusers, the deployer's command line, unscoped tokens.
EVERY_TENANT = Scope(every_tenant=True)
#: No row at all: a staff user or token that nobody bound.
NOTHING = Scope()


def scope_of_user(user: Any) -> Scope:
    """Return the scope of a Django user: superusers see all, others what their profile says, else nothing."""
    if not getattr(user, "is_authenticated", False) or not getattr(user, "is_active", False) or not user.pk:
        return NOTHING
    if user.is_superuser:
        return EVERY_TENANT
    from scheduler.models import OperatorProfile

    profile = OperatorProfile.objects.filter(user_id=user.pk).values("tenant", "all_tenants").first()
    if profile is None:
        return NOTHING
    return Scope(tenant=profile["tenant"], every_tenant=profile["all_tenants"])


def scope_of_token(token: ApiToken) -> Scope:
    """Return the scope of an API token: its tenant, every tenant if marked so, else nothing."""
    return Scope(tenant=token.tenant, every_tenant=token.all_tenants)
