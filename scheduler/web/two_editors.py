"""Two people with one row's admin page open: each page writes what its operator changed, and never undoes the other's.

A change page carries the value it showed of each field (``initial-<name>``).
Saved, it writes only the fields its operator changed, so what someone else
(another operator, a worker counting runs) wrote since stands; a field that
someone else changed too is refused, and the page is shown again saying so.
The row is locked before that check, so of two pages saved at once one is
saved and the other told.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from django.db import transaction
from django.http import HttpRequest
from django.utils.functional import cached_property


class KeepsOthersChanges(forms.ModelForm):
    """A row's change form that writes only what its operator changed (its ``clean()`` drops the rest)."""

    #: Fields whose stored value never goes to the browser (a secret): left empty, the stored value stays.
    never_shown: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            for name in self._stored_fields():
                self.fields[name].show_hidden_initial = True

    def _stored_fields(self) -> list[str]:
        return [name for name in self.fields if name in self.initial and name not in self.never_shown]

    def _shown(self, name: str) -> Any:
        """What the posted page says it showed of field ``name`` (its ``initial-<name>``); ``None`` if it says nothing."""
        bound = self[name]
        hidden = bound.field.hidden_widget()
        if not bound.field.show_hidden_initial or hidden.value_omitted_from_data(
            self.data, self.files, bound.html_initial_name
        ):
            return None
        return hidden.value_from_datadict(self.data, self.files, bound.html_initial_name)

    @cached_property
    def changed_data(self) -> list[str]:
        # Against what the page showed where it says so; else (a form posted by a script) against the stored row.
        return [name for name in self.fields if self._changed(name)]

    def _changed(self, name: str) -> bool:
        bound, shown = self[name], self._shown(name)
        if name in self.never_shown and not bound.data:
            return False
        if shown is None:
            return bound.field.has_changed(bound.initial, bound.data)
        try:
            return bound.field.has_changed(bound.field.to_python(shown), bound.data)
        except ValidationError:
            return True

    def keep_what_others_wrote(self) -> None:
        """Drop what this page's operator left as shown; refuse a field someone else changed since it was shown."""
        if self.instance.pk is None:
            return  # a new row: nobody else wrote it
        for name in self.fields:
            if name not in self.initial:
                continue  # no column of the row (a form's own field)
            shown = self._shown(name)
            if name not in self.changed_data:
                self.cleaned_data.pop(name, None)  # the stored value stays, whoever wrote it since
            elif shown is not None and self[name].field.has_changed(self[name].initial, shown):
                self.add_error(
                    name,
                    f"This was changed by someone else since this page was opened. "
                    f"Open the {self._meta.model._meta.verbose_name} again to see their change, then make yours.",
                )

    def clean(self) -> dict[str, Any]:
        super().clean()
        self.keep_what_others_wrote()
        return self.cleaned_data


class LocksEditedRow:
    """An admin whose change page's save locks its row first (in the admin's transaction), for ``KeepsOthersChanges``."""

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        row = super().get_object(request, object_id, from_field)  # type: ignore[misc]
        if row is None or request.method != "POST" or not transaction.get_connection().in_atomic_block:
            return row
        return type(row)._default_manager.select_for_update().filter(pk=row.pk).first()
