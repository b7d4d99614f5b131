"""What a run did, step by step and in total: the numbers chapters 6 and 8 plot and quote."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepStats:
    """One scheduler step: the batch it formed and the cache after forming it."""

    step: int
    prefill_seqs: int
    prefill_tokens: int  # prompt tokens computed this step (prefix-cache hits excluded)
    decode_seqs: int
    running: int  # groups in each queue once the step was formed
    waiting: int
    swapped: int
    used_blocks: int  # GPU blocks in use
    preempted: tuple[tuple[str, str], ...] = ()  # (request id, "recompute" or "swap")
    swapped_in: tuple[str, ...] = ()  # request ids
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    blocks_copied: int = 0  # copy-on-write copies
    kv_tokens_read: int = 0  # cached keys attention reads (pagedlab.engine.step.kv_tokens_read)
    draft_tokens: int = 0  # speculative proposals the decodes verify

    @property
    def batched_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs + self.draft_tokens


@dataclass
class EngineStats:
    """Totals of one ``generate`` or ``beam_search`` call, and its steps."""

    num_gpu_blocks: int
    num_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0  # tokens sampled (beam search: given to the beams kept)
    elapsed_s: float = 0.0
    prefix_hits: int = 0  # prefilled tokens served from the prefix cache (re-prefills included)
    prefix_misses: int = 0  # prefilled tokens computed
    steps: list[StepStats] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def peak_blocks_used(self) -> int:
        return max((s.used_blocks for s in self.steps), default=0)

    @property
    def preemptions(self) -> int:
        return sum(len(s.preempted) for s in self.steps)

    @property
    def recomputations(self) -> int:
        return sum(mode == "recompute" for s in self.steps for _, mode in s.preempted)

    @property
    def swap_outs(self) -> int:
        return sum(mode == "swap" for s in self.steps for _, mode in s.preempted)

    @property
    def swap_ins(self) -> int:
        return sum(len(s.swapped_in) for s in self.steps)

    @property
    def blocks_swapped(self) -> int:
        """Blocks moved either way between the GPU and CPU pools."""
        return sum(s.blocks_swapped_out + s.blocks_swapped_in for s in self.steps)

    @property
    def blocks_copied(self) -> int:
        """Copy-on-write block copies."""
        return sum(s.blocks_copied for s in self.steps)

    @property
    def prefix_hit_rate(self) -> float:
        total = self.prefix_hits + self.prefix_misses
        return self.prefix_hits / total if total else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of wall time."""
        return self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def summary(self) -> dict:
        """The totals as a flat dict (for a table or a glue)."""
        names = (
            "num_requests", "prompt_tokens", "generated_tokens", "num_steps", "elapsed_s",
            "tokens_per_second", "num_gpu_blocks", "peak_blocks_used", "preemptions",
            "recomputations", "swap_outs", "swap_ins", "blocks_swapped", "blocks_copied",
            "prefix_hit_rate",
        )
        return {name: getattr(self, name) for name in names}
