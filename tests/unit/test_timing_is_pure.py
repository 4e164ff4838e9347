"""``scheduler.timing`` is pure: slot maths and policies that import no Django and no other layer of the app."""

from __future__ import annotations

import ast

from tests.support.source_scan import project_sources

#: What a timing module may import from the app: the other timing modules and the shared exceptions.
ALLOWED_APP_IMPORTS = ("scheduler.timing", "scheduler.exceptions")


def imports_of(source: str) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [
                f"{node.module}.{alias.name}" for alias in node.names if node.module == "scheduler"
            ]
    return names


def test_timing_modules_import_neither_django_nor_another_layer() -> None:
    timing = {path: source for path, source in project_sources().items() if path.startswith("scheduler/timing/")}
    assert len(timing) >= 3, sorted(timing)
    impure = [
        (path, name)
        for path, source in timing.items()
        for name in imports_of(source)
        if name.split(".")[0] == "django"
        or (name.startswith("scheduler") and name != "scheduler" and not name.startswith(ALLOWED_APP_IMPORTS))
    ]
    assert impure == []


def test_an_import_of_the_database_is_seen() -> None:
    source = "from django.db.models import Q\nfrom scheduler import timing, owners\nimport scheduler.models\n"
    assert imports_of(source) == [
        "django.db.models",
        "scheduler",
        "scheduler.timing",
        "scheduler.owners",
        "scheduler.models",
    ]
