"""Hypothesis strategy shared by the segments' tests: a chain of units to cut into segments."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from fxpipe.segments import kept_by_cuts, kept_by_lifetimes, sent_by_lifetimes

_bytes = st.one_of(st.just(0.0), st.floats(1.0, 1e4), st.integers(1, 64).map(float))


@st.composite
def chains(draw, most: int = 7):
    """Units' saved bytes, what segments keep at cuts and what of it the stage sends (from
    random lifetimes, or per cut), and a range."""
    units = draw(st.integers(1, most))
    saved = np.array(draw(st.lists(_bytes, min_size=units, max_size=units)))
    sent = None
    if draw(st.booleans()):
        lifetimes = np.triu(np.array(draw(st.lists(
            _bytes, min_size=units * units, max_size=units * units))).reshape(units, units), 1)
        out, sent = kept_by_lifetimes(lifetimes), sent_by_lifetimes(lifetimes)
    else:
        out = kept_by_cuts(np.array(draw(st.lists(_bytes, min_size=units - 1,
                                                  max_size=units - 1))))
    start = draw(st.integers(0, units - 1))
    return out, sent, saved, start, draw(st.integers(start + 1, units))
