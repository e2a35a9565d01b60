"""`make test`'s share of a property over several forms (spellings of one op, model families).

A derandomized property that draws the form among a dozen others meets each only by luck: forty draws met every
form of some properties and missed one of others (an example count changed, the whole draw changes). Here each form
is a pytest case of its own with a few examples, so every form is met on every run, in fewer compiles. A
parametrized test shares one derandomized seed, so each case first draws ``shift`` throwaway choices: its examples
come from a part of the stream of its own, not the same shapes and dtypes for every form. The fuzz twins keep
drawing the form from all of them, at the fuzz profile's count."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import strategies as st


def each_form(forms: Sequence[Any]):
    """Parametrize a test over ``forms`` as (form, shift): pass both to the strategy (``cases((form,), shift)``)."""
    return pytest.mark.parametrize("form, shift", [(f, i) for i, f in enumerate(forms)],
                                   ids=[" ".join(map(str, f)) if isinstance(f, tuple) else str(f) for f in forms])


def shifted(draw, shift: int) -> None:
    """Inside an ``st.composite`` strategy, before its first real draw: ``shift`` throwaway choices."""
    draw(st.lists(st.booleans(), min_size=shift, max_size=shift))
