"""Fast paths: code that mirrors private internals of kombu, Celery and Django for speed, each with its way back.

Each module here does what a public API does (``send_task``,
``bulk_create``, compiling a queryset per call, django-celery-results'
``store_result``) with the upstream code's own internals, named with the
versions they were checked against in its header. What the package guarantees is that a change of those internals
costs speed, never correctness: on first use in a process each fast path
compares its result with its slow path's for the input at hand, and where
they differ, or where a call meets an internal that is gone or changed
(``AttributeError``, ``TypeError``, ``ImportError``, ``KeyError``, raised
before anything was written or sent), the process takes the slow path from
then on, with one warning in the log and one count on
``scheduler_fastpath_fallbacks_total{path}`` (``scheduler.fastpath.guard``).
Broker and database errors are not breakage: they propagate as they would
from the slow path.
"""
