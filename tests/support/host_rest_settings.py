"""A host project whose own ``REST_FRAMEWORK`` differs from everything the scheduler's API documents.

Session authentication only, the browsable renderer first, form parsers,
limit-offset pages of one, open permissions, no throttles, a versioning
scheme, a schema class that is not drf-spectacular's and an exception
handler of its own, and its own date-time formats. ``tests/acceptance/test_api_host_settings.py`` serves
the project with it and checks that the API still answers as documented.
"""

from __future__ import annotations

from project.settings import *  # noqa: F403 -- the demo project, with only REST_FRAMEWORK replaced

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.SessionAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
    "DEFAULT_THROTTLE_CLASSES": [],
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.BrowsableAPIRenderer",
        "rest_framework.renderers.TemplateHTMLRenderer",
        "rest_framework.renderers.JSONRenderer",
    ],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.FormParser", "rest_framework.parsers.MultiPartParser"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 1,
    "DEFAULT_FILTER_BACKENDS": [],
    "DEFAULT_VERSIONING_CLASS": "rest_framework.versioning.QueryParameterVersioning",
    "ALLOWED_VERSIONS": ["2"],
    "DEFAULT_SCHEMA_CLASS": "rest_framework.schemas.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "tests.support.host_rest_settings.host_errors",
    "DATETIME_FORMAT": "%d.%m.%Y",
    "DATETIME_INPUT_FORMATS": ["%d.%m.%Y %H:%M"],
}


def host_errors(exc: Exception, context: dict[str, object]) -> object:
    """The host's own error shape: ``{"error": ...}`` with status 418, for every error."""
    from rest_framework.response import Response

    return Response({"error": str(exc)}, status=418)
