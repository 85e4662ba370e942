import pytest

from spillway_runtime.core.units import format_bytes, parse_count, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("24GiB", 24 * 2**30), ("2TB", 2 * 10**12), ("512Mi", 512 * 2**20), ("0", 0), ("1.5G", 1_500_000_000),
     (4096, 4096)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["24 parsecs", "", "-1", "GiB", "1e3XB"])
def test_parse_size_rejects_with_the_accepted_spellings(text):
    with pytest.raises(ValueError, match="24GiB"):
        parse_size(text)


@pytest.mark.parametrize(("text", "expected"), [("13B", 13 * 10**9), ("13e9", 13 * 10**9), ("350M", 350 * 10**6),
                                                ("7000000000", 7 * 10**9)])
def test_parse_count(text, expected):
    assert parse_count(text) == expected


def test_parse_count_rejects_zero_and_words():
    with pytest.raises(ValueError, match="13B"):
        parse_count("thirteen")
    with pytest.raises(ValueError):
        parse_count("0")


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1536 * 2**20) == "1.5 GiB"


@pytest.mark.parametrize("value", [{}, [], None, True])
def test_non_text_values_are_value_errors(value):
    with pytest.raises(ValueError):
        parse_size(value)
    with pytest.raises(ValueError):
        parse_count(value)
