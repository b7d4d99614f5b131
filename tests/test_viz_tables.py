"""Tables: numbers right-aligned and padded apart in HTML and text, wide tables scroll."""

import xml.etree.ElementTree as ET

import pytest

from pagedlab.viz.tables import Table

T = Table(["trace", "requests", "share", "speed-up"],
          [["azure_conv_2023", "4.0", "39%", "1.2x"], ["sharegpt", "1,663", "-4%", "0.81x"]])


def test_numeric_columns_are_right_aligned_and_text_left():
    assert T.numeric() == [False, True, True, True]
    root = ET.fromstring(T._repr_html_())
    cells = [c for c in root.iter() if c.tag in ("th", "td")]
    for i, cell in enumerate(cells):
        style = cell.get("style")
        assert "padding" in style, "cells without padding run together"
        assert ("text-align:right" in style) == (i % 4 != 0)
    assert "overflow-x:auto" in root.get("style"), "a table wider than the page must scroll"
    assert [c.text for c in cells[4:8]] == ["azure_conv_2023", "4.0", "39%", "1.2x"]
    assert "white-space:nowrap" in cells[4].get("style"), "a short name must not break"


def test_text_keeps_columns_apart_and_aligned():
    assert repr(T).splitlines() == [
        "trace            requests  share  speed-up",
        "---------------  --------  -----  --------",
        "azure_conv_2023       4.0    39%      1.2x",
        "sharegpt            1,663    -4%     0.81x",
    ]


def test_transposed_swaps_rows_and_columns():
    t = T.transposed()
    assert t.header == ["trace", "azure_conv_2023", "sharegpt"]
    assert t.rows[0] == ["requests", "4.0", "1,663"] and len(t.rows) == 3


def test_a_short_row_is_reported():
    with pytest.raises(ValueError, match=r"rows \[1\] do not have the header's 2 cells"):
        Table(["a", "b"], [["1", "2"], ["3"]])
