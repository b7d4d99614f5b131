"""Tables: numbers right-aligned and padded apart in HTML and text; text and headers wrap at
spaces (never at a hyphen) so a table fits a narrow page; a table still too wide scrolls."""

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
    assert ["".join(c.itertext()) for c in cells[4:8]] == ["azure_conv_2023", "4.0", "39%", "1.2x"]
    assert all("white-space:nowrap" in c.get("style") for c in cells[5:8]), "a number must not break"


def test_text_and_headers_break_at_spaces_only():
    t = Table(["model", "KV per 2,048-token request (GiB)", "values/token/layer"],
              [["OPT-13B on an A100-40GB", "1.6", "10,240"]])
    root = ET.fromstring(t._repr_html_())
    th_model, th_kv, th_values, td_model = [c for c in root.iter() if c.tag in ("th", "td")][:4]
    for cell in (th_kv, td_model):  # the whole cell may wrap ...
        assert "nowrap" not in cell.get("style")
        assert "".join(cell.itertext()) == {th_kv: t.header[1], td_model: t.rows[0][0]}[cell]
        # ... but each hyphenated word is one unbreakable piece
        unbroken = [s.text for s in cell.iter("span") if "white-space:nowrap" in s.get("style")]
        words = [w for w in "".join(cell.itertext()).split(" ") if "-" in w]
        assert unbroken == words
    # a header's long word may break after a slash (the <wbr/> after each)
    assert [e.tail for e in th_values.iter("wbr")] == ["token/", "layer"]


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
