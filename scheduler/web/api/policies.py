"""What every API view sets itself, so that the host's ``REST_FRAMEWORK`` setting changes none of it.

A host project has its own DRF defaults (JWT or session-only
authentication, a browsable renderer, another pagination class or error
handler); DRF applies them to every view that does not say otherwise. The
API's views say otherwise for each: bearer tokens and sessions, roles, the
per-caller throttle, JSON in (bounded) and out, no versioning, DRF's own
error answers (``{"detail": ...}`` and field errors), drf-spectacular's
schema. Pagination and filters are set by each view set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from drf_spectacular.generators import EndpointEnumerator, SchemaGenerator
from drf_spectacular.utils import extend_schema as spectacular_extend_schema
from rest_framework.authentication import BaseAuthentication, SessionAuthentication
from rest_framework.metadata import SimpleMetadata
from rest_framework.negotiation import BaseContentNegotiation, DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.schemas.inspectors import DefaultSchema, ViewInspector
from rest_framework.throttling import BaseThrottle
from rest_framework.versioning import BaseVersioning
from rest_framework.views import exception_handler

from scheduler.web.api.authentication import BearerTokenAuthentication
from scheduler.web.api.parsers import BoundedBodies
from scheduler.web.api.permissions import HasRole
from scheduler.web.api.schema import ApiSchema
from scheduler.web.api.throttling import PerCallerThrottle

if TYPE_CHECKING:
    from rest_framework.permissions import _PermissionClass


_F = TypeVar("_F", bound=Callable[..., Any])  # a view class or method


class OwnSchema(DefaultSchema):
    """``view.schema``: the API's ``ApiSchema``, whatever ``DEFAULT_SCHEMA_CLASS`` names."""

    def __get__(self, instance: Any, owner: Any) -> Any:
        result = ViewInspector.__get__(self, instance, owner)
        if not isinstance(result, OwnSchema):
            return result  # a schema set on the view instance
        inspector = ApiSchema()
        inspector.view = instance
        return inspector


class OwnPolicies(BoundedBodies):
    """Mixin of every API view: its policies, none taken from the host's ``REST_FRAMEWORK``."""

    authentication_classes: Sequence[type[BaseAuthentication]] = (BearerTokenAuthentication, SessionAuthentication)
    permission_classes: Sequence[_PermissionClass] = (HasRole,)
    throttle_classes: Sequence[type[BaseThrottle]] = (PerCallerThrottle,)
    renderer_classes: Sequence[type[BaseRenderer]] = (JSONRenderer,)
    content_negotiation_class: type[BaseContentNegotiation] = DefaultContentNegotiation
    # DRF's APIView holds the class here; its stubs type the attribute as an instance.
    metadata_class = SimpleMetadata  # type: ignore[assignment]
    versioning_class: type[BaseVersioning] | None = None
    schema = OwnSchema()

    def get_exception_handler(self) -> Any:
        return exception_handler


class OwnEndpoints(EndpointEnumerator):
    """The API's own endpoints only: the host's other DRF views (and their schema classes) stay out of its schema."""

    def should_include_endpoint(self, path: str, callback: Any) -> bool:
        view = getattr(callback, "cls", None)
        return (
            isinstance(view, type) and issubclass(view, OwnPolicies) and super().should_include_endpoint(path, callback)
        )


class OwnSchemaGenerator(SchemaGenerator):
    """``/api/schema/``: the API's endpoints, wherever the host mounted ``scheduler.urls``."""

    endpoint_inspector_cls = OwnEndpoints


def extend_schema(**kwargs: Any) -> Callable[[_F], _F]:
    """drf-spectacular's ``extend_schema``, built on ``ApiSchema`` for a view method too.

    On a method, drf-spectacular builds on ``DEFAULT_SCHEMA_CLASS`` as the
    host sets it when the module is imported; a host's DRF ``AutoSchema``
    there would break the API's schema.
    """

    def decorator(f: _F) -> _F:
        if callable(f) and not isinstance(f, type) and getattr(f, "schema", None) is None:
            extra = getattr(f, "kwargs", None) or {}
            extra.setdefault("schema", ApiSchema)
            f.kwargs = extra  # type: ignore[attr-defined]  # drf-spectacular reads it off the view method
        return spectacular_extend_schema(**kwargs)(f)

    return decorator
