"""Request traces: synthetic lengths and arrivals against their targets, the CSV loader's checks."""

import math

import numpy as np
import pytest

from pagedlab.sim.traces import (
    DATASETS,
    Request,
    TraceNotFound,
    clip_to_context,
    load_trace,
    poisson_arrivals,
    sample_lengths,
    shared_trace_path,
    synthetic_requests,
    trace_path,
)
from pagedlab.sim import traces


@pytest.mark.parametrize("dataset", ["sharegpt", "alpaca"])
def test_synthetic_lengths_have_the_papers_means(dataset, seed_offset):
    prompt, output = sample_lengths(dataset, 200_000, np.random.default_rng(seed_offset))
    d = DATASETS[dataset]
    assert prompt.mean() == pytest.approx(d.mean_prompt, rel=0.02)
    assert output.mean() == pytest.approx(d.mean_output, rel=0.02)


@pytest.mark.parametrize("max_context", [2, 64, 2048])
def test_synthetic_lengths_fit_the_context(max_context, seed_offset):
    rng = np.random.default_rng(1 + seed_offset)
    prompt, output = sample_lengths("sharegpt", 20_000, rng, max_context)
    assert prompt.min() >= 1 and output.min() >= 1
    assert (prompt + output).max() <= max_context


def test_synthetic_requests_are_seeded():
    a = synthetic_requests("alpaca", 50, rate=2.0, seed=3)
    assert a == synthetic_requests("alpaca", 50, rate=2.0, seed=3)
    assert a != synthetic_requests("alpaca", 50, rate=2.0, seed=4)
    assert [r.id for r in a] == list(range(50))


def test_poisson_arrivals_have_the_rate(seed_offset):
    t = poisson_arrivals(100_000, 4.0, np.random.default_rng(seed_offset))
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert np.diff(t).mean() == pytest.approx(1 / 4.0, rel=0.02)
    assert not poisson_arrivals(5, math.inf, np.random.default_rng(0)).any()
    with pytest.raises(ValueError, match="rate=0"):
        poisson_arrivals(5, 0, np.random.default_rng(0))


def test_request_errors_name_the_request_and_field():
    with pytest.raises(ValueError, match="request 4: output_len=0 must be > 0"):
        Request(4, 0.0, 10, 0)
    with pytest.raises(ValueError, match="request 5: prompt_len=2.5 must be an integer"):
        Request(5, 0.0, 2.5, 3)
    with pytest.raises(ValueError, match="request 6: arrival=inf must be finite"):
        Request(6, math.inf, 1, 1)
    with pytest.raises(ValueError, match="dataset='sharegtp' is not a preset"):
        synthetic_requests("sharegtp", 3)


def test_clip_keeps_the_output_and_truncates_the_prompt():
    reqs = [Request(0, 0.0, 100, 10), Request(1, 0.0, 5000, 30), Request(2, 0.0, 10, 3000)]
    clipped = clip_to_context(reqs, 2048)
    assert [(r.prompt_len, r.output_len) for r in clipped] == [(100, 10), (2018, 30), (1, 2047)]


# --- CSV traces ---------------------------------------------------------------------------------

GOOD = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,374,44\n4.3,396,109\n4.3,91.0,16\n"


def write(tmp_path, text, name="trace.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_trace_reads_requests_in_order(tmp_path):
    path = write(tmp_path, GOOD)
    assert load_trace(path) == [Request(0, 0.0, 374, 44), Request(1, 4.3, 396, 109),
                                Request(2, 4.3, 91, 16)]
    assert len(load_trace(path, limit=2)) == 2


@pytest.mark.parametrize("text, message", [
    ("arrived_at,num_prefill_tokens\n0,1\n", r"trace\.csv, row 1: missing column\(s\) num_decode"),
    (GOOD + "5.0,-3,10\n", r"trace\.csv, row 5: num_prefill_tokens='-3' must be a non-negative"),
    (GOOD + "5.0,3,2.5\n", r"row 5: num_decode_tokens='2.5' must be a non-negative integer"),
    (GOOD + "5.0,3,x\n", r"row 5: num_decode_tokens='x'"),
    (GOOD + "1.0,3,2\n", r"row 5: arrived_at=1.0 is earlier than the previous row's 4.3"),
    (GOOD + "soon,3,2\n", r"row 5: arrived_at='soon' is not a number"),
    (GOOD + "5.0,3,0\n", r"row 5: request 3: output_len=0 must be > 0"),
    (GOOD + "5.0,3\n", r"trace\.csv, row 5: 2 cells where the header has 3, missing num_decode"),
    (GOOD + "5.0\n", r"row 5: 1 cells where .* missing num_prefill_tokens, num_decode_tokens"),
    (GOOD + "5.0,3,2,9\n", r"trace\.csv, row 5: 4 cells where the header has 3$"),
    (GOOD + "\n5.0,3,x\n", r"trace\.csv, row 6: num_decode_tokens='x'"),  # a blank line counts
    (GOOD + "5.0,,2\n", r"row 5: num_prefill_tokens='' must be a non-negative integer"),
    (GOOD + "nan,3,2\n", r"row 5: request 3: arrival=nan must be >= 0"),
])
def test_load_trace_errors_name_the_file_and_row(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        load_trace(write(tmp_path, text))


def test_lengths_only_trace_draws_seeded_poisson_arrivals(tmp_path, seed_offset):
    rng = np.random.default_rng(7 + seed_offset)
    lengths = rng.integers(1, 500, size=(4000, 2))
    text = "num_prefill_tokens,num_decode_tokens,extra\n" + "".join(
        f"{p},{o},x\n" for p, o in lengths)
    path = write(tmp_path, text)
    seed = 3 + seed_offset
    reqs = load_trace(path, rate=4.0, seed=seed)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [tuple(x) for x in lengths.tolist()]
    gaps = np.diff([r.arrival for r in reqs])
    assert reqs[0].arrival == 0.0 and (gaps >= 0).all()
    assert np.mean(gaps) == pytest.approx(1 / 4.0, rel=0.05)  # 4,000 gaps: 1.6% standard error
    assert np.std(gaps) == pytest.approx(1 / 4.0, rel=0.1)  # exponential: std = mean
    assert load_trace(path, rate=4.0, seed=seed) == reqs
    assert load_trace(path, rate=4.0, seed=seed + 1) != reqs
    assert len(load_trace(path, limit=5, rate=1.0)) == 5
    # a trace with arrivals takes drawn ones too: its lengths at another load
    assert [r.arrival for r in load_trace(write(tmp_path, GOOD), rate=1.0)] != [0.0, 4.3, 4.3]


def test_lengths_only_trace_without_a_rate_says_what_is_missing(tmp_path):
    path = write(tmp_path, "num_prefill_tokens,num_decode_tokens\n3,4\n")
    with pytest.raises(ValueError, match=r"trace\.csv, row 1: missing column\(s\) arrived_at "
                                         r".*needs rate="):
        load_trace(path)
    with pytest.raises(ValueError, match=r"rate=0 must be > 0"):
        load_trace(path, rate=0)
    with pytest.raises(ValueError, match=r"row 3: num_decode_tokens='x'"):
        load_trace(write(tmp_path, "num_prefill_tokens,num_decode_tokens\n3,4\n5,x\n"), rate=1)


def test_shared_trace_path_follows_the_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLAB_TRACES", str(tmp_path))
    assert shared_trace_path("mine") is None
    write(tmp_path, GOOD, "mine.csv")
    assert shared_trace_path("mine") == tmp_path / "mine.csv"


@pytest.mark.parametrize("name, count, mean_prompt, mean_output", [
    ("azure_conv_2023", 19_366, 1154.7, 211.1),  # ../shared/traces/README.md
    ("azure_code_2023", 8_819, 2047.8, 27.9),
])
def test_real_azure_traces_load_with_their_published_statistics(
    monkeypatch, name, count, mean_prompt, mean_output
):
    monkeypatch.delenv("PAGEDLAB_TRACES", raising=False)
    path = shared_trace_path(name)
    if path is None:
        pytest.skip(f"{name}.csv is not in ../shared/traces")
    reqs = load_trace(path)
    assert len(reqs) == count
    assert np.mean([r.prompt_len for r in reqs]) == pytest.approx(mean_prompt, abs=0.05)
    assert np.mean([r.output_len for r in reqs]) == pytest.approx(mean_output, abs=0.05)
    assert reqs[-1].arrival <= 3600  # one hour


@pytest.mark.parametrize("name", sorted(traces.PUBLISHED_TRACES))
def test_published_digests_are_those_of_the_shared_traces(monkeypatch, name):
    """What trace_path downloads is byte for byte what the book build reads."""
    import hashlib

    monkeypatch.delenv("PAGEDLAB_TRACES", raising=False)
    path = shared_trace_path(name)
    if path is None:
        pytest.skip(f"{name}.csv is not in ../shared/traces")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == traces.PUBLISHED_TRACES[name][1]


@pytest.fixture
def published(tmp_path, monkeypatch):
    """A published trace "mine" served from a file:// URL, no shared traces, an empty cache."""
    import hashlib

    site = tmp_path / "site"
    site.mkdir()
    (site / "mine_v1.csv").write_text(GOOD)
    monkeypatch.setattr(traces, "PUBLISHED_URL", site.as_uri())
    monkeypatch.setattr(traces, "PUBLISHED_TRACES", {
        "mine": ("mine_v1.csv", hashlib.sha256(GOOD.encode()).hexdigest())})
    monkeypatch.setenv("PAGEDLAB_TRACES", str(tmp_path / "no-shared-traces"))
    monkeypatch.setenv("PAGEDLAB_CACHE", str(tmp_path / "cache"))
    return site


def test_trace_path_downloads_a_published_trace_once_and_checks_it(published, tmp_path):
    path = trace_path("mine")
    assert path == tmp_path / "cache" / "traces" / "mine.csv"
    assert path.read_text() == GOOD and load_trace(path) == load_trace(published / "mine_v1.csv")
    (published / "mine_v1.csv").unlink()  # offline now: the cached copy serves
    assert trace_path("mine") == path
    path.write_text(GOOD + "9.0,1,1\n")  # a damaged cached copy is never read
    with pytest.raises(TraceNotFound):
        trace_path("mine")


def test_trace_path_rejects_a_download_that_is_not_the_published_file(published):
    (published / "mine_v1.csv").write_text(GOOD.replace("\n", "\r\n"))
    with pytest.raises(ValueError, match=r"mine: the file downloaded from .*mine_v1.csv is not"):
        trace_path("mine")


def test_trace_path_offline_says_how_to_get_the_trace(published, monkeypatch):
    """No stand-in data: a chapter that describes a trace stops, saying where to put it."""
    (published / "mine_v1.csv").unlink()
    with pytest.raises(TraceNotFound, match=r"mine: not in ../shared/traces .* not downloadable "
                                            r"from .*mine_v1.csv.* into ../shared/traces as "
                                            r"mine.csv"):
        trace_path("mine")
    (published / "mine_v1.csv").write_text(GOOD)
    monkeypatch.setenv("PAGEDLAB_OFFLINE", "1")  # a build kept off the network fails at once
    with pytest.raises(TraceNotFound, match="PAGEDLAB_OFFLINE is set"):
        trace_path("mine")
    with pytest.raises(TraceNotFound, match="no trace 'theirs'"):
        trace_path("theirs")


def test_no_chapter_runs_on_stand_in_traces():
    """Every chapter that reads a trace reads it through trace_path, with no fallback branch
    (the reader review's high defect: '(trace not found)x' in chapter 10's prose)."""
    from pathlib import Path

    for chapter in sorted((Path(__file__).parents[1] / "book").glob("ch*.md")):
        text = chapter.read_text()
        assert "trace not found" not in text, chapter.name
        for line in text.splitlines():
            assert not ("trace_path(" in line and "is None" in line), (chapter.name, line)
