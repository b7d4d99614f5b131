"""The scheduler's rules one by one, each worked out by hand on a model-free scheduler (written
to kill the mutants that survived the other tests: tests/MUTATION.md)."""

import pytest
from scheduling import make, run_step

from pagedlab.engine import (
    BeamSearchParams,
    CacheTooSmall,
    GroupOutput,
    GroupStatus,
    Priority,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SequenceOutput,
)
from pagedlab.engine.step import Placeholders, drive
from pagedlab.memory import KVCacheManager


def add(sched, rid, prompt_len, max_tokens=4, n=1, stop=()):
    return sched.add_request(rid, list(range(1, prompt_len + 1)),
                             SamplingParams(n=n, max_tokens=max_tokens, seed=0),
                             stop_token_ids=stop)


def test_drive_runs_every_request_to_its_end_with_the_executor_it_is_given():
    """Without an executor every sequence samples token 0; with one, that executor's token."""
    for executor, token in ((None, 0), (Placeholders(5), 5)):
        sched = make()
        add(sched, "a", 6, max_tokens=3)
        add(sched, "b", 2, max_tokens=2)
        steps = drive(sched, executor)
        outputs = {c.seq.seq_id: c.seq.output_token_ids for s in steps for c in s.chunks}
        assert sorted(outputs.values()) == [[token] * 2, [token] * 3]
        assert len(steps) == 3 and sched.manager.num_free_blocks == 8


# --- configuration and requests -------------------------------------------------------------


@pytest.mark.parametrize("config, message", [
    (dict(max_num_seqs=0), r"max_num_seqs=0 must be > 0"),
    (dict(max_num_seqs=2.0), r"max_num_seqs=2.0 must be an integer"),
    (dict(max_num_batched_tokens=2.5), r"max_num_batched_tokens=2.5 must be an integer"),
    (dict(max_num_seqs=8, max_num_batched_tokens=7),
     r"max_num_batched_tokens=7 must be at least max_num_seqs=8: each running sequence"),
    (dict(preemption_mode="drop"),
     r"preemption_mode='drop' must be one of \('recompute', 'swap'\)"),
    (dict(watermark=1.0), r"watermark=1.0 must be in \[0, 1\)"),
    (dict(watermark=-0.1), r"watermark=-0.1 must be in \[0, 1\)"),
    (dict(max_model_len=0), r"^max_model_len=0 must be > 0"),
    (dict(max_model_len=2.5), r"^max_model_len=2.5 must be an integer"),
])
def test_a_bad_config_is_named(config, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**config)


def test_the_edges_of_the_config_are_allowed():
    SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, watermark=0.0)
    with pytest.raises(TypeError, match=r"policy=.* must be an instance of a pagedlab.engine."
                       r"Policy subclass, such as FCFS\(\) \(an instance, not the class\)"):
        SchedulerConfig(policy=object())
    with pytest.raises(TypeError, match=r"^chunked_prefill=1 must be a bool$"):
        SchedulerConfig(chunked_prefill=1)


def test_requests_that_can_never_run_are_named():
    sched = make(num_blocks=4, watermark=0.25, max_num_seqs=2, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=r"request 'e': the prompt is empty"):
        sched.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match=r"request 'w' runs 3 sequences at once, more than "
                                         r"max_num_seqs=2"):
        add(sched, "w", 4, n=3)
    # 4 blocks, watermark 1: a 12-token prompt (3 blocks) fits, 13 tokens (4 blocks) never does
    add(sched, "ok", 12)
    with pytest.raises(CacheTooSmall, match=r"request 'big': its prompt of 13 tokens needs 4 "
                       r"blocks of 4 tokens, but admission can use at most 3 \(4 blocks, 1 kept "
                       r"free as the watermark\)$"):
        add(sched, "big", 13)
    assert [g.request_id for g in sched.waiting] == ["ok"]
    with pytest.raises(ValueError, match=r"^request 'ok' is already running; ids must be unique$"):
        add(sched, "ok", 1)


# --- admission ------------------------------------------------------------------------------


def test_admission_fills_the_token_budget_and_a_big_prefill_runs_alone():
    sched = make(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=8, watermark=0.0,
                 chunked_prefill=False)
    for rid, n in (("a", 3), ("b", 5), ("c", 1), ("big", 12), ("d", 2)):
        add(sched, rid, n)
    steps = []
    while sched.has_unfinished:
        step, _ = run_step(sched)
        steps.append(([g.request_id for g in step.groups], step.stats.batched_tokens))
    # by hand: a + b fill the budget of 8; their 2 decodes leave 6, enough for c and not for
    # big, which stops the queue (FCFS); big, larger than any budget, waits until it can run
    # alone; d follows it.
    assert steps[:2] == [(["a", "b"], 8), (["a", "b", "c"], 3)]
    alone = steps.index((["big"], 12))
    assert all("big" not in groups for groups, _ in steps[:alone])
    assert steps[alone + 1] == (["big", "d"], 3)


def test_chunked_prefill_fills_every_step_to_the_budget_decodes_first():
    sched = make(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=8, watermark=0.0)
    for rid, n in (("a", 3), ("b", 5), ("c", 1), ("big", 12), ("d", 2)):
        add(sched, rid, n)
    steps = []
    while sched.has_unfinished:
        step, _ = run_step(sched)
        steps.append([(c.seq.seq_id, c.start, c.num_tokens) for c in step.chunks])
        assert step.stats.batched_tokens <= 8
    # by hand (seq ids a=0, b=1, c=2, big=3, d=4; prefill chunks first, then decodes):
    # step 1: a and b whole (3 + 5). Step 2: a and b decode (2), c whole (1), big's first
    # 5 tokens. Step 3: three decodes; big goes on with the 5 tokens the budget has left.
    # Step 4: three decodes and big's last 2 tokens (it samples); d, whom the budget would
    # take, waits for a seat (max_num_seqs=4) until a and b finish (4 tokens each) in step 4.
    assert steps[:5] == [
        [(0, 0, 3), (1, 0, 5)],
        [(2, 0, 1), (3, 0, 5), (0, 3, 1), (1, 5, 1)],
        [(3, 5, 5), (0, 4, 1), (1, 6, 1), (2, 1, 1)],
        [(3, 10, 2), (0, 5, 1), (1, 7, 1), (2, 2, 1)],
        [(4, 0, 2), (2, 3, 1), (3, 12, 1)],
    ]
    assert sched.manager.num_used_blocks == 0


def test_a_partial_prefill_takes_blocks_chunk_by_chunk_and_samples_only_at_its_end():
    sched = make(num_blocks=16, max_num_batched_tokens=4, max_num_seqs=4, watermark=0.0)
    add(sched, "a", 10, max_tokens=2)
    blocks, sampled = [], []
    while sched.has_unfinished:
        step, _ = run_step(sched)
        blocks.append(sched.manager.num_used_blocks)
        sampled.append([g.request_id for g in step.sampled_groups])
    # 10 tokens in chunks of 4, 4, 2 (blocks of 4: 1, 2, 3 blocks), then one decode
    assert blocks == [1, 2, 3, 0]
    assert sampled == [[], [], ["a"], ["a"]]


def test_admission_stops_at_the_seats():
    sched = make(num_blocks=16, max_num_seqs=3, watermark=0.0)
    add(sched, "a", 2, n=2)
    add(sched, "b", 2, n=2)
    add(sched, "c", 2, n=1)
    step, _ = run_step(sched)
    assert [g.request_id for g in step.groups] == ["a"]  # "b" needs 2 more seats of 1 left
    assert step.stats.waiting == 2 and step.stats.running == 1


def test_admission_keeps_the_watermark_free():
    sched = make(num_blocks=10, watermark=0.2)  # 2 blocks kept free
    add(sched, "a", 16)  # 4 blocks
    add(sched, "b", 16)  # 4 more would leave 2: allowed
    add(sched, "c", 1)  # 1 more would leave 1: not while the watermark holds
    step = sched.schedule()
    assert [g.request_id for g in step.groups] == ["a", "b"]
    assert sched.manager.num_free_blocks == 2 and sched.watermark_blocks == 2


# --- decoding and preemption ----------------------------------------------------------------


def test_a_decode_takes_a_block_only_after_a_full_one():
    sched = make(num_blocks=8, watermark=0.0)
    add(sched, "a", 3, max_tokens=6)
    used = []
    while sched.has_unfinished:
        step, _ = run_step(sched)
        used.append(step.stats.used_blocks)
    # tokens in the cache after each step's scheduling: 3, 4, 5, 6, 7, 8 -> blocks of 4
    assert used == [1, 1, 2, 2, 2, 2]


def test_forked_samples_share_the_prompt_and_copy_on_write():
    sched = make(num_blocks=8, watermark=0.0)
    add(sched, "a", 6, max_tokens=3, n=3)
    step, _ = run_step(sched)  # the prompt once, then three samples share its two blocks
    assert step.stats.prefill_seqs == 1 and sched.manager.num_used_blocks == 2
    step, _ = run_step(sched)  # each appends to the shared half block: two copies, one keeps it
    assert step.stats.decode_seqs == 3 and step.stats.blocks_copied == 2
    assert sched.manager.num_used_blocks == 4


def test_forks_are_numbered_after_the_samples_there_are():
    sched = make(num_blocks=8, watermark=0.0)
    group = add(sched, "a", 6, max_tokens=3, n=4)
    run_step(sched)
    assert [s.index for s in group.seqs] == [0, 1, 2, 3]
    assert len({s.seq_id for s in group.seqs}) == 4


def test_the_copy_on_write_need_is_counted_before_preempting():
    """Three samples on a shared half block need two blocks, not three, so with exactly two
    free nothing is preempted."""
    sched = make(num_blocks=4, watermark=0.0)
    add(sched, "a", 6, max_tokens=3, n=3)
    run_step(sched)
    assert sched.manager.num_free_blocks == 2
    step, _ = run_step(sched)
    assert step.stats.preempted == () and step.stats.blocks_copied == 2


def test_swap_out_and_back_in_when_room_returns():
    sched = make(num_blocks=3, num_cpu_blocks=4, watermark=0.0, preemption_mode="swap")
    add(sched, "a", 4, max_tokens=3)
    add(sched, "b", 4, max_tokens=6)
    run_step(sched)  # two full blocks, one free
    step, _ = run_step(sched)  # both need a block: b, the latest, goes to the CPU
    assert step.stats.preempted == (("b", "swap"),) and step.stats.blocks_swapped_out == 1
    assert sched.swapped[0].status is GroupStatus.SWAPPED
    statuses = []
    while sched.has_unfinished:
        step, done = run_step(sched)
        statuses.append((step.stats.swapped_in, step.stats.blocks_swapped_in))
    assert (("b",), 1) in statuses  # back once a finished off the GPU
    assert sched.manager.num_used_blocks == 0 and sched.manager.cpu.num_used == 0


def test_a_full_cpu_pool_falls_back_to_recompute():
    sched = make(num_blocks=3, num_cpu_blocks=0, watermark=0.0, preemption_mode="swap")
    add(sched, "a", 4, max_tokens=3)
    add(sched, "b", 4, max_tokens=3)
    run_step(sched)
    step, _ = run_step(sched)
    assert step.stats.preempted == (("b", "recompute"),)
    assert sched.waiting[0].request_id == "b" and sched.waiting[0].status is GroupStatus.WAITING


def test_nothing_is_admitted_in_a_step_that_preempted():
    sched = make(num_blocks=3, watermark=0.0)
    add(sched, "a", 4, max_tokens=4)
    add(sched, "b", 4, max_tokens=4)
    run_step(sched)
    add(sched, "c", 1)
    step, _ = run_step(sched)
    assert step.stats.preempted == (("b", "recompute"),) and step.stats.prefill_seqs == 0


def test_a_group_alone_that_cannot_grow_fails_alone_and_frees_its_blocks():
    sched = make(num_blocks=2, watermark=0.0)
    add(sched, "a", 8, max_tokens=4)
    add(sched, "b", 3, max_tokens=1)
    run_step(sched)  # "a" fills both blocks: "b" waits
    step = sched.schedule()  # "a" cannot grow even alone: it fails, and "b" is admitted
    (failed,) = step.failed
    assert failed.request_id == "a" and failed.is_finished
    assert isinstance(failed.error, CacheTooSmall)
    assert str(failed.error) == ("request 'a' needs 3 blocks of 4 tokens to go on; the cache "
                                 "has 2, of which admission keeps 0 free: give it more blocks or "
                                 "fewer tokens")
    assert failed.seqs[0].finish_reason == "error" and len(failed.seqs[0].output_token_ids) == 1
    assert [c.seq.seq_id for c in step.prefills] == [sched.unfinished["b"].seqs[0].seq_id]
    sched.abort_all()
    assert not sched.has_unfinished and sched.manager.num_used_blocks == 0


def test_a_stop_token_or_max_tokens_ends_a_sequence_and_frees_it():
    sched = make(num_blocks=8, watermark=0.0)
    add(sched, "stops", 2, max_tokens=10, stop=(7,))
    add(sched, "runs", 2, max_tokens=2)
    step, done = run_step(sched, token=7)
    assert [g.request_id for g in done] == ["stops"]
    assert done[0].seqs[0].finish_reason == "stop" and done[0].status is GroupStatus.FINISHED
    step, done = run_step(sched, token=5)
    assert [g.request_id for g in done] == ["runs"] and done[0].seqs[0].finish_reason == "length"
    assert sched.manager.num_used_blocks == 0 and not sched.has_unfinished


def test_decodes_take_their_tokens_out_of_the_budget_and_steps_are_numbered():
    sched = make(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=8, watermark=0.0)
    for rid, n in (("a", 3), ("b", 5), ("c", 6), ("d", 3)):
        add(sched, rid, n)
    first, _ = run_step(sched)
    second, _ = run_step(sched)  # 8 - 2 decodes = 6: exactly c's prompt, nothing left for d
    assert [g.request_id for g in second.groups] == ["a", "b", "c"]
    assert (first.stats.step, second.stats.step, sched.num_steps) == (0, 1, 2)


def test_abort_all_finishes_every_sequence_as_aborted():
    sched = make(num_blocks=8, watermark=0.0)
    groups = [add(sched, "a", 4), add(sched, "b", 4, n=2), add(sched, "c", 30)]
    run_step(sched)
    sched.abort_all()
    assert all(s.finish_reason == "abort" for g in groups for s in g.seqs)
    assert all(g.status is GroupStatus.FINISHED for g in groups)
    assert sched.manager.num_used_blocks == 0 and not sched.has_unfinished


def test_two_groups_swap_out_in_one_step_and_come_back_in_one_step():
    sched = make(num_blocks=3, num_cpu_blocks=4, watermark=0.0, preemption_mode="swap")
    add(sched, "a", 4, max_tokens=2)
    add(sched, "b", 4, max_tokens=3)
    add(sched, "c", 2, max_tokens=3)
    run_step(sched)  # one block each, none free
    # by hand: a's decode needs a fresh block: c, the latest, goes to the CPU (its decode fits
    # its own block); then b needs one and only a runs: b goes too. a finishes this step.
    out, done = run_step(sched)
    assert out.stats.preempted == (("c", "swap"), ("b", "swap"))
    assert len(out.swap_out) == out.stats.blocks_swapped_out == 2
    assert out.stats.swapped == 2 and [g.request_id for g in done] == ["a"]
    assert all(g.status is GroupStatus.SWAPPED for g in sched.swapped)
    # three free blocks: b takes its block back and one to decode, c its block: both return
    back, _ = run_step(sched)
    assert back.stats.swapped_in == ("b", "c") and len(back.swap_in) == 2
    assert back.stats.swapped == 0 and back.stats.preempted == ()
    assert all(g.status is GroupStatus.RUNNING for g in sched.running)
    assert sched.manager.num_free_blocks == 0


def test_a_decode_may_take_the_last_free_block():
    sched = make(num_blocks=3, watermark=0.0)
    add(sched, "a", 4, max_tokens=3)
    add(sched, "b", 2, max_tokens=3)
    run_step(sched)  # a fills a block, b half of one: one block free
    step, _ = run_step(sched)  # a needs exactly that block; b, behind it, keeps its own
    assert step.stats.preempted == () and step.stats.decode_seqs == 2
    assert sched.manager.num_free_blocks == 0


def test_a_request_as_wide_as_max_num_seqs_runs():
    sched = make(num_blocks=8, watermark=0.0, max_num_seqs=3)
    group = add(sched, "w", 4, max_tokens=2, n=3)
    while sched.has_unfinished:
        run_step(sched)
    assert [len(s.output_token_ids) for s in group.seqs] == [2, 2, 2]


def test_prefix_hits_are_neither_computed_nor_counted_as_prefill():
    sched = Scheduler(KVCacheManager(8, 4, enable_prefix_caching=True),
                      SchedulerConfig(watermark=0.0))
    add(sched, "a", 9, max_tokens=2)
    first, _ = run_step(sched)
    add(sched, "b", 9, max_tokens=1)  # the same prompt: its two full blocks are cached
    second, _ = run_step(sched)
    assert (first.stats.prefill_tokens, first.stats.kv_tokens_read) == (9, 0)
    # b reads its 8 cached tokens; a's decode, its 9 and the new one
    assert (second.stats.prefill_tokens, second.stats.kv_tokens_read) == (1, 8 + 10)
    assert [(c.start, c.num_tokens) for c in second.prefills] == [(8, 1)]


def test_a_verification_chunk_reads_its_cached_tokens_not_its_own():
    """A speculative decode of 1 + k query tokens is attended like a prompt chunk: it reads the
    ``start`` cached keys, and its own within the chunk. Its step's stats and the cost fit's
    feature count it the same way."""
    from pagedlab.sim.calibration import features, step_shape

    from pagedlab.engine.speculative import Drafter, NgramProposer

    sched = make(num_blocks=16, watermark=0.0)
    drafter = Drafter(NgramProposer(1, 4), num_speculative_tokens=3)
    sched.add_request("a", [1, 2, 3, 1, 2, 3, 1], SamplingParams(max_tokens=8))
    sched.add_request("b", [10, 11, 12, 13], SamplingParams(max_tokens=4))
    run_step(sched, 2, drafter)  # both prompts; a's is now 1 2 3 1 2 3 1 2, b's 10 11 12 13 2
    step, _ = run_step(sched, 2, drafter)
    assert [(c.start, c.num_tokens, c.draft) for c in step.decodes] == [
        (7, 1 + 3, [3, 1, 2]),  # a: "1 2" was followed by 3 1 2
        (4, 1, []),  # b: "2" has no earlier match, nothing to propose
    ]
    # a reads its 7 cached keys (its 4 own are the chunk's); b its 4 and its new one
    assert step.stats.kv_tokens_read == 7 + (4 + 1)
    shape = step_shape(step)
    assert features(shape.prefill_lens, shape.decode_lens, shape.prefill_starts)[
        "kv_tokens_read"] == 7 + (4 + 1)


def test_a_recomputed_victim_has_no_computed_tokens_left():
    """Preempted by recomputation, a sequence's blocks are freed, so none of its tokens has its
    keys and values cached: its progress goes back to 0 (and its next start recomputes all)."""
    sched = make(num_blocks=4, watermark=0.0)
    add(sched, "a", 4, max_tokens=8)
    add(sched, "b", 4, max_tokens=8)
    victim = None
    while victim is None:
        step, _ = run_step(sched)
        victim = next((g for g, mode in step.preempted if mode == "recompute"), None)
    assert victim.status is GroupStatus.WAITING
    assert [s.num_computed_tokens for s in victim.live] == [0]


@pytest.mark.parametrize("chunked, need", [(True, 2), (False, 4)])
def test_a_request_needs_the_blocks_of_its_first_chunk_to_start(chunked, need):
    """What the scheduler reports (CacheTooSmall) for a queue's head that can never start:
    with chunked prefill the blocks of its first chunk, the budget's 8 tokens (2 blocks of 4);
    without, all 13 of its tokens (4 blocks)."""
    sched = make(num_blocks=8, chunked_prefill=chunked, max_num_batched_tokens=8, max_num_seqs=4)
    group = add(sched, "a", 13)
    assert sched._blocks_to_start(group) == need


def test_a_recomputed_fork_needs_its_shared_prompt_once_and_all_its_tokens_to_start():
    """A forked group back in the queue restarts unchunked (rule 5): the prompt's full blocks
    once, then each sample's own tokens, whatever the budget."""
    sched = make(num_blocks=6, watermark=0.0, chunked_prefill=True, max_num_batched_tokens=4,
                 max_num_seqs=4)
    add(sched, "a", 4, max_tokens=20)
    fork = add(sched, "f", 5, max_tokens=20, n=2)
    while fork.status is not GroupStatus.WAITING or len(fork.live) < 2:
        run_step(sched)
    lens = [len(s) for s in fork.live]
    assert sched._blocks_to_start(fork) == 4 // 4 + sum(-(-(n - 4) // 4) for n in lens)


def test_a_recomputed_fork_restarts_only_above_the_watermark():
    """Rule 3 holds for a forked group's return as for any admission. Recomputed at 13 tokens
    a sample, it needs its 2 shared prompt blocks and 2 of its own per sample: 6, the whole
    cache, where admission keeps 1 free; it fails, naming the numbers, rather than restart."""
    sched = make(num_blocks=6, watermark=0.2, max_num_seqs=4)
    sched.add_request("a", [1, 2], SamplingParams(max_tokens=8, seed=0))
    fork = add(sched, "f", 8, max_tokens=8, n=2)
    modes = []
    while sched.has_unfinished:
        step, _ = run_step(sched)
        modes += [mode for g, mode in step.preempted if g is fork]
        assert not (modes and any(c.seq in fork.seqs for c in step.prefills)), "restarted"
    assert modes == ["recompute"] and [s.finish_reason for s in fork.seqs] == ["error"] * 2
    assert str(fork.error) == ("request 'f' needs 6 blocks of 4 tokens to go on; the cache has "
                               "6, of which admission keeps 1 free: give it more blocks or "
                               "fewer tokens")


def test_a_sequence_with_one_token_left_gets_no_guesses():
    """The target's own token is the last one the request may have, so a guess would pass
    max_tokens: the drafter leaves the sequence none (and two tokens left allow one guess)."""
    from pagedlab.engine.speculative import Drafter, NgramProposer

    sched = make(num_blocks=16, watermark=0.0)
    drafter = Drafter(NgramProposer(1, 4), num_speculative_tokens=3)
    sched.add_request("a", [2, 2, 2, 2], SamplingParams(max_tokens=2))  # a run: always a guess
    sched.add_request("b", [2, 2, 2, 2], SamplingParams(max_tokens=3))
    run_step(sched, 2, drafter)  # the prompts; each has one output token
    assert [g.seqs[0].spec_token_ids for g in sched.running] == [[], [2]]


@pytest.mark.parametrize("plen, prefills", [
    # a prompt shorter than a block: nothing to share, each sample recomputes all its tokens
    (2, [(0, 5), (0, 5)]),
    # prompt of 5: the first sample recomputes all 9 tokens, the second forks the prompt's
    # full block and computes from token 4 on (1 shared block + 2 each = all 5 blocks)
    (5, [(0, 9), (4, 5)]),
])
def test_a_recomputed_pair_of_samples_computes_its_shared_prompt_once(plen, prefills):
    sched = make(num_blocks=5, watermark=0.0)
    add(sched, "x", 4, max_tokens=6)
    add(sched, "f", plen, max_tokens=6, n=2)
    steps = []
    while sched.has_unfinished:
        step, _ = run_step(sched)
        steps.append(step)
    # f, the latest, is preempted when x and its two samples need blocks; it comes back
    # once x has finished, both samples at once in a step of their own
    assert [s.stats.preempted for s in steps].count((("f", "recompute"),)) == 1
    (back,) = [s for s in steps if len(s.prefills) == 2 and s.stats.step > 0]
    assert [(c.start, c.num_tokens) for c in back.prefills] == prefills
    assert back.stats.used_blocks == (4 if plen == 2 else 5)


@pytest.mark.parametrize("config, fails", [
    (dict(), True), (dict(max_num_batched_tokens=16), False), (dict(chunked_prefill=False), True)])
def test_a_request_that_grew_into_the_watermark_comes_back_only_in_chunks(config, fails):
    """Decodes may use the watermark's blocks; admission may not. "b" grows to 33 tokens (9
    blocks of 4) before "a" preempts it, and admission can use only 8 of the 10 blocks: whole
    (unchunked), or as a first chunk of 33 tokens, it can never come back, and fails alone once
    the cache is idle; with a budget of 16 its first chunk takes 4 blocks and the rest follow."""
    sched = make(num_blocks=10, watermark=0.2, max_num_seqs=2, **config)
    a = add(sched, "a", 1, max_tokens=12)
    b = add(sched, "b", 28, max_tokens=12)  # 40 tokens at the end: the whole cache
    failed, preempted = [], []
    while sched.has_unfinished:
        step, _ = run_step(sched)
        failed += step.failed
        preempted += [(g.request_id, len(g.seqs[0])) for g, _ in step.preempted]
    assert preempted == [("b", 33)] and len(a.seqs[0].output_token_ids) == 12
    if fails:
        assert failed == [b] and b.seqs[0].finish_reason == "error"
        assert str(b.error) == ("request 'b' needs 9 blocks of 4 tokens to go on; the cache has "
                                "10, of which admission keeps 2 free: give it more blocks or "
                                "fewer tokens")
    else:
        assert failed == [] and len(b.seqs[0].output_token_ids) == 12
    assert sched.manager.num_used_blocks == 0


def test_only_an_unfinished_request_can_be_aborted():
    sched = make(num_blocks=4, watermark=0.0)
    group = add(sched, "a", 2, max_tokens=1)
    run_step(sched)
    with pytest.raises(ValueError, match=r"^request 'a' has already finished$"):
        sched.abort(group)


def test_abort_takes_one_request_off_its_queue_and_frees_its_blocks():
    sched = make(num_blocks=3, num_cpu_blocks=4, watermark=0.0, preemption_mode="swap")
    a, b, c = add(sched, "a", 4, max_tokens=3), add(sched, "b", 3), add(sched, "c", 4)
    run_step(sched)
    step, _ = run_step(sched)  # a needs a block (b does not): c goes to the CPU
    assert step.stats.preempted == (("c", "swap"),)
    add(sched, "d", 2)  # waits: nothing is admitted while c is swapped out
    for group, queue in ((c, sched.swapped), (b, sched.running), (sched.waiting[0], sched.waiting)):
        sched.abort(group)
        assert group not in queue and group.status is GroupStatus.FINISHED
        assert [s.finish_reason for s in group.seqs] == ["abort"]
        assert group.request_id not in sched.unfinished
    assert sched.manager.cpu.num_used == 0 and sched.manager.num_used_blocks == 2  # a's alone
    while sched.has_unfinished:
        run_step(sched)
    assert len(a.seqs[0].output_token_ids) == 3 and sched.manager.num_used_blocks == 0


def test_after_a_recomputed_prompt_too_big_for_the_budget_nobody_is_admitted():
    """A forked pair recomputed takes 14 tokens in one step, more than the budget of 8 (it
    runs alone); the request waiting behind it starts in the next step, not with a chunk of
    -6 tokens."""
    sched = make(num_blocks=6, watermark=0.0, max_num_seqs=4, max_num_batched_tokens=8)
    add(sched, "x", 4, max_tokens=8)
    add(sched, "f", 5, max_tokens=8, n=2)
    chunks = []
    for i in range(12):
        if i == 6:
            add(sched, "h", 3, max_tokens=2)
        step, _ = run_step(sched)
        chunks.append([(c.seq.seq_id, c.start, c.num_tokens) for c in step.chunks])
    # f (seq 1, forked as seq 2) is preempted in step 5 and comes back in step 8, once x has
    # finished: seq 1 recomputes 9 tokens, seq 2 forks its prompt's full block and computes 5
    assert chunks[8] == [(1, 0, 9), (2, 4, 5)]
    assert chunks[9] == [(3, 0, 3), (1, 9, 1), (2, 9, 1)]  # h (seq 3) whole, then the decodes
    assert not sched.has_unfinished and sched.manager.num_used_blocks == 0


def test_a_stop_check_ends_the_sequence_it_reads_with_the_string_it_found():
    """The engine passes ``stop_check`` for stop strings: it reads the sequence after each token
    and returns the string that ended it, or None."""
    sched = make(num_blocks=8, watermark=0.0)
    group = sched.add_request(
        "a", [1, 2], SamplingParams(n=2, max_tokens=10, seed=0),
        stop_check=lambda seq: "halt" if seq.index == 1 and len(seq.output_token_ids) == 2
        else None)
    while sched.has_unfinished:
        run_step(sched)
    stopped, ran = sorted(group.seqs, key=lambda s: s.index, reverse=True)
    assert (stopped.finish_reason, stopped.stop_reason, len(stopped.output_token_ids)) == (
        "stop", "halt", 2)
    assert (ran.finish_reason, ran.stop_reason, len(ran.output_token_ids)) == ("length", None, 10)
    assert sched.manager.num_used_blocks == 0


def test_a_sequence_stops_at_the_models_length_and_its_times_are_in_order():
    sched = make(num_blocks=8, watermark=0.0)
    group = add(sched, "a", 5, max_tokens=10)
    group.max_len = 8  # the engine's max_model_len: 5 prompt tokens leave room for 3 more
    while sched.has_unfinished:
        run_step(sched)
    (seq,) = group.seqs
    assert (seq.finish_reason, len(seq.output_token_ids), len(seq)) == ("length", 3, 8)
    m = group.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_three_samples_on_a_half_block_need_two_copies_not_one():
    sched = make(num_blocks=3, watermark=0.0)
    group = add(sched, "a", 6, max_tokens=3, n=3)
    run_step(sched)  # the prompt: a full block and a half one, shared by three samples
    step = sched.schedule()  # two of them copy the half block; one block is free
    assert step.failed == [group] and str(group.error).startswith(
        "request 'a' needs 4 blocks of 4 tokens to go on; the cache has 3")
    assert sched.manager.num_used_blocks == 0


def test_beams_forked_from_two_parents_copy_both_half_blocks():
    """Two beams, each forked again: two half blocks, each shared by two beams, need one copy
    each. With one block free, the group cannot go on (alone, it fails)."""
    sched = make(num_blocks=4, watermark=0.0)
    group = sched.add_request("b", list(range(1, 7)), BeamSearchParams(beam_width=4, max_tokens=5))
    step = sched.schedule()  # 6 tokens: a full block and a half one
    (seq,) = group.seqs
    sched.update([GroupOutput(group, [SequenceOutput(seq, 7, 0.0)] * 2)])
    step = sched.schedule()  # both beams append to the shared half block: one copy
    first, second = group.live
    assert step.stats.blocks_copied == 1 and sched.manager.num_free_blocks == 1
    sched.update([GroupOutput(group, [SequenceOutput(p, t, 0.0) for p in (first, second)
                                      for t in (8, 9)])])
    step = sched.schedule()  # four beams on two half blocks: two copies, one block free
    assert step.failed == [group] and str(group.error).startswith(
        "request 'b' needs 5 blocks of 4 tokens to go on")
    assert sched.manager.num_used_blocks == 0


def test_a_swapped_group_that_can_never_return_fails_before_anyone_is_admitted():
    """As above, "b" grows into the watermark, but goes to the CPU: 8 blocks and one for its
    decode, more than admission's 8. "c", arriving meanwhile, waits while "b" is swapped out;
    once "a" has finished, "b" fails alone and "c" starts in the same step."""
    sched = make(num_blocks=10, num_cpu_blocks=16, watermark=0.2, preemption_mode="swap")
    add(sched, "a", 1, max_tokens=12)
    b = add(sched, "b", 28, max_tokens=20)
    steps = []
    for i in range(14):
        if i == 6:
            add(sched, "c", 2, max_tokens=2)
        step, _ = run_step(sched)
        steps.append(([g.request_id for g in step.groups], [g.request_id for g in step.failed]))
    assert steps[5:12] == [(["a"], [])] * 7  # b swapped out in step 5; nobody admitted
    assert steps[12] == (["c"], ["b"]) and isinstance(b.error, CacheTooSmall)
    assert not sched.has_unfinished and sched.manager.cpu.num_used == 0


def test_a_chunked_prompt_counts_once_in_the_prefix_stats():
    sched = Scheduler(KVCacheManager(8, 4, enable_prefix_caching=True),
                      SchedulerConfig(watermark=0.0, max_num_seqs=4, max_num_batched_tokens=4))
    add(sched, "a", 10, max_tokens=1)
    while sched.has_unfinished:
        run_step(sched)  # chunks of 4, 4 and 2 tokens
    stats = sched.manager.prefix_stats
    assert (stats.hits, stats.misses) == (0, 10)


def test_each_sample_keeps_the_top_logprobs_it_was_given():
    sched = make(num_blocks=8, watermark=0.0)
    group = add(sched, "a", 2, max_tokens=2, n=2)
    sched.schedule()
    (seq,) = group.seqs
    tops = [{7: -0.1, 8: -2.0}, {8: -0.2, 7: -1.9}]
    sched.update([GroupOutput(group, [SequenceOutput(seq, t, -0.5, top)
                                      for t, top in zip((7, 8), tops)])])
    assert [s.logprobs for s in group.seqs] == [[tops[0]], [tops[1]]]
    assert [s.cumulative_logprob for s in group.seqs] == [-0.5, -0.5]


def test_a_recomputed_pair_of_samples_may_fill_the_budget_to_the_last_token():
    """x, y and f (two samples of a 5-token prompt) fill 6 blocks of 4; when f's samples need
    a block of their own, f, the latest, is recomputed. It comes back once y has finished,
    beside x's decode: its first sample recomputes 6 tokens, the second forks the prompt's full
    block and computes 2 more, and with x's token that is the budget of 9 exactly."""
    sched = make(num_blocks=6, watermark=0.0, max_num_seqs=4, max_num_batched_tokens=9)
    add(sched, "x", 4, max_tokens=6)
    add(sched, "y", 4, max_tokens=3)
    add(sched, "f", 5, max_tokens=2, n=2)
    steps = [run_step(sched)[0] for _ in range(4)]
    assert steps[2].stats.preempted == (("f", "recompute"),)
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in steps[3].chunks] == [
        (2, 0, 6), (3, 4, 2), (0, 6, 1)]
    assert steps[3].stats.batched_tokens == 9


def test_a_swapped_group_comes_back_when_the_budget_left_is_exactly_its_decodes():
    """Under Priority, s (two samples, the least urgent) goes to the CPU in step 3, when its
    samples need blocks; r finishes in that step. In step 4 q's last prompt chunk, 2 tokens,
    leaves 2 of the budget of 4: exactly s's two decodes, so s comes back in that step."""
    sched = make(num_blocks=5, num_cpu_blocks=16, watermark=0.0, max_num_seqs=4,
                 max_num_batched_tokens=4, preemption_mode="swap", policy=Priority())
    sched.add_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=4), priority=0)
    sched.add_request("s", [1, 2, 3, 4, 5], SamplingParams(n=2, max_tokens=12, seed=0), priority=2)
    steps = [run_step(sched)[0] for _ in range(2)]
    sched.add_request("q", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=4), priority=1)
    steps += [run_step(sched)[0] for _ in range(3)]
    assert steps[3].stats.preempted == (("s", "swap"),) and sched.unfinished.keys() == {"s", "q"}
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in steps[4].chunks] == [
        (2, 4, 2), (1, 5, 1), (3, 5, 1)]
    assert steps[4].swapped_in == [sched.unfinished["s"]]


def test_a_request_without_a_priority_ranks_as_priority_zero():
    """As in vLLM, a request that names no priority has priority 0 (lower runs first): it
    runs before an earlier one of priority 1."""
    sched = make(max_num_seqs=1, policy=Priority())
    sched.add_request("early", [1, 2, 3], SamplingParams(max_tokens=2), priority=1)
    sched.add_request("late", [4, 5, 6], SamplingParams(max_tokens=2))
    step, _ = run_step(sched)
    assert [g.request_id for g in step.groups] == ["late"]
