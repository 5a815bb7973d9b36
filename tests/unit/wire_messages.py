"""Hypothesis strategies for frontend <-> vrnicd messages: what every wire version carries."""

from __future__ import annotations

from hypothesis import strategies as st

from vrnic.core.framing import INT_MAX, INT_MIN

values = st.recursive(
    st.none() | st.booleans() | st.integers(INT_MIN, INT_MAX) | st.integers(-40, 300)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=18) | st.dictionaries(st.text(max_size=10), inner, max_size=18),
    max_leaves=24,
)
messages = st.dictionaries(st.text(max_size=12), values, max_size=6)
