"""The calculator's text summary: the numbers chapter 1 quotes, and the no-fit case."""

import contextlib
import io

import ipywidgets

from pagedlab.footprint import MODELS
from pagedlab.viz.kv_calculator import DEFAULTS, kv_calculator, kv_presets, kv_summary


def test_default_summary_quotes_table1():
    text = kv_summary(**DEFAULTS)  # OPT-13B, fp16, one A100-40GB, 2,048 tokens
    assert "819,200 bytes (800.0 KiB)" in text
    assert "15,805 token slots" in text
    assert "Max sequences:   7 of 2,048 tokens" in text


def test_summary_says_when_weights_do_not_fit():
    text = kv_summary(**{**DEFAULTS, "model": "Llama-3-70B"})
    assert "do not fit on 1 x A100-40GB" in text and "token slots" not in text


def test_widget_builds_with_every_control():
    box = kv_calculator(model="DeepSeek-V3", num_gpus=8, gpu="H200", weight_dtype="fp8")
    values = {w.description: w.value for row in box.children[:2] for w in row.children}
    assert values == {"model": "DeepSeek-V3", "KV dtype": "fp16", "GPU": "H200", "GPUs": 8,
                      "weights": "fp8", "context": 2048}


def test_presets_table_lists_every_model_on_the_fewest_gpus_that_hold_it():
    """What the published page shows in place of live controls: Table 1's OPT-13B row (800 KiB
    a token, 7 sequences of 2,048 on one A100-40GB), and OPT-175B's 325 GiB of fp16 weights
    beyond eight 40 GB cards."""
    table = kv_presets()
    rows = {row[0]: row for row in table.rows}
    assert set(rows) == set(MODELS)
    assert rows["OPT-13B"][2:4] == ["800.0", "1.562"] and rows["OPT-13B"][5:] == ["1", "7"]
    assert rows["OPT-175B"][5:] == ["> 8", ""]
    assert rows["Llama-3-70B"][5] == "4", "70e9 fp16 weights need more than three 40 GB cards"
    assert all(table.numeric()[2:])


class CapturingOutput:
    """What a kernel does for an Output widget, without one: text printed inside ``with out:``
    becomes the widget's output (replacing the last, as ``clear_output(wait=True)`` does)."""

    def __enter__(self):
        self._redirect = contextlib.redirect_stdout(io.StringIO())
        self._buffer = self._redirect.__enter__()

    def __exit__(self, *exc):
        self._redirect.__exit__(*exc)
        self.outputs = ({"output_type": "stream", "name": "stdout",
                         "text": self._buffer.getvalue()},)


def shown(output) -> str:
    """The widget's text, after the erase-line code that clear_output prints without a kernel."""
    return output.outputs[0]["text"].rsplit("\r", 1)[-1].strip()


def test_the_widgets_output_follows_its_controls(monkeypatch):
    monkeypatch.setattr(ipywidgets.Output, "__enter__", CapturingOutput.__enter__)
    monkeypatch.setattr(ipywidgets.Output, "__exit__", CapturingOutput.__exit__)
    box = kv_calculator()
    output = box.children[-1]
    assert isinstance(output, ipywidgets.Output)
    assert shown(output) == kv_summary(**DEFAULTS)
    controls = {w.description: w for row in box.children[:2] for w in row.children}
    controls["model"].value = "Llama-3-8B"
    controls["context"].value = 4096
    expected = kv_summary(**{**DEFAULTS, "model": "Llama-3-8B", "context_len": 4096})
    assert shown(output) == expected
