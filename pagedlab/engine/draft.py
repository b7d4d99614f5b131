"""A draft model as proposer: a smaller model guesses ``k`` tokens greedily, on its own paged cache.

The draft is a :class:`~pagedlab.model.PagedLlama` run by a
:class:`~pagedlab.engine.runner.ModelRunner` of its own, over a
:class:`~pagedlab.memory.KVCacheManager` and block pool of its own, so a guess costs it one
decode, not a prefill of the whole context. Its cache follows the target's: it holds the
sequence's tokens and its own guesses. Each time it is asked, it first follows the target:
a sequence's cache is cut back to the tokens the target kept (a rejected guess's K/V would
otherwise condition the next guesses), and a sequence it is no longer asked about (finished,
aborted, preempted) gives its blocks back. No hook from the scheduler is needed: the
sequences' tokens say it all.

:func:`early_exit` makes the book's draft out of the target itself: its first layers, its
final norm and its head, sharing their weights (self-speculation without training, the
draft LayerSkip trains a model to be good at).

Guesses are the draft's argmax, a point mass for the rejection rule (which is exact for any
guess); sampling them from the draft's distribution would raise acceptance for sampled
requests but needs the draft's probabilities carried to the sampler.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from pagedlab._arith import cdiv
from pagedlab._checks import check_positive
from pagedlab.engine.runner import ModelRunner
from pagedlab.engine.sequence import Sequence
from pagedlab.engine.speculative import Proposer
from pagedlab.engine.step import Chunk, Step
from pagedlab.memory import KVCacheManager
from pagedlab.model import PagedLlama


def early_exit(model: PagedLlama, num_layers: int) -> PagedLlama:
    """The first ``num_layers`` layers of ``model``, its final norm and its head: a model
    that shares every weight with ``model`` and runs ``num_layers / num_layers(model)`` of
    its layers (the head and the embedding are paid in full)."""
    total = model.args.num_layers
    check_positive("draft_layers", num_layers, integer=True)
    if num_layers > total:
        raise ValueError(f"draft_layers={num_layers} must be at most the target's {total} "
                         "layers")
    with torch.device("meta"):  # no memory: every module is replaced by the target's
        draft = PagedLlama(replace(model.args, num_layers=num_layers), kernels=model.kernels)
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = nn.ModuleList(list(model.model.layers)[:num_layers])
    draft.model.norm = model.model.norm
    draft.lm_head = model.lm_head
    return draft


class DraftModelProposer(Proposer):
    """Greedy guesses from ``model`` on a cache of ``num_blocks`` blocks of ``block_size``.

    :meth:`propose_all` drafts every sequence at once: one forward pass over what each
    sequence's draft cache lacks (the tokens accepted or decoded since its last guesses, or
    its whole context the first time), which gives the first guess, then ``k - 1`` batched
    decodes. A sequence the draft's pool has no room for gets no guesses.
    """

    def __init__(self, model: PagedLlama, block_size: int, num_blocks: int):
        self.model = model
        self.manager = KVCacheManager(num_blocks, block_size)
        self.runner = ModelRunner(model, block_size, num_blocks, 0)
        self.contexts: dict[int, int] = {}  # tokens of each sequence's own, when last drafted
        self.num_forward_passes = 0  # the draft's, for cost accounting

    def propose_all(self, seqs: list[Sequence], k: int) -> dict[int, list[int]]:
        m, tokens = self.manager, {}
        self._follow(seqs)
        spare = m.num_free_blocks
        for seq in seqs:
            context = seq.token_ids
            start = m.num_tokens(seq.seq_id) if seq.seq_id in m else 0
            need = cdiv(len(context) + k - 1, m.block_size) - cdiv(start, m.block_size)
            if need > spare:  # no room for its context and guesses: no guesses this step
                continue
            spare -= need
            if start:
                m.append(seq.seq_id, context[start:])
            else:
                m.allocate(seq.seq_id, context)
            self.contexts[seq.seq_id] = len(context)
            tokens[seq.seq_id] = (start, list(context))
        if not tokens:
            return {}
        catch_up = [Chunk.of(m, Sequence(i, t), start, len(t) - start)
                    for i, (start, t) in tokens.items()]
        guesses = self._forward(Step(prefills=catch_up))
        for _ in range(k - 1):
            decodes = []
            for seq_id, (_, t) in tokens.items():
                t.append(guesses[seq_id])
                m.append(seq_id, t[-1:])
                decodes.append(Chunk.of(m, Sequence(seq_id, t), len(t) - 1, 1))
            guesses = self._forward(Step(decodes=decodes))
        return {seq_id: t[len(t) - k + 1:] + [guesses[seq_id]] for seq_id, (_, t) in tokens.items()}

    def _follow(self, seqs: list[Sequence]) -> None:
        """Keep only ``seqs``' caches, each cut back to the guesses the target accepted (the
        tokens it held past its context that the sequence now has too), short of the
        sequence's newest token, which the next forward pass runs."""
        asked = {seq.seq_id: seq for seq in seqs}
        for seq_id in [s for s in self.contexts if s not in asked]:
            self.manager.free(seq_id)
            del self.contexts[seq_id]
        for seq_id, seq in asked.items():
            if seq_id not in self.contexts:
                continue
            held, now = self.manager.token_ids(seq_id), seq.token_ids
            last = min(len(held), len(now) - 1)  # the newest token's logits give a guess
            keep = min(self.contexts[seq_id], last)
            while keep < last and held[keep] == now[keep]:
                keep += 1
            if keep < len(held):
                self.manager.truncate(seq_id, keep)

    def _forward(self, step: Step) -> dict[int, int]:
        """The draft's argmax after each chunk of ``step``, by sequence id."""
        batch, last, rows = self.runner.prepare(step)
        hidden = self.model(batch, self.runner.kv_caches)
        best = self.model.compute_logits(hidden[last]).argmax(-1).tolist()
        self.num_forward_passes += 1
        return {seq_id: best[row] for seq_id, row in rows.items()}
