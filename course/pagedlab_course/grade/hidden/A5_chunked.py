"""Hidden checks of A5.5 (chunked prefill): the student's steps beside a reference scheduler on
seeded workloads, and the situations a chunked step must get right, each worked out by hand."""

import random

from pagedlab_course.grade import task
from pagedlab_course.grade.checks import a5_next_token, expect
from pagedlab.memory import KVCacheManager


class Reference:
    """The step A5.5 specifies (vLLM V1's token budget, running requests first, prompts in
    chunks), over a KVCacheManager of its own. Requests are named by id; a step is summarised as
    (decodes, prefills, preempted) with each chunk as (rid, start, num_tokens)."""

    def __init__(self, next_token, num_blocks, block_size, budget, seats, watermark=0.0, prefix_caching=False):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.next_token, self.budget, self.seats = next_token, budget, seats
        self.keep = int(watermark * num_blocks)
        self.tokens, self.max_tokens, self.arrival, self.outputs, self.finish = {}, {}, {}, {}, {}
        self.waiting, self.running = [], []
        self.steps = 0

    def add(self, rid, prompt, max_tokens):
        self.tokens[rid], self.max_tokens[rid], self.outputs[rid] = list(prompt), max_tokens, 0
        self.arrival[rid] = len(self.arrival)
        self.waiting.append(rid)

    def _blocks(self, n):
        return -(-n // self.kv.block_size)

    def _hit(self, tokens):
        """Cached leading tokens (whole blocks, one token always left) and how many are parked."""
        cache, bs = self.kv.prefix_cache, self.kv.block_size
        if cache is None:
            return 0, 0
        keys = []
        chunks = cache.extend_keys(keys, tokens)
        blocks = cache.match(keys, chunks, (len(tokens) - 1) // bs)
        return bs * len(blocks), sum(self.kv.gpu.refcount(b) == 0 for b in blocks)

    def _recompute(self, rid):
        self.kv.free(rid)
        self.waiting.insert(0, rid)
        return rid, "recompute"

    def step(self):
        """Form one step, run the made-up model on it; return its summary."""
        kv, budget = self.kv, self.budget
        todo = {rid: len(self.tokens[rid]) - kv.num_tokens(rid) for rid in self.running}
        queue = list(self.running)  # by arrival: decodes, then the one prompt part-way through
        decodes, prefills, preempted, stay = [], [], [], []
        while queue:
            rid = queue.pop(0)
            if budget == 0:
                stay.append(rid)
                continue
            start = kv.num_tokens(rid)
            n = min(todo[rid], budget)
            need = self._blocks(start + n) - self._blocks(start)
            while queue and need > kv.num_free_blocks:
                preempted.append(self._recompute(queue.pop()))
            if need > kv.num_free_blocks:
                if not decodes and not prefills:
                    raise RuntimeError(f"reference: {rid!r} cannot grow alone")
                preempted.append(self._recompute(rid))
                continue
            kv.append(rid, self.tokens[rid][start : start + n])
            stay.append(rid)
            (decodes if todo[rid] == 1 else prefills).append((rid, start, n))
            budget -= n
        self.running = stay
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.seats:
            rid = self.waiting[0]
            start, parked = self._hit(self.tokens[rid])
            n = min(len(self.tokens[rid]) - start, budget)
            if self._blocks(start + n) - start // kv.block_size + parked > kv.num_free_blocks - self.keep:
                break
            self.waiting.pop(0)
            kv.allocate(rid, self.tokens[rid][: start + n])
            self.running.append(rid)
            prefills.append((rid, start, n))
            budget -= n
        self.running.sort(key=self.arrival.get)
        self.sampled = sorted(rid for rid, start, n in decodes + prefills if start + n == len(self.tokens[rid]))
        for rid in self.sampled:
            self.tokens[rid].append(self.next_token(self.tokens[rid]))
            self.outputs[rid] += 1
            if self.outputs[rid] == self.max_tokens[rid]:
                self.finish[rid] = self.steps
                kv.free(rid)
                self.running.remove(rid)
        self.steps += 1
        return decodes, prefills, preempted

    @property
    def has_unfinished(self):
        return bool(self.waiting or self.running)


def _summary(step):
    return ([(c.req.rid, c.start, c.num_tokens) for c in step.decodes],
            [(c.req.rid, c.start, c.num_tokens) for c in step.prefills],
            [tuple(p) for p in step.preempted])


def _side_by_side(nb, label, arrivals, num_blocks, block_size, budget, seats, watermark=0.0, prefix_caching=False,
                  expected_steps=None):
    """Run the student's scheduler and the reference on the same arrivals ({step: [(rid, prompt,
    max_tokens)]}), step by step; compare every step, the free blocks, outputs and finish steps.
    ``expected_steps``, worked out by hand, pins the first steps' summaries."""
    sched = nb.MiniScheduler(KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching),
                             max_num_seqs=seats, max_num_batched_tokens=budget, watermark=watermark)
    manager = sched.manager  # the scheduler's copy of the manager, in the submission's process
    ref = Reference(a5_next_token, num_blocks, block_size, budget, seats, watermark, prefix_caching)
    requests = {}
    last = max(arrivals)
    while sched.num_steps <= last or sched.has_unfinished or ref.has_unfinished:
        index = sched.num_steps
        for rid, prompt, max_tokens in arrivals.get(index, ()):
            ref.add(rid, prompt, max_tokens)
            requests[rid] = sched.add(rid, list(prompt), max_tokens)
        theirs = ref.step()
        step = sched.schedule_chunked()
        ours = _summary(step)
        what = "(decodes, prefills, preempted), each chunk as (rid, start, num_tokens)"
        if expected_steps and index < len(expected_steps):
            expect(index, f"{label}: schedule_chunked()", what + ", worked out by hand", expected_steps[index], ours)
        expect(index, f"{label}: schedule_chunked()", what, theirs, ours)
        sampled = sorted(r.rid for r in step.batch)
        sched.update(step)
        expect(index, f"{label}: after update", "free blocks", ref.kv.num_free_blocks, manager.num_free_blocks)
        expect(index, f"{label}: after update", "requests that sampled a token", ref.sampled, sampled)
        if index > 10 * (last + 1) + 500:
            raise AssertionError(f"{label}: more than {index} steps; the reference finished in {ref.steps}")
    expect(sched.num_steps, f"{label}: served to the end", "outputs",
           {rid: ref.tokens[rid][len(r.prompt):] for rid, r in requests.items()},
           {rid: r.output for rid, r in requests.items()})
    expect(sched.num_steps, f"{label}: served to the end", "finish steps", ref.finish,
           {rid: r.finish_step for rid, r in requests.items()})
    manager.check_invariants()
    expect(sched.num_steps, f"{label}: served to the end", "blocks still used", 0, manager.num_used_blocks)


def _prompt(i, n):
    return list(range(100 * i, 100 * i + n))


@task("A5.5")
def check_budget_used_up_by_decodes(nb):
    """Five requests decoding under a budget of 3 tokens: the three oldest decode, the other two
    keep their blocks and wait, and the waiting request is not admitted."""
    arrivals = {0: [(f"r{i}", _prompt(i, 1), 3) for i in range(5)]}
    by_hand = [
        ([], [(f"r{i}", 0, 1) for i in range(3)], []),  # budget 3: three one-token prompts
        ([(f"r{i}", 1, 1) for i in range(3)], [], []),  # their decodes use it all: r3, r4 wait
        ([(f"r{i}", 2, 1) for i in range(3)], [], []),  # and finish
        ([], [("r3", 0, 1), ("r4", 0, 1)], []),
    ]
    _side_by_side(nb, "budget 3, five requests", arrivals, 32, 4, budget=3, seats=8, expected_steps=by_hand)
    arrivals = {0: [(f"r{i}", _prompt(i, 2), 4) for i in range(5)], 2: [("r5", _prompt(5, 2), 2)]}
    by_hand = [
        ([], [(f"r{i}", 0, 2) for i in range(5)], []),  # budget 10: all five whole
        ([(f"r{i}", 2, 1) for i in range(3)], [], []),  # budget 3: r3 and r4 sit out
        ([(f"r{i}", 3, 1) for i in range(3)], [], []),  # r5 arrives and waits
    ]
    sched = nb.MiniScheduler(KVCacheManager(32, 4), max_num_seqs=8, max_num_batched_tokens=10)
    manager = sched.manager
    for rid, prompt, max_tokens in arrivals[0]:
        sched.add(rid, prompt, max_tokens)
    for index, expected in enumerate(by_hand):
        if index == 1:
            sched.max_num_batched_tokens = 3
        if index == 2:
            sched.add("r5", _prompt(5, 2), 2)
        step = sched.schedule_chunked()
        expect(index, "budget 10, then 3: schedule_chunked()", "(decodes, prefills, preempted)", expected, _summary(step))
        sched.update(step)
    expect(3, "the same run", "tokens in the cache of r0..r4 (r3 and r4 untouched since step 0)",
           [4, 4, 4, 2, 2], [manager.num_tokens(f"r{i}") for i in range(5)])
    expect(3, "the same run", "running, waiting", (["r0", "r1", "r2", "r3", "r4"], ["r5"]),
           ([r.rid for r in sched.running], [r.rid for r in sched.waiting]))


@task("A5.5")
def check_long_prompt_over_several_steps(nb):
    """A 37-token prompt under a budget of 8 (blocks of 4): chunks of 8, 8, 8, 8 and 5 tokens,
    blocks taken for each chunk only, one sample, after the last chunk; a short request behind
    it starts in the budget its last chunk leaves."""
    arrivals = {0: [("long", _prompt(0, 37), 2), ("short", _prompt(1, 2), 2)]}
    by_hand = [([], [("long", 8 * i, 8)], []) for i in range(4)]
    by_hand.append(([], [("long", 32, 5), ("short", 0, 2)], []))
    by_hand.append(([("long", 37, 1), ("short", 2, 1)], [], []))
    _side_by_side(nb, "a 37-token prompt, budget 8", arrivals, 16, 4, budget=8, seats=4, expected_steps=by_hand)
    sched = nb.MiniScheduler(KVCacheManager(16, 4), max_num_seqs=4, max_num_batched_tokens=8)
    manager = sched.manager
    long = sched.add("long", _prompt(0, 37), 2)
    blocks, outputs = [], []
    for _ in range(5):
        step = sched.schedule_chunked()
        blocks.append(len(manager.block_table("long")))
        sched.update(step)
        outputs.append(len(long.output))
    expect(5, "five steps of the 37-token prompt", "its blocks after each step", [2, 4, 6, 8, 10], blocks)
    expect(5, "the same steps", "its outputs after each step", [0, 0, 0, 0, 1], outputs)


@task("A5.5")
def check_requests_sharing_a_step(nb):
    """A decode, a prompt finishing its prefill and a new prompt starting in one step; each
    samples only if its chunk reaches the end of its tokens."""
    arrivals = {0: [("r0", _prompt(0, 5), 3), ("r1", _prompt(1, 9), 3)], 1: [("r2", _prompt(2, 7), 3)]}
    by_hand = [
        ([], [("r0", 0, 5), ("r1", 0, 5)], []),  # budget 10: r0 whole, r1's first 5
        ([("r0", 5, 1)], [("r1", 5, 4), ("r2", 0, 5)], []),  # r1 finishes its prompt, r2 starts
        ([("r0", 6, 1), ("r1", 9, 1)], [("r2", 5, 2)], []),  # r1 now decodes what step 1 sampled
        ([("r1", 10, 1), ("r2", 7, 1)], [], []),  # r0 finished in step 2
    ]
    _side_by_side(nb, "three requests sharing steps", arrivals, 16, 4, budget=10, seats=4, expected_steps=by_hand)


@task("A5.5")
def check_out_of_blocks(nb):
    """Blocks run out: a decode preempts the prompt being prefilled behind it (latest arrival
    first, nothing admitted in that step); a new prompt whose chunk does not fit waits, and
    everyone behind it too; the watermark is kept from new chunks."""
    # 6 blocks of 4. Step 0: r0 whole (8 tokens, 2 blocks), r1's first 8 tokens (2 blocks).
    # Step 1: r0's decode takes a third block; r1's other 12 tokens need 3 more: r1 gives way.
    arrivals = {0: [("r0", _prompt(0, 8), 6), ("r1", _prompt(1, 20), 2), ("r2", _prompt(2, 1), 2)]}
    by_hand = [
        ([], [("r0", 0, 8), ("r1", 0, 8)], []),
        ([("r0", 8, 1)], [], [("r1", "recompute")]),
        ([("r0", 9, 1)], [], []),  # r1 would need 4 blocks for 15 tokens; 3 are free: r2 waits too
    ]
    _side_by_side(nb, "6 blocks, budget 16", arrivals, 6, 4, budget=16, seats=4, expected_steps=by_hand)
    # Two decodes and a prompt part-way through its prefill, in 5 blocks: a decode's next block
    # is taken back from the prompt, the latest arrival.
    arrivals = {0: [("a", _prompt(0, 4), 4), ("b", _prompt(1, 3), 4)], 1: [("c", _prompt(2, 12), 2)]}
    by_hand = [
        ([], [("a", 0, 4), ("b", 0, 3)], []),
        ([("a", 4, 1), ("b", 3, 1)], [("c", 0, 5)], []),  # a 2 blocks, b 1, c 2: none free
        ([("a", 5, 1), ("b", 4, 1)], [], [("c", "recompute")]),  # b needs a block: c gives way
    ]
    _side_by_side(nb, "5 blocks, budget 7", arrivals, 5, 4, budget=7, seats=4, expected_steps=by_hand)
    # The watermark: 10 blocks, 3 kept. After its first decode r0 holds 5; r1's first chunk
    # (15 tokens) needs 4 blocks, and only 2 of the 5 free are above the watermark.
    arrivals = {0: [("r0", _prompt(0, 16), 2), ("r1", _prompt(1, 16), 2)]}
    by_hand = [([], [("r0", 0, 16)], []), ([("r0", 16, 1)], [], [])]
    _side_by_side(nb, "10 blocks, watermark 30%, budget 16", arrivals, 10, 4, budget=16, seats=4, watermark=0.3,
                  expected_steps=by_hand)


@task("A5.5")
def check_prefix_hits(nb):
    """A prompt whose first blocks are cached starts after them; a hit on parked blocks (their
    request finished) costs free blocks to take back, so a tight pool makes the next request wait."""
    shared = _prompt(9, 8)
    arrivals = {0: [("r0", shared + [1, 2, 3], 1)], 1: [("r1", shared + [4, 5], 2)], 2: [("r2", shared, 1)]}
    by_hand = [
        ([], [("r0", 0, 11)], []),  # r0 samples its one token and finishes: its 2 full blocks park
        ([], [("r1", 8, 2)], []),  # r1 hits both
        ([("r1", 10, 1)], [("r2", 4, 4)], []),  # r2 is all cached but its last token: one block hit
    ]
    _side_by_side(nb, "prefix hits, 8 blocks", arrivals, 8, 4, budget=16, seats=4, prefix_caching=True,
                  expected_steps=by_hand)
    # 4 blocks. r0 (8 tokens) finishes at once, parking 2 cached blocks; "x" holds 1 block; r1
    # (the 8 cached tokens and 6 more) needs 2 fresh blocks and its 2 parked hits back: 4 > 3.
    arrivals = {0: [("r0", shared, 1), ("x", _prompt(1, 2), 3)], 1: [("r1", shared + _prompt(2, 6), 1)]}
    by_hand = [([], [("r0", 0, 8), ("x", 0, 2)], []), ([("x", 2, 1)], [], []), ([("x", 3, 1)], [], [])]
    _side_by_side(nb, "a hit on parked blocks, 4 blocks", arrivals, 4, 4, budget=16, seats=4, prefix_caching=True,
                  expected_steps=by_hand)


@task("A5.5")
def check_seeded_workloads_beside_the_reference(nb):
    """Sixteen seeded workloads with arrivals over time, step by step beside the reference:
    budgets from 1 token to more than a prompt, tight pools, seat caps, watermarks, prefix caching."""
    for seed in range(16):
        rng = random.Random(700 + seed)
        bs = rng.choice([2, 4])
        system = [rng.randrange(1000) for _ in range(rng.choice([0, bs, 2 * bs]))]
        arrivals = {}
        for i in range(rng.randint(3, 9)):
            prompt = (system if rng.random() < 0.5 else []) + [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
            arrivals.setdefault(rng.randint(0, 6), []).append((f"q{i}", prompt, rng.randint(1, 8)))
        longest = max(len(p) + m for reqs in arrivals.values() for _, p, m in reqs)
        num_blocks = -(-longest // bs) + rng.randint(0, 4)
        config = dict(budget=rng.choice([1, 3, 8, 16, 64]), seats=rng.randint(1, 5),
                      watermark=rng.choice([0.0, 0.1]), prefix_caching=rng.random() < 0.5)
        _side_by_side(nb, f"seed {seed}, {num_blocks} blocks of {bs}, {config}", arrivals, num_blocks, bs, **config)
