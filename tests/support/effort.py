"""Hypothesis effort for tests whose examples are dear (real files, real
devices, a manager each): a share of the profile's max_examples instead of
a number of their own, so that the profile (tests/conftest.py, chosen with
`--hypothesis-profile`) decides how hard every property test works.

    @settings(max_examples=effort.examples(12))   # 12 at the default profile

Read when the test module is imported, after pytest loaded the profile.
"""
from hypothesis import settings

BASE_EXAMPLES = 200  # the default profile's max_examples (tests/conftest.py)


def scale() -> float:
    """The current profile's effort relative to the default profile's."""
    return settings().max_examples / BASE_EXAMPLES


def examples(n: int) -> int:
    """`n` examples at the default profile, scaled to the current one (at least 1)."""
    return max(1, round(n * scale()))


def long() -> bool:
    """Whether the profile asks for more than the default (e.g. "thorough")."""
    return scale() > 1
