"""Request traces: synthetic ones with the paper's dataset statistics, and real ones from CSV.

A trace is a list of :class:`Request`: when each request arrives, how long its prompt is and
how many tokens it will generate. The PagedAttention paper drives its experiments with
ShareGPT and Alpaca lengths (Fig. 11) and Poisson arrivals; :func:`synthetic_requests` draws
such traces. :func:`load_trace` reads real ones, such as the Azure LLM inference traces
published with Splitwise (Patel et al., ISCA 2024).
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist

import numpy as np

from pagedlab._checks import check_positive, lookup_preset

TRACE_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")


@dataclass(frozen=True, slots=True)
class Request:
    """One request: arrival time in seconds, prompt and output lengths in tokens."""

    id: int
    arrival: float
    prompt_len: int
    output_len: int  # tokens it will generate before it stops

    def __post_init__(self):
        check_positive("id", self.id, integer=True, allow_zero=True)
        try:
            check_positive("arrival", self.arrival, allow_zero=True)
            if not math.isfinite(self.arrival):
                raise ValueError(f"arrival={self.arrival!r} must be finite")
            check_positive("prompt_len", self.prompt_len, integer=True)
            check_positive("output_len", self.output_len, integer=True)
        except ValueError as e:
            raise ValueError(f"request {self.id}: {e}") from None

    @property
    def total_len(self) -> int:
        """Tokens in its KV cache once it has finished: prompt plus output."""
        return self.prompt_len + self.output_len


def clip_lengths(prompt_len, output_len, max_context: int):
    """Fit a request into ``max_context`` tokens: the output is kept (up to max_context - 1)
    and the prompt loses its oldest tokens, as a server truncating a conversation would.

    Works on ints and on numpy arrays alike; returns ``(prompt_len, output_len)``.
    """
    output_len = np.minimum(output_len, max_context - 1)
    return np.minimum(prompt_len, max_context - output_len), output_len


def clip_to_context(requests: list[Request], max_context: int) -> list[Request]:
    """``requests`` with each one clipped by :func:`clip_lengths` to ``max_context`` tokens."""
    check_positive("max_context", max_context, integer=True)
    clipped = []
    for r in requests:
        prompt, output = clip_lengths(r.prompt_len, r.output_len, max_context)
        clipped.append(replace(r, prompt_len=int(prompt), output_len=int(output)))
    return clipped


@dataclass(frozen=True)
class LengthStats:
    """A dataset's prompt and output lengths, modelled as independent log-normals.

    The means are the paper's (Fig. 11). It shows the spread only as histograms, so
    ``sigma_*`` (the standard deviation of log length) is our reading of them, not a
    published number.
    """

    name: str
    mean_prompt: float
    mean_output: float
    sigma_prompt: float
    sigma_output: float


DATASETS: dict[str, LengthStats] = {
    "sharegpt": LengthStats("ShareGPT", 161.31, 337.99, sigma_prompt=1.0, sigma_output=1.0),
    "alpaca": LengthStats("Alpaca", 19.31, 58.45, sigma_prompt=0.8, sigma_output=0.8),
}

_NORMAL = NormalDist()
_QUANTILES = [_NORMAL.inv_cdf((i + 0.5) / 64) for i in range(64)]  # to average over a length


def _clipped_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X log-normal with log-mean ``mu`` and log-std ``sigma``."""
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma**2 / 2) * _NORMAL.cdf(z - sigma) + cap * (1 - _NORMAL.cdf(z))


def _solve_mu(target: float, sigma: float, caps: list[float]) -> float:
    """The log-mean whose clipped mean, averaged over ``caps``, equals ``target`` (bisection)."""
    lo, hi = math.log(target) - 5 * sigma**2, math.log(target) + 5
    for _ in range(60):
        mid = (lo + hi) / 2
        mean = sum(_clipped_mean(mid, sigma, c) for c in caps) / len(caps)
        lo, hi = (mid, hi) if mean < target else (lo, mid)
    return (lo + hi) / 2


def log_means(dataset, max_context: int) -> tuple[float, float]:
    """Log-means of prompt and output lengths such that, after :func:`clip_lengths` to
    ``max_context``, the mean lengths are the dataset's."""
    d = lookup_preset("dataset", dataset, DATASETS, LengthStats, "datasets")
    mu_out = _solve_mu(d.mean_output, d.sigma_output, [max_context - 1])
    # The prompt's cap depends on the output: average over the output's quantiles.
    outputs = [min(math.exp(mu_out + d.sigma_output * z), max_context - 1) for z in _QUANTILES]
    mu_prompt = _solve_mu(d.mean_prompt, d.sigma_prompt, [max_context - o for o in outputs])
    return mu_prompt, mu_out


def sample_lengths(dataset, n: int, rng: np.random.Generator, max_context: int = 2048):
    """``n`` (prompt, output) lengths like ``dataset``'s, within ``max_context``: two int arrays."""
    check_positive("n", n, integer=True)
    check_positive("max_context", max_context, integer=True)
    if max_context < 2:
        raise ValueError(f"max_context={max_context} must be >= 2 (a prompt and an output token)")
    d = lookup_preset("dataset", dataset, DATASETS, LengthStats, "datasets")
    mu_prompt, mu_out = log_means(d, max_context)
    prompt = np.maximum(np.rint(rng.lognormal(mu_prompt, d.sigma_prompt, n)), 1).astype(np.int64)
    output = np.maximum(np.rint(rng.lognormal(mu_out, d.sigma_output, n)), 1).astype(np.int64)
    return clip_lengths(prompt, output, max_context)


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s) of ``n`` requests from a Poisson process of ``rate`` requests/s,
    starting at 0; ``rate=math.inf`` makes them all arrive at once."""
    check_positive("n", n, integer=True)
    check_positive("rate", rate)
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.exponential(1 / rate, n)  # [n] seconds between consecutive arrivals
    gaps[0] = 0.0
    return np.cumsum(gaps)


def synthetic_requests(
    dataset, n: int, *, rate: float = math.inf, seed: int = 0, max_context: int = 2048
) -> list[Request]:
    """``n`` requests with ``dataset``'s lengths (``"sharegpt"``, ``"alpaca"`` or a
    :class:`LengthStats`) arriving as a Poisson process of ``rate`` requests/s; seeded."""
    rng = np.random.default_rng(seed)
    prompt, output = sample_lengths(dataset, n, rng, max_context)
    arrival = poisson_arrivals(n, rate, rng)
    return [Request(i, float(a), int(p), int(o))
            for i, (a, p, o) in enumerate(zip(arrival, prompt, output))]


def _parse_length(text: str, where: str, column: str) -> int:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value.is_integer() or value < 0:
        raise ValueError(f"{where}: {column}={text!r} must be a non-negative integer")
    return int(value)


def _check_cells(row: dict, header: list[str], where: str) -> None:
    """One cell per column: csv.DictReader fills a short row's last columns with None and
    files a long row's extra cells under the key None."""
    missing = [c for c in header if row[c] is None]
    extra = row.get(None) or []
    if missing or extra:
        cells = len(header) - len(missing) + len(extra)
        detail = f", missing {', '.join(missing)}" if missing else ""
        raise ValueError(f"{where}: {cells} cells where the header has {len(header)}{detail}")


def load_trace(path, limit: int | None = None, *, rate: float | None = None,
               seed: int = 0) -> list[Request]:
    """Requests of a CSV trace with columns ``arrived_at`` (s), ``num_prefill_tokens`` and
    ``num_decode_tokens``, in file order; at most ``limit`` of them. Errors name the file and
    row, numbered as the file's lines (row 1 is the header).

    With ``rate`` (requests/s) the arrivals are drawn instead, a Poisson process seeded by
    ``seed``, and ``arrived_at`` is not read: the way to load a lengths-only trace (such as
    Vidur's processed ones) or to replay a trace's lengths at another load.
    """
    if limit is not None:
        check_positive("limit", limit, integer=True)
    if rate is not None:
        check_positive("rate", rate)
    columns = TRACE_COLUMNS if rate is None else TRACE_COLUMNS[1:]
    requests: list[Request] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or ())]
        if missing:
            lengths_only = missing == ["arrived_at"]
            hint = " (a lengths-only trace needs rate= for its arrivals)" if lengths_only else ""
            raise ValueError(f"{path}, row 1: missing column(s) {', '.join(missing)} "
                             f"(found {reader.fieldnames}){hint}")
        for row in reader:
            if limit is not None and len(requests) == limit:
                break
            where = f"{path}, row {reader.line_num}"  # blank lines count, as in an editor
            _check_cells(row, reader.fieldnames, where)
            arrival = 0.0 if rate is not None else _parse_arrival(row, requests, where)
            prompt = _parse_length(row["num_prefill_tokens"], where, "num_prefill_tokens")
            output = _parse_length(row["num_decode_tokens"], where, "num_decode_tokens")
            try:
                requests.append(Request(len(requests), arrival, prompt, output))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
    if rate is not None and requests:
        arrivals = poisson_arrivals(len(requests), rate, np.random.default_rng(seed))
        requests = [replace(r, arrival=float(a)) for r, a in zip(requests, arrivals)]
    return requests


def _parse_arrival(row: dict, previous: list[Request], where: str) -> float:
    text = row["arrived_at"]
    try:
        arrival = float(text)
    except ValueError:
        raise ValueError(f"{where}: arrived_at={text!r} is not a number") from None
    if previous and arrival < previous[-1].arrival:
        raise ValueError(f"{where}: arrived_at={arrival} is earlier than the previous "
                         f"row's {previous[-1].arrival}")
    return arrival


def shared_trace_path(name: str) -> Path | None:
    """``<name>.csv`` in the folder of shared traces, or None when it is absent.

    The folder is ``$PAGEDLAB_TRACES`` if set, else ``shared/traces`` beside the repository
    that the command runs in: ``../shared/traces`` from its root (the tests), or
    ``../../shared/traces`` from ``book/`` (the chapters). The traces are not part of the
    project: :func:`trace_path` downloads them where they are absent, and tests skip.
    """
    folder = os.environ.get("PAGEDLAB_TRACES")
    folders = [Path(folder)] if folder else [Path.cwd().parent / "shared" / "traces",
                                              Path.cwd().parent.parent / "shared" / "traces"]
    return next((f / f"{name}.csv" for f in folders if (f / f"{name}.csv").is_file()), None)


# The Azure traces as processed for Vidur, at a fixed commit of microsoft/vidur: byte for byte
# the files of ../shared/traces, so a run away from the repository (Colab) reads the same
# requests. name: (file in that repository, SHA-256)
PUBLISHED_TRACES = {
    "azure_conv_2023": ("splitwise_conv.csv",
                        "439e4138b7e384f316de614c071f7162be05b8af0cef866f82faacd1b0472249"),
    "azure_code_2023": ("splitwise_code.csv",
                        "f266b907d109d471c61283ab69771c17ad79a18b33ff6e96aa546346f52767a6"),
}
PUBLISHED_URL = ("https://raw.githubusercontent.com/microsoft/vidur/"
                 "7d47513363ec447a741ac5e47241580b47724fbf/data/processed_traces")


class TraceNotFound(FileNotFoundError):
    """A trace that is neither in the shared folder nor downloadable; says how to get it."""


def trace_path(name: str) -> Path:
    """``<name>.csv`` from the shared traces if they are there, else a copy of the published
    file, downloaded once into ``$PAGEDLAB_CACHE/traces`` (``~/.cache/pagedlab``) and checked
    against its SHA-256. :class:`TraceNotFound`, saying how to get it, when neither can be had
    (offline): a chapter whose prose describes a real trace never runs on anything else."""
    import hashlib

    from pagedlab.checkpoints import cache_dir, download_to_cache

    if (path := shared_trace_path(name)) is not None:
        return path
    if name not in PUBLISHED_TRACES:
        raise TraceNotFound(f"no trace {name!r}: put {name}.csv in ../shared/traces or in the "
                            "folder $PAGEDLAB_TRACES names")
    file, digest = PUBLISHED_TRACES[name]
    path = cache_dir() / "traces" / f"{name}.csv"
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == digest:
        return path
    url = f"{PUBLISHED_URL}/{file}"
    try:
        return download_to_cache(url, path, sha256=digest)
    except OSError as err:
        raise TraceNotFound(
            f"{name}: not in ../shared/traces (or $PAGEDLAB_TRACES) and not downloadable from "
            f"{url} ({err}). Download that file into ../shared/traces as {name}.csv, or build "
            "where the network reaches GitHub; the chapter describes this trace, so it does "
            "not run on stand-in data") from err
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from err
