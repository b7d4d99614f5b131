"""Memory saved by sharing blocks within a request: parallel sampling and beam search.

The paper's Fig. 15 reports the KV blocks that sharing saves (Kwon et al. 2023, section 6.3).
Each workload here plays one request on the real :class:`~pagedlab.memory.KVCacheManager`,
with ``share=True`` through fork and copy-on-write, with ``share=False`` through private
copies: the memory a cache without sharing needs. Random tokens, and for beam search a toy
model's scores (:func:`next_token_logprobs`), stand in for a model. :func:`measure_saving`
runs a trace both ways (chapter 5 explains the mechanism, chapter 10 sets the result beside
the paper's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedlab.memory import KVCacheManager
from pagedlab.sim.traces import Request

Workload = Callable[..., tuple[int, int]]  # (mgr, seq, prompt, k, steps, rng, share) -> counts


def play_parallel_sampling(mgr, seq, prompt, n, steps, rng, share=True):
    """``n`` samples of ``prompt`` for ``steps`` tokens each; (used, copied) as play_beam_search."""
    samples = [f"{seq}/{k}" for k in range(n)]
    mgr.allocate(samples[0], prompt)
    for sample in samples[1:]:
        mgr.fork(samples[0], sample) if share else mgr.allocate(sample, prompt)
    used, copied = 0, 0 if share else (n - 1) * len(mgr.block_table(samples[0]))
    for _ in range(steps):
        for sample in samples:
            mgr.append(sample, [int(rng.integers(32000))])
        copied += len(mgr.take_copies())
        used += mgr.num_used_blocks
    for sample in samples:
        mgr.free(sample)
    return used, copied


def _log_softmax(logits):
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


ALTERNATIVES = 0.3  # fitted at beam width 6 to the paper's 55.2% (Fig. 15); see play_beam_search
PLAUSIBLE_GAP = 10.0  # nats that lift a plausible token above the rest of the vocabulary


def next_token_logprobs(rng, vocab=50, alternatives=ALTERNATIVES):
    """A toy model's next-token log-probabilities: a few plausible tokens, the rest far behind.

    A language model is confident at most steps and hesitates between a handful of tokens at
    a few (Holtzman et al. 2020). So of ``vocab`` unit Gaussian logits, the first
    ``1 + Poisson(alternatives)`` (token ids mean nothing here) are lifted by
    :data:`PLAUSIBLE_GAP`, which leaves the rest about ``e**-10`` each; any gap above about
    8 nats gives the same savings. The unit spread among plausible tokens is a choice, not a
    fit: a spread of 2 lowers Fig. 15's beam savings by one to two points (widths 2 to 6)."""
    logits = rng.normal(0.0, 1.0, vocab)
    logits[:1 + rng.poisson(alternatives)] += PLAUSIBLE_GAP
    return _log_softmax(logits)


def play_beam_search(mgr, seq, prompt, width, steps, rng, share=True, vocab=50,
                alternatives=ALTERNATIVES):
    """Beam search from ``prompt`` on ``mgr`` for ``steps`` tokens, scored by a toy model.

    Each step keeps the ``width`` (beam, token) candidates with the highest total
    log-probability, as vLLM's first beam search did, and every beam runs all ``steps`` (the
    trace's output length), as vLLM's benchmarks do by ignoring end-of-sequence tokens. Each
    beam's scores come from :func:`next_token_logprobs`.

    ``alternatives`` is the mean number of plausible next tokens besides the best one. The
    fewer there are, the more often every beam just takes its one likely token and the beams'
    ranks stay as they are, so they keep apart longer and share less; the more there are, the
    more often a leading beam's alternatives displace the beams behind it, so their ancestry
    coalesces sooner and they share more. The default is fitted to the paper's saving at width
    6 on Alpaca (55.2%, the top of its Fig. 15 range); widths 2 and 4 are the check.

    Returns (used, copied): GPU blocks in use summed over steps, and blocks copied (by
    copy-on-write, or as full copies when ``share`` is False)."""
    mgr.allocate(f"{seq}/0", prompt)  # beam k of request seq is "seq/k"
    beams, next_id, used, copied = {f"{seq}/0": 0.0}, 1, 0, 0
    for _ in range(steps):
        candidates = []  # (total log-prob, parent beam, token)
        for beam, score in beams.items():
            logp = next_token_logprobs(rng, vocab, alternatives)
            candidates += [(score + logp[t], beam, int(t)) for t in np.argsort(logp)[-width:]]
        survivors = sorted(candidates, reverse=True)[:width]
        parents = {beam for _, beam, _ in survivors}
        for beam in [b for b in beams if b not in parents]:
            mgr.free(beam)  # first: the step's peak never counts a block about to be released
        plan, continued = [], set()
        for score, parent, token in survivors:
            child = parent
            if parent in continued:  # a second survivor of this beam: a new branch
                child, next_id = f"{seq}/{next_id}", next_id + 1
                if share:
                    mgr.fork(parent, child)
                else:
                    mgr.allocate(child, mgr.token_ids(parent))
                    copied += len(mgr.block_table(child))
            continued.add(parent)
            plan.append((child, token, score))
        for child, token, _ in plan:
            mgr.append(child, [token])
        beams = {child: score for child, _, score in plan}
        copied += len(mgr.take_copies())
        used += mgr.num_used_blocks
    for beam in beams:
        mgr.free(beam)
    return used, copied


def block_steps(workload: Workload, requests: list[Request], k: int, share: bool,
                block_size: int = 16, seed: int = 1) -> tuple[int, int]:
    """Blocks in use summed over every decode step of every request, and blocks copied.

    Each request runs alone, from its prompt (random tokens) for its output length, so it
    weighs in proportion to its length, as in a serving run's time average."""
    rng = np.random.default_rng(seed)
    mgr = KVCacheManager(4096, block_size)
    used = copied = 0
    for r in requests:
        prompt = rng.integers(32000, size=r.prompt_len).tolist()
        u, c = workload(mgr, r.id, prompt, k, r.output_len, rng, share=share)
        used, copied = used + u, copied + c
    mgr.check_invariants()
    return used, copied


@dataclass(frozen=True)
class Saving:
    """One workload at one ``k`` (samples or beams), with sharing and with private copies."""

    used_shared: int  # block-steps: blocks in use summed over decode steps
    used_copies: int
    copied_shared: int  # blocks copied: copy-on-write of partly filled last blocks
    copied_copies: int  # blocks copied: whole prompts or beams duplicated

    @property
    def saved(self) -> float:
        """The paper's metric: blocks saved by sharing over blocks needed without it."""
        return 1 - self.used_shared / self.used_copies


def measure_saving(workload: Workload, requests: list[Request], k: int,
                   block_size: int = 16, seed: int = 1) -> Saving:
    """Run ``requests`` under ``workload`` with and without sharing (same seed, same tokens)."""
    (used_shared, copied_shared), (used_copies, copied_copies) = [
        block_steps(workload, requests, k, share, block_size, seed) for share in (True, False)]
    return Saving(used_shared, used_copies, copied_shared, copied_copies)
