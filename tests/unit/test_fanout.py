"""The pure parts of per-tenant fan-out: tenant-list validation, batches, child ids."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kumiko_dramatiq.errors import KumikoError, TenantListError
from kumiko_dramatiq.ids import child_message_id
from kumiko_dramatiq.worker.fanout import CHILD_BATCH_SIZE, batches, tenant_ids

JOB = "reports:job:nightly"


# -- tenant_ids: what the resolver may return ---------------------------------


def test_a_list_of_ids_is_kept_in_order() -> None:
    assert tenant_ids(JOB, ["b", "a", "c"]) == ["b", "a", "c"]


def test_duplicates_collapse_keeping_the_first_seen_order() -> None:
    assert tenant_ids(JOB, ["b", "a", "b", "c", "a"]) == ["b", "a", "c"]


def test_any_iterable_of_ids_is_accepted() -> None:
    def generate() -> Iterator[str]:
        yield from ("a", "b")

    assert tenant_ids(JOB, ("a", "b")) == ["a", "b"]
    assert tenant_ids(JOB, generate()) == ["a", "b"]
    assert tenant_ids(JOB, {"a": 1}) == ["a"]


def test_an_empty_iterable_is_no_tenants() -> None:
    assert tenant_ids(JOB, []) == []


def test_unicode_and_separator_characters_are_valid_ids() -> None:
    assert tenant_ids(JOB, ["ü:1", '["x"]', " "]) == ["ü:1", '["x"]', " "]


@pytest.mark.parametrize(
    "resolved",
    [
        pytest.param(None, id="none"),
        pytest.param(42, id="an-int"),
        pytest.param(object(), id="an-object"),
    ],
)
def test_a_non_iterable_is_rejected_naming_the_job_and_the_value(resolved: Any) -> None:
    with pytest.raises(TenantListError, match="must return an iterable of tenant ids") as caught:
        tenant_ids(JOB, resolved)
    assert str(caught.value).startswith(f"{JOB}: get_active_tenant_ids() ")
    assert str(caught.value).endswith(f"got {resolved!r}")


@pytest.mark.parametrize(
    "resolved",
    [
        pytest.param("tenant-a", id="str"),
        pytest.param(b"tenant-a", id="bytes"),
        pytest.param(bytearray(b"ab"), id="bytearray"),
    ],
)
def test_a_single_string_is_not_an_iterable_of_ids(resolved: Any) -> None:
    with pytest.raises(TenantListError, match="not a string") as caught:
        tenant_ids(JOB, resolved)
    assert repr(resolved) in str(caught.value)


@pytest.mark.parametrize(
    ("resolved", "index", "bad"),
    [
        pytest.param([""], 0, "", id="empty-string"),
        pytest.param([1], 0, 1, id="int"),
        pytest.param(["a", None], 1, None, id="none-after-a-good-id"),
        pytest.param(["a", b"b"], 1, b"b", id="bytes"),
        pytest.param(["a", "a", ["c"]], 2, ["c"], id="nested-list"),
    ],
)
def test_an_invalid_id_is_rejected_naming_the_job_its_position_and_value(
    resolved: list[Any], index: int, bad: Any
) -> None:
    with pytest.raises(TenantListError) as caught:
        tenant_ids(JOB, resolved)
    assert str(caught.value) == (
        f"{JOB}: get_active_tenant_ids()[{index}] must be a non-empty string, got {bad!r}"
    )


def test_the_error_is_a_kumiko_error_and_a_value_error() -> None:
    with pytest.raises(TenantListError) as caught:
        tenant_ids(JOB, [None])
    assert isinstance(caught.value, KumikoError)
    assert isinstance(caught.value, ValueError)
    assert caught.value.job_name == JOB
    assert caught.value.value is None


def test_a_huge_bad_value_is_shortened_in_the_message() -> None:
    with pytest.raises(TenantListError) as caught:
        tenant_ids(JOB, 10**200)
    assert len(str(caught.value)) < 200
    assert str(caught.value).endswith("...")


def test_an_error_raised_while_iterating_propagates() -> None:
    def generate() -> Iterator[str]:
        yield "a"
        raise ConnectionError("directory went away")

    with pytest.raises(ConnectionError, match="directory went away"):
        tenant_ids(JOB, generate())


# -- batches ------------------------------------------------------------------


def test_batches_cover_every_item_once_in_order() -> None:
    items = [str(n) for n in range(1_001)]
    chunks = list(batches(items, 500))
    assert [len(chunk) for chunk in chunks] == [500, 500, 1]
    assert [item for chunk in chunks for item in chunk] == items


def test_ten_thousand_tenants_take_twenty_batches() -> None:
    assert len(list(batches(["t"] * 10_000, CHILD_BATCH_SIZE))) == 20


def test_no_items_make_no_batch() -> None:
    assert list(batches([], 500)) == []


def test_a_batch_size_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="batch size must be positive, got 0"):
        list(batches(["a"], 0))


# -- child ids ----------------------------------------------------------------


def test_a_child_id_is_a_uuid_string() -> None:
    assert str(uuid.UUID(child_message_id("w", "t"))) == child_message_id("w", "t")


def test_child_ids_differ_per_wrapper_and_per_tenant() -> None:
    ids = {child_message_id(w, t) for w in ("w1", "w2") for t in ("t1", "t2")}
    assert len(ids) == 4


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(("w", '","t'), ('w","', "t"), id="json-quote-injection"),
        pytest.param(("w\\", "t"), ("w", "\\t"), id="backslash"),
        pytest.param(("", "wt"), ("wt", ""), id="empty-sides"),
    ],
)
def test_child_ids_survive_encoding_tricks(a: tuple[str, str], b: tuple[str, str]) -> None:
    assert child_message_id(*a) != child_message_id(*b)
