"""The OpenAPI schema's generator: drf-spectacular's, with the error answers every operation can give."""

from __future__ import annotations

from typing import Any, Literal

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import build_bearer_security_scheme_object
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse

from scheduler.web.api.serializers import ErrorSerializer

#: Answers of every operation besides its success: status -> (body, description).
ERRORS: dict[str, tuple[Any, str]] = {
    "400": (OpenApiTypes.OBJECT, "Bad input: field errors, {field: [message, ...]}, or {detail: message}."),
    "401": (ErrorSerializer, "No valid token or session."),
    "403": (ErrorSerializer, "Your role or tenant may not do this."),
    "404": (ErrorSerializer, "No such object (or it belongs to another tenant)."),
    "429": (ErrorSerializer, "Too many requests for this token; see Retry-After."),
}
#: Answers of every operation that takes a body, besides ``ERRORS``.
BODY_ERRORS: dict[str, tuple[Any, str]] = {
    "413": (ErrorSerializer, "The request body is larger than DATA_UPLOAD_MAX_MEMORY_SIZE."),
}


class ApiSchema(AutoSchema):
    def _get_response_bodies(self, direction: Literal["request", "response"] = "response") -> dict[str, Any]:
        responses = super()._get_response_bodies(direction)
        errors = {**ERRORS, **(BODY_ERRORS if self.method in ("POST", "PUT", "PATCH") else {})}
        for code, (body, description) in errors.items():
            if code not in responses:
                responses[code] = self._get_response_for_code(
                    OpenApiResponse(body, description=description), code, direction=direction
                )
        return responses


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """Describes ``BearerTokenAuthentication`` in the schema (registered by being defined)."""

    target_class = "scheduler.web.api.authentication.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: AutoSchema) -> dict[str, Any]:
        return build_bearer_security_scheme_object(header_name="Authorization", token_prefix="Bearer")
