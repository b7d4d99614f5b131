"""A cost model fitted to the engine's own step times on this machine (chapter 9).

:class:`~pagedlab.sim.cost_model.CostModel` prices a step from a GPU's datasheet and assumed
efficiencies. Simulators that must predict a real deployment, such as Vidur (Agrawal et al.,
MLSys 2024), measure instead. Here the engine times its own steps over a spread of batch
shapes (:func:`profile`), and a least-squares fit turns the table into seconds per decoded
sequence, per prefilled token and per cached token read, plus a constant per step
(:func:`fit_cost_model`). The result, a :class:`FittedCostModel`, plugs into the simulator
wherever a ``CostModel`` does.

What a cost model sees of a step is its :class:`StepShape`; :func:`step_shape` is the one
place that reads it off the scheduler's ``Step``, and :func:`features` the one place that
turns a shape into the numbers the fit weighs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pagedlab._checks import check_positive
from pagedlab.engine.step import kv_tokens_read
from pagedlab.sim.cost_model import prefill_pairs

FEATURES = ("decode_seqs", "prefill_tokens", "kv_tokens_read", "attention_pairs", "prefill_seqs")
DEFAULT_FEATURES = ("decode_seqs", "prefill_tokens", "kv_tokens_read")


class StepShape(NamedTuple):
    """The work in one step, as :meth:`CostModel.step_time` takes it."""

    prefill_lens: tuple[int, ...]  # tokens each prefill computes this step
    prefill_starts: tuple[int, ...]  # tokens each prefill finds already cached
    decode_lens: tuple[int, ...]  # each decoding sequence's context, its new token included


def step_shape(step) -> StepShape:
    """The shape of a :class:`~pagedlab.engine.scheduler.Step`, from its chunks alone (a
    speculative decode, several query tokens, is shaped like a prefill chunk)."""
    multi = step.multi_token
    return StepShape(tuple(c.num_tokens for c in multi), tuple(c.start for c in multi),
                     tuple(c.context_len for c in step.single_token))


def features(prefill_lens: Sequence[int], decode_lens: Sequence[int],
             prefill_starts: Sequence[int] = ()) -> dict[str, int]:
    """Each of :data:`FEATURES` for one step. A prefill chunk after ``s`` cached tokens reads
    those ``s`` (its attention pairs: :func:`~pagedlab.sim.cost_model.prefill_pairs`); a decode
    reads its whole context (:func:`~pagedlab.engine.step.kv_tokens_read`)."""
    starts = prefill_starts or (0,) * len(prefill_lens)
    return {
        "decode_seqs": len(decode_lens),
        "prefill_tokens": sum(prefill_lens),
        "kv_tokens_read": kv_tokens_read(starts, decode_lens),
        "attention_pairs": prefill_pairs(prefill_lens, starts),
        "prefill_seqs": len(prefill_lens),
    }


@dataclass(frozen=True)
class StepTiming:
    """One step the engine ran: when it began (seconds into the run), how long it took, and
    its shape."""

    start: float
    duration: float
    shape: StepShape

    @property
    def batch(self) -> int:
        """Sequences in the step."""
        return len(self.shape.prefill_lens) + len(self.shape.decode_lens)

    def feature(self, name: str) -> int:
        return features(self.shape.prefill_lens, self.shape.decode_lens,
                        self.shape.prefill_starts)[name]


def timed_step(llm, origin: float = 0.0, clock: Callable[[], float] = time.monotonic
               ) -> StepTiming:
    """Run one engine step and time it on ``clock``; ``origin`` is the run's time zero."""
    start = clock()
    llm.step()
    end = clock()
    return StepTiming(start - origin, end - start, step_shape(llm.last_step))


@dataclass(frozen=True)
class FittedCostModel:
    """Step time as a constant plus a coefficient per feature, fitted to measured steps.

    Same calls as :class:`~pagedlab.sim.cost_model.CostModel`. ``swap_bandwidth`` (bytes/s)
    prices a swap as a copy between the pools; the fit does not see swaps. There is no GPU
    datasheet behind it, so the simulator must be given the measured engine's
    ``num_gpu_blocks``. ``residuals`` are measured minus fitted seconds of the fitted steps.
    """

    constant: float
    coefficients: dict[str, float]  # feature name -> seconds per unit
    kv_bytes_per_token: int
    swap_bandwidth: float
    residuals: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    measured: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    max_context: int | None = None  # unknown: the simulator keeps the default token budget

    def step_time(self, prefill_lens: Sequence[int] = (), decode_lens: Sequence[int] = (),
                  block_size: int | None = None, prefill_starts: Sequence[int] = ()) -> float:
        """Seconds for one step (``block_size`` is ignored: the fit measured one)."""
        if not prefill_lens and not decode_lens:
            return 0.0
        f = features(prefill_lens, decode_lens, prefill_starts)
        return self.constant + sum(c * f[name] for name, c in self.coefficients.items())

    def swap_time(self, num_blocks: int, block_size: int) -> float:
        """Seconds to copy ``num_blocks`` blocks between the GPU and CPU pools."""
        check_positive("num_blocks", num_blocks, integer=True, allow_zero=True)
        check_positive("block_size", block_size, integer=True)
        return num_blocks * block_size * self.kv_bytes_per_token / self.swap_bandwidth

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        raise ValueError("a FittedCostModel knows no GPU memory: give the simulator the "
                         "measured engine's num_gpu_blocks")

    @property
    def rms_relative_error(self) -> float:
        """Root mean square of residual / measured over the fitted steps."""
        return float(np.sqrt(np.mean(np.square(self.residuals / self.measured))))


def relative_errors(cost, steps: Sequence[StepTiming]) -> np.ndarray:
    """[steps] ``cost``'s time for each measured step over its measured time, minus one."""
    return np.array([cost.step_time(s.shape.prefill_lens, s.shape.decode_lens, None,
                                     s.shape.prefill_starts) / s.duration - 1 for s in steps])


def fit_cost_model(steps: Sequence[StepTiming], names: Sequence[str] = DEFAULT_FEATURES, *,
                   kv_bytes_per_token: int, swap_bandwidth: float) -> FittedCostModel:
    """Least squares: ``duration ~ constant + sum(coefficient * feature)`` over ``steps``,
    every coefficient >= 0: more work never makes a step cheaper, and a noisy profile must not
    price a cached token read below zero. A feature no step has comes out 0; features the
    data cannot tell apart (every step decoding the same 2 sequences, say) share the time
    between them as least squares happens to split it, so profile a spread of shapes.

    Plain, unweighted squares: with a constant term the fitted times then add up to the
    measured total, and a request's latency is a sum of step times. (Weighing each step by
    1/duration fits the many short steps better, but its sum comes out short.)
    """
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}: choose from {FEATURES}")
    if len(steps) <= len(names):
        raise ValueError(f"{len(steps)} steps cannot fit {len(names) + 1} constants")
    y = np.array([s.duration for s in steps])  # [steps] seconds
    x = np.array([[1.0] + [s.feature(n) for n in names] for s in steps])  # [steps, 1 + features]
    coef = _nonnegative_lstsq(x, y)  # [1 + features]
    return FittedCostModel(float(coef[0]), {n: float(c) for n, c in zip(names, coef[1:])},
                           kv_bytes_per_token, swap_bandwidth, y - x @ coef, y)


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``argmin |x c - y|`` with ``c[1:] >= 0`` (column 0 is the constant, free). The optimum
    is the plain fit on the columns it leaves positive, so the best plain fit over column
    subsets whose coefficients come out >= 0 is exact; a cost model has a handful of columns."""
    best, best_error = None, np.inf
    for keep in itertools.product((True, False), repeat=x.shape[1] - 1):
        cols = [0] + [i + 1 for i, k in enumerate(keep) if k]
        sub = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
        error = np.sum((x[:, cols] @ sub - y) ** 2)
        if (sub[1:] >= 0).all() and error < best_error:
            best, best_error = np.zeros(x.shape[1]), error
            best[cols] = sub
    return best


def profile(llm, *, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
            prompt_lens: Sequence[int] = (16, 64, 128), output_len: int = 16, seed: int = 0,
            clock: Callable[[], float] = time.monotonic) -> list[StepTiming]:
    """Time the engine's steps over a spread of shapes. For each batch size and prompt length,
    half the batch arrives and prefills, the other half arrives and prefills beside the first
    half's decodes, then all decode to ``output_len`` tokens: decodes are most of a serving
    run's steps, so they should be most of the fit's too. One untimed request warms up first (a
    fresh process's first steps are slow)."""
    from pagedlab.engine.params import SamplingParams

    check_positive("output_len", output_len, integer=True)
    rng = np.random.default_rng(seed)
    vocab = llm.model.args.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.add_request("profile-warmup", rng.integers(0, vocab, 8).tolist(), params)
    while llm.has_unfinished_requests():
        llm.step()
    steps = []
    for batch in batch_sizes:
        for length in prompt_lens:
            half = (batch + 1) // 2
            for ids in (range(half), range(half, batch)):
                for i in ids:
                    llm.add_request(f"profile-{batch}-{length}-{i}",
                                    rng.integers(0, vocab, length).tolist(), params)
                steps.append(timed_step(llm, clock=clock))
            while llm.has_unfinished_requests():
                steps.append(timed_step(llm, clock=clock))
    return steps
