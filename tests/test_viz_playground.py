"""The KV-cache playground: its buttons drive a real KVCacheManager exactly as direct calls
would, a refused operation shows the manager's message and changes nothing, and the HTML book
gets a player where no kernel runs."""

import random

import pytest
import yaml

from pagedlab.memory import KVCacheManager
from pagedlab.viz.block_replay import history
from pagedlab.viz.playground import SHARED_PROMPT, KVPlayground

pytest.importorskip("ipywidgets")


class Direct:
    """The same operations as plain manager calls, tokens numbered as the playground's are: the
    reference the playground is held to."""

    def __init__(self, **config):
        self.mgr = KVCacheManager(config["num_blocks"], config["block_size"],
                                  config["num_cpu_blocks"], config["prefix_caching"])
        self.fresh = 1000

    def tokens(self, n):
        self.fresh += n
        return list(range(self.fresh - n, self.fresh))

    def run(self, op, *args):
        """The manager's own error message for a refused call, else None."""
        m = self.mgr
        calls = {"allocate": lambda s, n: m.allocate(s, self.tokens(n)),
                 "allocate_shared": lambda s, n: m.allocate(
                     s, [*SHARED_PROMPT, *self.tokens(max(0, n - len(SHARED_PROMPT)))]),
                 "append": lambda s, n: (m.append(s, self.tokens(n)), m.take_copies()),
                 "fork": m.fork, "free": m.free, "preempt": m.swap_out, "resume": m.swap_in}
        try:
            calls[op](*args)
        except Exception as refusal:  # noqa: BLE001 - whatever the manager says, it says
            return str(refusal)
        m.commit()
        return None


def state(mgr):
    snap = history(mgr)[-1] if mgr.events is not None else None
    running = {s: mgr.block_table(s) for s in mgr._running}
    swapped = {s: mgr.num_tokens(s) for s in mgr._swapped}
    return running, swapped, [mgr.gpu.refcount(b) for b in range(mgr.num_gpu_blocks)], (
        snap.summary() if snap else None)


def random_ops(rng, n):
    seqs = "ABCD"
    ops = []
    for _ in range(n):
        op = rng.choice(["allocate", "allocate_shared", "append", "append", "fork", "free",
                         "preempt", "resume"])
        if op in ("allocate", "allocate_shared", "append"):
            ops.append((op, rng.choice(seqs), rng.randint(1, 14)))
        elif op == "fork":
            ops.append((op, rng.choice(seqs), rng.choice(seqs)))
        else:
            ops.append((op, rng.choice(seqs)))
    return ops


@pytest.mark.parametrize("seed", range(6))
def test_operations_match_the_manager_called_directly(seed):
    config = dict(num_blocks=10, block_size=4, num_cpu_blocks=6, prefix_caching=seed % 2 == 0)
    play, direct = KVPlayground(**config), Direct(**config)
    refused = 0
    for op in random_ops(random.Random(seed), 60):
        before = state(play.mgr)
        ran = play.do(op[0], *op[1:])
        message = direct.run(op[0], *op[1:])
        assert ran == (message is None), (op, play.log[-1], message)
        if not ran:  # the manager's own words, and nothing changed
            refused += 1
            assert play.log[-1].endswith(message), (play.log[-1], message)
            assert state(play.mgr) == before, op
        assert state(play.mgr)[:3] == state(direct.mgr)[:3], op
    assert 5 < refused < 55  # the walk meets both outcomes


def test_buttons_drive_the_same_calls():
    play, direct = KVPlayground(), Direct(num_blocks=12, block_size=4, num_cpu_blocks=8,
                                          prefix_caching=True)
    view = play.widget()
    seq, child, tokens = view.children[0].children
    buttons = {b.description: b for row in view.children[1:3] for b in row.children}
    picture = view.children[3]

    def press(label, s=None, c=None, n=None, op=None, *args):
        seq.value, child.value = s or seq.value, c or child.value
        tokens.value = n or tokens.value
        buttons[label].click()
        if op:
            direct.run(op, *args)

    press("allocate", "A", None, 6, "allocate", "A", 6)
    press("fork", "A", "B", None, "fork", "A", "B")
    press("append", "B", None, 1, "append", "B", 1)  # B's last block is shared: copied
    assert "copied" in play.log[-1] and "copy" in history(play.mgr)[-2].caption
    assert "copy" in picture.value and 'marker-end="url(#arrow)"' in picture.value  # the copy
    press("free", "A", None, None, "free", "A")
    press("allocate, shared prompt", "C", None, 9, "allocate_shared", "C", 9)
    press("free", "C", None, None, "free", "C")
    press("allocate, shared prompt", "D", None, 10, "allocate_shared", "D", 10)
    assert "8 tokens served from the prefix cache" in play.log[-1]
    press("preempt (swap out)", "B", None, None, "preempt", "B")
    press("resume (swap in)", "B", None, None, "resume", "B")
    press("free", "Z", None, None, "free", "Z")  # refused
    assert play.log[-1].startswith("refused: free Z") and "Z" in view.children[4].value
    assert state(play.mgr)[:3] == state(direct.mgr)[:3]
    buttons["reset"].click()
    assert play.log == [] and play.mgr.num_used_blocks == 0


def test_a_bug_under_a_button_shows_in_the_log():
    """An exception that is no refusal is not swallowed: it goes in the log the reader sees
    (JupyterLab prints a callback's traceback only in its log console), then on to ipywidgets;
    the next button still works."""
    play = KVPlayground()
    view = play.widget()
    buttons = {b.description: b for row in view.children[1:3] for b in row.children}

    def broken(*args):
        raise RuntimeError("swap_in is broken")

    play.mgr.swap_in = broken
    buttons["resume (swap in)"].click()  # outside a kernel ipywidgets logs the traceback
    assert play.log[-1].startswith("error in resume (swap in)")
    assert play.log[-1].endswith("RuntimeError: swap_in is broken")
    assert "RuntimeError: swap_in is broken" in view.children[4].value
    buttons["allocate"].click()
    assert play.log[-1].startswith("allocate A") and "allocate A" in view.children[4].value


def test_the_book_shows_a_player_where_no_kernel_answers():
    play = KVPlayground()
    play.do("allocate", "A", 6)
    play.do("fork", "A", "B")
    bundle = play._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle  # live in Jupyter and Colab
    assert "pagedlab-player" in bundle["text/html"] and "Colab" in bundle["text/html"]
    assert bundle["text/plain"].startswith("allocate A")  # nbval and terminals read this
    config = yaml.safe_load(open("_config.yml"))["sphinx"]["config"]
    # the HTML builder skips the widget view (inert without a kernel) for the player
    assert ["html", "application/vnd.jupyter.widget-view+json", None] in [
        list(o) for o in config["nb_mime_priority_overrides"]]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_scheduler_playground_steps_as_the_scheduler_does(mode):
    """Seeded adds and steps, mirrored on a scheduler built and stepped as the scheduling
    tests do: the same queues after every step, the step's text saying who ran, who was
    preempted and how, within the token budget."""
    from scheduling import make, run_step

    from pagedlab import SamplingParams
    from pagedlab.viz.playground import SchedulerPlayground

    play = SchedulerPlayground(num_blocks=6, num_cpu_blocks=8, max_num_batched_tokens=12,
                               preemption_mode=mode)
    twin = make(num_blocks=6, block_size=4, num_cpu_blocks=8, max_num_batched_tokens=12,
                max_num_seqs=8, preemption_mode=mode, watermark=0.0)
    rng, fresh, preempted = random.Random(3), 1000, 0
    for i in range(60):
        if rng.random() < 0.35 or not twin.has_unfinished:
            prompt, out = rng.randint(4, 12), rng.randint(4, 12)
            assert play.do("add", f"r{i}", prompt, out)
            last, fresh = f"r{i}", fresh + prompt
            twin.add_request(f"r{i}", list(range(fresh - prompt, fresh)),
                             SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
            continue
        assert play.do("step")
        step, finished = run_step(twin)
        text = play.log[-1]
        used = sum(c.num_tokens for c in (*step.prefills, *step.decodes))
        assert f"{used} of 12 budget tokens" in text and used <= 12
        for group, how in step.preempted:
            preempted += 1
            assert f"preempted {group.request_id} by {how}" in text
        assert all(g.request_id in text.split("finished")[1] for g in finished)
        for name in ("running", "waiting", "swapped"):
            assert ([g.request_id for g in getattr(play.scheduler, name)]
                    == [g.request_id for g in getattr(twin, name)]), (name, text)
    assert preempted  # the walk runs out of blocks at least once
    if last in play.scheduler.unfinished:  # a request id in use: refused, nothing changed
        assert not play.do("add", last, 4, 2) and f"refused: add {last}" in play.log[-1]


@pytest.mark.parametrize("seed", range(4))
def test_the_speculation_playground_matches_the_manager_and_caches_no_proposal(seed):
    """Random prompts, speculations, verifications and frees against a manager called
    directly with the same tokens: the same block tables and prefix-cache contents after every
    operation; a refusal (verify before speculate, too many accepted, the pool full) changes
    nothing; and while proposals are unverified no block holding one is in the cache."""
    from pagedlab.viz.playground import SpeculationPlayground

    rng = random.Random(seed)
    play = SpeculationPlayground(num_blocks=10, block_size=4)
    mgr, fresh, proposed = KVCacheManager(10, 4, 0, True), 1000, {}
    refused = 0
    for _ in range(60):
        seq = rng.choice("ABC")
        op = rng.choice(["allocate", "speculate", "speculate", "verify", "verify", "free"])
        arg = rng.randint(0, 6) if op == "verify" else rng.randint(1, 9)
        args = (seq,) if op == "free" else (seq, arg)
        before = (play.log[:], state(play.mgr))
        ran = play.do(op, *args)
        if not ran:
            refused += 1
            assert state(play.mgr) == before[1] and play.log[-1].startswith("refused")
            continue
        if op == "allocate":
            mgr.allocate(seq, list(range(fresh, fresh + arg)))
            fresh += arg
        elif op == "speculate":
            mgr.append(seq, list(range(fresh, fresh + 1 + arg)), num_speculative=arg)
            fresh, proposed[seq] = fresh + 1 + arg, arg
        elif op == "verify":
            assert 0 <= arg <= proposed[seq]
            mgr.truncate(seq, mgr.num_tokens(seq) - proposed.pop(seq) + arg)
        else:
            mgr.free(seq)
            proposed.pop(seq, None)
        mgr.commit()
        assert {s: play.mgr.block_table(s) for s in play.mgr._running} == {
            s: mgr.block_table(s) for s in mgr._running}
        assert play.proposed == proposed
        cache = play.mgr.prefix_cache
        for s, k in proposed.items():  # a block holding a proposal is not in the cache
            first = (play.mgr.num_tokens(s) - k) // 4
            assert all(cache.tokens_of(b) is None for b in play.mgr.block_table(s)[first:])
    assert refused > 0


def test_verify_before_speculating_is_refused_with_the_reason():
    from pagedlab.viz.playground import SpeculationPlayground

    play = SpeculationPlayground()
    assert play.do("allocate", "A", 6)
    assert not play.do("verify", "A", 1)
    assert "no proposals to verify" in play.log[-1]
    assert play.do("speculate", "A", 4)
    assert not play.do("verify", "A", 5) and "must be in [0, 4]" in play.log[-1]
    assert len(play.mgr.block_table("A")) == 3  # 6 + 1 + 4 tokens in blocks of 4
    assert play.do("verify", "A", 1) and play.mgr.num_tokens("A") == 6 + 1 + 1
    assert len(play.mgr.block_table("A")) == 2  # the third block, emptied, went back
