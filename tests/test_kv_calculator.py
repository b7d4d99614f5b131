"""The calculator's text summary: the numbers chapter 1 quotes, and the no-fit case; its page."""

import pytest

from pagedlab.footprint import MODELS
from pagedlab.viz.kv_calculator import DEFAULTS, kv_calculator, kv_presets, kv_summary
from pagedlab.viz.tables import NOT_APPLICABLE


def test_default_summary_quotes_table1():
    text = kv_summary(**DEFAULTS)  # OPT-13B, fp16, one A100-40GB, 2,048 tokens
    assert "819,200 bytes (800.0 KiB)" in text
    assert "15,805 token slots" in text
    assert "Max sequences:   7 of 2,048 tokens" in text


def test_summary_says_when_weights_do_not_fit():
    text = kv_summary(**{**DEFAULTS, "model": "Llama-3-70B"})
    assert "do not fit on 1 x A100-40GB" in text and "token slots" not in text


def test_calculator_starts_every_control_at_its_setting_and_shows_the_summary():
    """The page's controls start where the summary printed under them does; the page's own
    recomputation is checked in the browser (tests/test_browser.py)."""
    import re
    from html import unescape

    calc = kv_calculator(model="DeepSeek-V3", num_gpus=8, gpu="H200", weight_dtype="fp8")
    html = calc._repr_html_()
    selected = dict(re.findall(r'<select data-key="(\w+)">.*?<option selected>([^<]*)<', html))
    context = re.search(r'data-key="context_len"[^>]*value="(\d+)"', html)[1]
    assert {**selected, "context_len": context} == {
        "model": "DeepSeek-V3", "dtype": "fp16", "gpu": "H200", "num_gpus": "8",
        "weight_dtype": "fp8", "context_len": "2048"}
    summary = kv_summary(**{**DEFAULTS, "model": "DeepSeek-V3", "num_gpus": 8, "gpu": "H200",
                            "weight_dtype": "fp8"})
    assert repr(calc) == summary
    assert unescape(re.search(r"<pre>(.*?)</pre>", html, re.S)[1]) == summary


def test_calculator_names_a_bad_setting():
    with pytest.raises(ValueError, match=r"gpu='B200' is not one of"):
        kv_calculator(gpu="B200")
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['batch'\]"):
        kv_calculator(batch=4)


def test_presets_table_lists_every_model_on_the_fewest_gpus_that_hold_it():
    """What the published page shows in place of live controls: Table 1's OPT-13B row (800 KiB
    a token, 7 sequences of 2,048 on one A100-40GB), and OPT-175B's 325 GiB of fp16 weights
    beyond eight 40 GB cards."""
    table = kv_presets()
    rows = {row[0]: row for row in table.rows}
    assert set(rows) == set(MODELS)
    assert rows["OPT-13B"][2:4] == ["800.0", "1.562"] and rows["OPT-13B"][5:] == ["1", "7"]
    assert rows["OPT-175B"][5:] == ["> 8", NOT_APPLICABLE]
    assert rows["Llama-3-70B"][5] == "4", "70e9 fp16 weights need more than three 40 GB cards"
    assert all(table.numeric()[2:])
