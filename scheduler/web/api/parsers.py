"""The API's request bodies: JSON no larger than Django's upload limit, no deeper than the arguments allow, all text.

An oversized body answers 413 with a JSON error, without being read; a body
nested too deep (or too deep for ``json.loads`` itself, which would raise
``RecursionError``, a 500) answers 400. ``BoundedBodies`` sets this on the
API's views themselves, so the API does not depend on the host's
``REST_FRAMEWORK`` setting.

Which check fires depends on DRF: since 3.16 it reads a JSON body through
Django's ``request.body``, whose Content-Length check raises
``RequestDataTooBig`` before reading (turned into the 413 here); older
versions hand the parser the raw stream, which ``BoundedJSONParser`` checks
by its Content-Length and reads no further than the limit (a chunked body).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

from django.conf import settings as django_settings
from django.core.exceptions import RequestDataTooBig
from rest_framework import exceptions, status
from rest_framework.parsers import BaseParser, JSONParser, get_encoding  # type: ignore[attr-defined]  # DRF 3.18 API; the 3.16 stubs lack it
from rest_framework.response import Response
from rest_framework.utils import json

if TYPE_CHECKING:
    from rest_framework.views import APIView as _ViewBase
else:
    _ViewBase = object  # a mixin: the view class supplies APIView

from scheduler.conf import settings
from scheduler.limits import LONE_SURROGATE, nests_deeper_than, strings_in

#: Bytes read from the body at a time.
CHUNK = 64 * 1024


class RequestTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The request body is larger than this server accepts (DATA_UPLOAD_MAX_MEMORY_SIZE)."
    default_code = "request_too_large"


def max_depth() -> int:
    """Return the deepest nesting a body may have: twice ``SCHEDULER_ARGS_MAX_DEPTH``.

    The margin lets arguments a little past their own limit reach the
    field's validation, which names that limit.
    """
    return 2 * settings.ARGS_MAX_DEPTH


class BoundedJSONParser(JSONParser):
    """JSON bodies of at most ``DATA_UPLOAD_MAX_MEMORY_SIZE`` bytes (else 413) and ``max_depth()`` levels (else 400)."""

    def parse(
        self, stream: IO[bytes], media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> Any:
        parser_context = parser_context or {}
        encoding = get_encoding(parser_context)
        body = _read(stream, parser_context.get("request"), django_settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
        depth = max_depth()
        too_deep = exceptions.ParseError(f"JSON parse error - nested more than {depth} levels deep.")
        try:
            data = json.loads(body.decode(encoding), parse_constant=json.strict_constant if self.strict else None)
        except ValueError as exc:  # UnicodeDecodeError included
            raise exceptions.ParseError(f"JSON parse error - {exc}") from None
        except RecursionError:
            # Deeper than the interpreter can parse at all.
            raise too_deep from None
        if nests_deeper_than(data, depth):
            raise too_deep
        if any(LONE_SURROGATE.search(text) for text in strings_in(data)):
            # An escape like "\ud800" alone is valid JSON, but no text: no database would store it.
            raise exceptions.ParseError("JSON parse error - a string holds a lone surrogate (\\ud800-\\udfff).")
        return data


def _read(stream: IO[bytes], request: Any, limit: int | None) -> bytes:
    """Return the body, refusing one over ``limit`` bytes: by its Content-Length before reading, else while reading.

    A body without a usable Content-Length (chunked) is read only up to one
    byte past the limit.
    """
    if limit is None:
        return stream.read()
    declared = _declared_length(getattr(request, "META", {}))
    if declared > limit:
        raise too_large(declared, limit)
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = stream.read(min(CHUNK, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        raise too_large(None, limit)
    return b"".join(chunks)


def too_large(declared: int | None, limit: int) -> RequestTooLarge:
    """Return the 413 for a body of ``declared`` bytes (None: more than ``limit``, no Content-Length)."""
    size = f"more than {limit:,}" if declared is None else f"{declared:,}"
    return RequestTooLarge(
        f"The request body is {size} bytes; at most {limit:,} bytes are accepted (DATA_UPLOAD_MAX_MEMORY_SIZE)."
    )


def _declared_length(meta: Any) -> int:
    try:
        return int(meta.get("CONTENT_LENGTH") or meta.get("HTTP_CONTENT_LENGTH") or 0)
    except (TypeError, ValueError):
        return 0


class BoundedBodies(_ViewBase):
    """Mixin of every API view: ``BoundedJSONParser``, and Django's own size refusal answered as its 413."""

    parser_classes: Sequence[type[BaseParser]] = (BoundedJSONParser,)

    def handle_exception(self, exc: Exception) -> Response:
        if isinstance(exc, RequestDataTooBig):
            # Django's refusal would be an HTML 400; the same refusal as the parser's, in JSON.
            declared = _declared_length(self.request.META)
            limit = django_settings.DATA_UPLOAD_MAX_MEMORY_SIZE
            exc = too_large(declared if declared > limit else None, limit)
        return super().handle_exception(exc)
