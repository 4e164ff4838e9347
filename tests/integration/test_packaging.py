"""The wheel: the app with its migrations, templates, static files and type marker, and ranges the lock lies in."""

from __future__ import annotations

import zipfile
from email.parser import Parser

import pytest
from packaging.requirements import Requirement

import scheduler
from tests.support.wheel import DISTRIBUTION, ROOT, build


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return zipfile.ZipFile(build(tmp_path_factory.mktemp("wheel")))


def _metadata(wheel: zipfile.ZipFile) -> Parser:
    [name] = [name for name in wheel.namelist() if name.endswith(".dist-info/METADATA")]
    return Parser().parsestr(wheel.read(name).decode())


def _locked() -> dict[str, str]:
    """{normalised name: version} pinned in requirements.txt."""
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_wheel__holds_the_app_with_its_migrations_templates_static_files_and_type_marker(
    wheel: zipfile.ZipFile,
) -> None:
    names = set(wheel.namelist())
    sources = {path.relative_to(ROOT).as_posix() for path in (ROOT / "scheduler").rglob("*") if path.is_file()}
    expected = {name for name in sources if "__pycache__" not in name}
    # Every file of the app, migrations, templates and static files included, is in the wheel
    assert expected - names == set()
    assert "scheduler/py.typed" in names
    assert any(name.startswith("scheduler/migrations/0001_") for name in names)
    assert any(name.startswith("scheduler/templates/") for name in names)
    assert "scheduler/static/scheduler/admin.css" in names
    # And nothing of the demo project, the tests or the benchmarks
    dist_info = f"{DISTRIBUTION.replace('-', '_')}-{scheduler.__version__}.dist-info"
    assert {name.split("/")[0] for name in names} == {"scheduler", dist_info}


def test_wheel__metadata_names_the_version_license_and_ranges_the_locked_versions_satisfy(
    wheel: zipfile.ZipFile,
) -> None:
    metadata = _metadata(wheel)
    assert metadata["Name"] == DISTRIBUTION
    assert metadata["Version"] == scheduler.__version__
    assert metadata["License-Expression"] == "BSD-3-Clause"
    requirements = [Requirement(text) for text in metadata.get_all("Requires-Dist")]
    # Every runtime dependency has a range, and the version the suite runs on lies inside it
    locked = _locked()
    for requirement in requirements:
        name = requirement.name.lower().replace("_", "-")
        assert requirement.specifier, f"{name} has no range"
        assert name in locked, f"{name} is not pinned in requirements.txt"
        assert requirement.specifier.contains(locked[name], prereleases=True), (name, locked[name], str(requirement))
    core = {r.name.lower() for r in requirements if r.marker is None}
    assert {"django", "celery", "kombu", "redis", "django-celery-results", "croniter"} <= core
