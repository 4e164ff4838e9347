"""Roles: a viewer reads, an operator also writes; the cluster-wide reconcile needs an unscoped operator."""

from __future__ import annotations

from typing import Any

from rest_framework import permissions
from rest_framework.request import Request

from scheduler.web.api.authentication import caller
from scheduler.web.permissions import OPERATOR_GROUP, VIEWER_GROUP


class HasRole(permissions.BasePermission):
    """Any role reads; only an operator writes. A user who is not staff has no role.

    Checked before the object is looked up, so a viewer's write answers 403
    whichever object it names, and reveals nothing about it.
    """

    message = f"Your role may only read: writing needs an operator token or the {OPERATOR_GROUP!r} group."

    def has_permission(self, request: Request, view: Any) -> bool:
        if not request.user or not request.user.is_authenticated:
            return False
        who = caller(request)
        if not who.role:
            self.message = f"Only staff users in the {VIEWER_GROUP!r} or {OPERATOR_GROUP!r} group may use the API."
            return False
        return request.method in permissions.SAFE_METHODS or who.is_operator


class Unscoped(permissions.BasePermission):
    """Only a caller bound to no tenant: the action touches every tenant's rows."""

    message = "This action touches every tenant: it needs an operator bound to no tenant."

    def has_permission(self, request: Request, view: Any) -> bool:
        return caller(request).scope.every_tenant
