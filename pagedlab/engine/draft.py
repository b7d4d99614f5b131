"""A draft model as proposer: a smaller model guesses ``k`` tokens greedily, on its own paged cache.

The draft is a :class:`~pagedlab.model.PagedLlama` run by a
:class:`~pagedlab.engine.runner.ModelRunner` of its own, over a
:class:`~pagedlab.memory.KVCacheManager` and block pool of its own, so a guess costs it one
decode, not a prefill of the whole context. Its cache follows the target's: it holds the
sequence's tokens and its own guesses; after verification it is truncated to what the target
accepted (a rejected guess's K/V would otherwise condition the next guesses), and a sequence
that leaves the batch gives its blocks back.

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

    :meth:`start_step` drafts every sequence of the step at once: one forward pass over what
    each sequence's draft cache lacks (the tokens accepted or decoded since its last
    guesses, or its whole context the first time), which gives the first guess, then
    ``k - 1`` batched decodes. A sequence the draft's pool has no room for gets no guesses.
    """

    def __init__(self, model: PagedLlama, block_size: int, num_blocks: int, k: int):
        self.model, self.k = model, k
        self.manager = KVCacheManager(num_blocks, block_size)
        self.runner = ModelRunner(model, block_size, num_blocks, 0)
        self.drafts: dict[int, list[int]] = {}  # this step's guesses, by sequence id
        self.num_forward_passes = 0  # the draft's, for cost accounting

    def start_step(self, seqs) -> None:
        self.drafts = {}
        m, tokens = self.manager, {}
        spare = m.num_free_blocks
        for seq in seqs:
            context = seq.token_ids
            # keep() left its cache a prefix of the sequence, short of the last token
            start = m.num_tokens(seq.seq_id) if seq.seq_id in m else 0
            need = cdiv(len(context) + self.k - 1, m.block_size) - cdiv(start, m.block_size)
            if need > spare:  # no room for its context and guesses: no guesses this step
                continue
            spare -= need
            if start:
                m.append(seq.seq_id, context[start:])
            else:
                m.allocate(seq.seq_id, context)
            tokens[seq.seq_id] = (start, list(context))
        if not tokens:
            return
        catch_up = [Chunk.of(m, Sequence(i, t), start, len(t) - start)
                    for i, (start, t) in tokens.items()]
        guesses = self._forward(Step(prefills=catch_up))
        for _ in range(self.k - 1):
            decodes = []
            for seq_id, (_, t) in tokens.items():
                t.append(guesses[seq_id])
                m.append(seq_id, t[-1:], num_speculative=1)
                decodes.append(Chunk.of(m, Sequence(seq_id, t), len(t) - 1, 1))
            guesses = self._forward(Step(decodes=decodes))
        for seq_id, (_, t) in tokens.items():
            self.drafts[seq_id] = t[len(t) - self.k + 1:] + [guesses[seq_id]]

    def propose(self, token_ids: list[int], k: int, seq_id=None) -> list[int]:
        return self.drafts.get(seq_id, [])[:k]

    def keep(self, seq_id, num_tokens: int) -> None:
        """Truncate the draft's cache to the tokens the target kept: rejected guesses go."""
        if seq_id in self.manager and self.manager.num_tokens(seq_id) > num_tokens:
            self.manager.truncate(seq_id, num_tokens)

    def free(self, seq_id) -> None:
        if seq_id in self.manager:
            self.manager.free(seq_id)
        self.drafts.pop(seq_id, None)

    def _forward(self, step: Step) -> dict[int, int]:
        """The draft's argmax after each chunk of ``step``, by sequence id."""
        batch, last, rows = self.runner.prepare(step)
        hidden = self.model(batch, self.runner.kv_caches)
        best = self.model.compute_logits(hidden[last]).argmax(-1).tolist()
        self.num_forward_passes += 1
        return {seq_id: best[row] for seq_id, row in rows.items()}
