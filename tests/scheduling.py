"""The model-free scheduler the scheduling tests drive: one way to build it, one way to step it
(the library's own loop body with placeholder tokens, as the simulator and chapter 6 use)."""

from pagedlab.engine import Placeholders, Scheduler, SchedulerConfig
from pagedlab.engine import run_step as run_one_step
from pagedlab.memory import KVCacheManager


def make(num_blocks=8, block_size=4, num_cpu_blocks=0, **config):
    """A scheduler over a cache of ``num_blocks`` blocks, with ``config``'s limits."""
    return Scheduler(KVCacheManager(num_blocks, block_size, num_cpu_blocks),
                     SchedulerConfig(**config))


def run_step(sched, token=7, drafter=None):
    """One step in which every live sequence samples ``token`` (all ``n`` samples of a prompt's
    step included), then ``drafter``'s proposals for the next; the step and the groups it
    finished."""
    step, _, finished = run_one_step(sched, Placeholders(token), drafter=drafter)
    return step, finished
