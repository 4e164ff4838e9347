"""``AnyOf`` finds what ``__in`` finds, with the list sent as one array on PostgreSQL."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from scheduler.models import Schedule
from scheduler.models.lookups import AnyOf
from tests.support.factories import make_schedule

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("wanted", [[], [0], [0, 2], [0, 1, 2]], ids=["none", "one", "some", "all"])
def test_any_of__finds_what_in_finds(wanted: list[int]) -> None:
    ids = [make_schedule(f"s{index}").pk for index in range(3)]
    values = [ids[index] for index in wanted] + [max(ids) + 1000]  # and one that is no row's

    with CaptureQueriesContext(connection) as queries:
        found = sorted(Schedule.objects.filter(AnyOf(F("pk"), values)).values_list("pk", flat=True))

    assert found == sorted(Schedule.objects.filter(pk__in=values).values_list("pk", flat=True))
    assert found == sorted(ids[index] for index in wanted)
    if connection.vendor == "postgresql":  # one parameter, whatever the count
        assert "= ANY(" in queries[0]["sql"]


def test_any_of__an_empty_list_finds_nothing() -> None:
    make_schedule("s")
    assert not Schedule.objects.filter(AnyOf(F("pk"), [])).exists()
    assert Schedule.objects.exclude(AnyOf(F("pk"), [])).count() == 1


def test_any_of__sends_an_array_of_the_column_type() -> None:
    # psycopg types a list of small ids smallint[]; PostgreSQL then compares a bigint
    # column with it element by element for every row instead of hashing the array once.
    schedule = make_schedule("s")

    with CaptureQueriesContext(connection) as queries:
        by_pk = list(Schedule.objects.filter(AnyOf(F("pk"), [schedule.pk])).values_list("pk", flat=True))
        by_name = list(Schedule.objects.filter(AnyOf(F("name"), ["s", "t"])).values_list("pk", flat=True))

    assert by_pk == by_name == [schedule.pk]
    if connection.vendor == "postgresql":
        assert "= ANY(" in queries[0]["sql"] and "::bigint[])" in queries[0]["sql"]
        assert "::varchar(200)[])" in queries[1]["sql"]
