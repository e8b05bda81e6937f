"""The example-app comparison's verdict (``python -m tests.compat.apps``): a pure function."""

from __future__ import annotations

from importlib.util import find_spec

from tests.compat.apps.__main__ import APPS, differences


def test_a_field_that_differs_is_a_regression_unless_it_is_intended() -> None:
    plain = {"order": [1, 2], "ran": 3, "only_plain": True}
    kumiko = {"order": [2, 1], "ran": 3}
    unintended, intended = differences("app", plain, kumiko, {"app.order": "a reason"})
    assert unintended == ["only_plain"]
    assert intended == ["order"]


def test_equal_outcomes_have_no_differences() -> None:
    assert differences("app", {"ran": [1]}, {"ran": [1]}, {}) == ([], [])


def test_every_listed_app_is_a_module_of_the_package() -> None:
    for app in APPS:
        assert find_spec(f"tests.compat.apps.{app}") is not None, app
