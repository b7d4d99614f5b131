"""Tensor parallelism: the split is the same arithmetic (checked without processes), the
engine at N ranks gives N = 1's tokens, and a rank that dies or stalls fails the engine with
an error naming it, no process or port left behind. The same holds for workers started apart
by their own command (as on other machines), meeting rank 0 through torch.distributed's
environment variables on the loopback address, and a wrong variable is named."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tiny import random_prompts, tiny_hf

import pagedlab
from pagedlab import LLM, SamplingParams
from pagedlab.engine import tensor_parallel
from pagedlab.engine.tensor_parallel import WorkerFailed, shard_args, shard_state_dict
from pagedlab.model import from_hf

SHAPE = dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=3,
             intermediate_size=384)  # 3 ranks: 2 query heads, 1 KV head, 128 MLP columns each
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def model():
    return from_hf(tiny_hf("llama-gqa-d64", **SHAPE))


@pytest.mark.parametrize("world", [1, 3])
def test_the_shards_partial_products_add_up_to_the_whole_layer(model, world):
    """Per layer, with no process: the ranks' column-parallel products, each rank's heads
    attended alone, and their row-parallel partial products summed (what the all-reduce
    adds) equal the whole layer's o and down outputs."""
    args, state = model.args, model.state_dict()
    shards = [shard_state_dict(state, args, r, world) for r in range(world)]
    part = shard_args(args, world)
    x = torch.randn(5, args.hidden_size)
    layer = "model.layers.1."
    d, g = args.head_dim, args.num_heads // args.num_kv_heads

    def attention(weights, heads, kv_heads):  # causal attention, no cache: the math alone
        qkv = (x @ weights[layer + "self_attn.qkv_proj.weight"].T).view(5, -1, d)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1).reshape(5, -1) @ weights[layer + "self_attn.o_proj.weight"].T

    def mlp(weights):
        w = {n: weights[layer + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")}
        return (F.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T

    def close(summed, whole):  # fp32 sums in another order: equal to rounding
        torch.testing.assert_close(summed, whole, rtol=0, atol=1e-5 * float(whole.abs().max()))

    close(sum(attention(s, part.num_heads, part.num_kv_heads) for s in shards),
          attention(state, args.num_heads, args.num_kv_heads))
    close(sum(mlp(s) for s in shards), mlp(state))
    for s in shards:  # replicated: the embedding, the norms and the head
        assert s["lm_head.weight"] is state["lm_head.weight"]


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_process_starts(model):
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the model's "
                                         "num_kv_heads=3"):
        LLM(model, block_size=4, num_gpu_blocks=8, tensor_parallel_size=2)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        LLM(model, block_size=4, num_gpu_blocks=8, tensor_parallel_size=0)


@pytest.mark.slow
def test_three_ranks_give_one_ranks_tokens(model):
    """Greedy and seeded sampled outputs at tensor parallelism 3 equal those at 1, with chunked
    prefill (a budget of 16 tokens), prefix caching (shared prompt starts), preemption (a pool
    too small for all four requests at once) and n-gram speculation on."""
    base = random_prompts([5, 27, 9, 33], 192)
    prompts = [base[1][:12] + p for p in base]  # a shared start for the prefix cache
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=s) for s in range(4)]
    engine = dict(block_size=4, num_gpu_blocks=30, max_num_batched_tokens=16, max_num_seqs=4,
                  enable_prefix_caching=True,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})

    def run(llm):
        greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        preempted = sum(len(s.preempted) for s in llm.stats.steps)
        seeded = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled, use_tqdm=False)]
        return greedy, seeded, preempted

    one = run(LLM(model, **engine))
    with LLM(model, tensor_parallel_size=3, **engine) as llm:
        three = run(llm)
        assert llm.runner.kv_caches[0][0].shape[2] == 1  # rank 0 holds one KV head of 3
    assert three[:2] == one[:2]
    assert one[2] > 0 and llm.scheduler.spec_stats.num_draft_tokens > 0
    assert not dist.is_initialized()


@pytest.mark.slow
def test_an_engine_idle_longer_than_the_timeout_still_runs_the_next_request(model, monkeypatch):
    """An idle engine (a server with no requests) sends its workers no step. They wait for the
    next one past the all-reduces' timeout (10 s here) and still give one rank's tokens."""
    monkeypatch.setattr(tensor_parallel, "DEFAULT_TIMEOUT", 10.0)
    prompts = random_prompts([6, 9], 192)
    one = [o.outputs[0].token_ids for o in
           LLM(model, block_size=4, num_gpu_blocks=32).generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(model, block_size=4, num_gpu_blocks=32, tensor_parallel_size=3) as llm:
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        time.sleep(13)
        three = [o.outputs[0].token_ids
                 for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert three == one


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_a_rank_that_dies_or_stalls_fails_the_engine_by_name(model, monkeypatch, how):
    """Kill rank 2 (SIGKILL) or stop it (SIGSTOP, a hang) between steps: the next step raises
    WorkerFailed naming rank 2 within the timeout; the requests in flight are aborted, every
    worker has ended, the group is gone and the rendezvous port is free again."""
    monkeypatch.setattr(tensor_parallel, "DEFAULT_TIMEOUT", 10.0)
    llm = LLM(model, block_size=4, num_gpu_blocks=32, tensor_parallel_size=3)
    executor = llm.executor
    for i, prompt in enumerate(random_prompts([6, 9], 192)):
        llm.add_request(str(i), prompt, GREEDY)
    llm.step()
    victim = executor.workers[1]  # rank 2
    os.kill(victim.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    expected = "rank 2 died" if how == "killed" else "rank 2 did not take step 2"
    with pytest.raises(WorkerFailed, match=expected):
        llm.step()
    assert not llm.has_unfinished_requests() and llm.manager.num_used_blocks == 0
    assert all(w.exitcode is not None for w in executor.workers)
    assert not dist.is_initialized() and port_is_free(executor.port)
    with pytest.raises(WorkerFailed, match="shut down"):
        llm.generate(random_prompts([4], 192), GREEDY, use_tqdm=False)
    llm.shutdown()  # again: nothing left to do


def test_measure_allreduce_times_each_size_on_processes_of_its_own():
    """Chapter 14's microbenchmark: rank 0's seconds per all-reduce, every size and repeat,
    with no group left in this process."""
    times = tensor_parallel.measure_allreduce(2, [1024, 65536], repeats=3, timeout=60)
    assert sorted(times) == [1024, 65536]
    assert all(len(t) == 3 and all(0 < s < 60 for s in t) for t in times.values())
    assert not dist.is_initialized()


# --- workers started apart: torch.distributed's environment rendezvous --------------------

PACKAGE_ROOT = str(Path(pagedlab.__file__).resolve().parents[1])  # this checkout, for workers


def rendezvous(port: int, rank: int, world: int = 3) -> dict[str, str]:
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                RANK=str(rank))


def nothing_listens_on(port: int) -> bool:
    """A new server could listen on ``port`` (connections closing may still hold it in
    TIME_WAIT, which a listening server is allowed to reuse)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


@pytest.fixture
def apart(monkeypatch):
    """Start workers as another machine would, by their own command and environment; this
    process is rank 0. Every worker is killed at the end if a test left one running."""
    port = tensor_parallel._free_port()
    monkeypatch.setattr(tensor_parallel, "DEFAULT_TIMEOUT", 20.0)
    started = []

    def start(rank: int, world: int = 3) -> subprocess.Popen:
        path = os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, **rendezvous(port, rank, world), PYTHONPATH=path)
        proc = subprocess.Popen([sys.executable, "-m", "pagedlab.engine.tensor_parallel"],
                                env=env, stderr=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    for name, value in rendezvous(port, 0).items():
        monkeypatch.setenv(name, value)
    start.port = port
    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def ended(proc: subprocess.Popen, within: float = 60) -> tuple[int, str]:
    _, err = proc.communicate(timeout=within)
    return proc.returncode, err


@pytest.mark.slow
def test_workers_started_apart_give_one_ranks_tokens_and_leave_when_it_ends(model, apart):
    """Ranks 1 and 2 started by their own command with MASTER_ADDR, MASTER_PORT, WORLD_SIZE
    and RANK, rank 0 built with distributed_init_method='env://': greedy tokens equal the
    one-process engine's, with chunked prefill; at shutdown every worker exits cleanly, the
    group is gone and nothing listens on MASTER_PORT."""
    prompts = random_prompts([5, 27, 9, 33], 192)
    engine = dict(block_size=4, num_gpu_blocks=40, max_num_batched_tokens=16, max_num_seqs=4)
    one = [o.outputs[0].token_ids
           for o in LLM(model, **engine).generate(prompts, GREEDY, use_tqdm=False)]
    workers = [apart(rank) for rank in (1, 2)]
    with LLM(model, tensor_parallel_size=3, distributed_init_method="env://", **engine) as llm:
        three = [o.outputs[0].token_ids
                 for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.runner.kv_caches[0][0].shape[2] == 1  # rank 0 holds one KV head of 3
        executor = llm.executor  # each worker counted every step (what names a stalled one)
        assert executor.progress[1] == executor.progress[2] == executor.num_steps > 0
    assert three == one
    assert [ended(w)[0] for w in workers] == [0, 0]
    assert not dist.is_initialized() and nothing_listens_on(apart.port)


@pytest.mark.slow
def test_a_worker_started_apart_that_dies_is_named_and_the_others_end(model, apart):
    """SIGKILL rank 2 between steps: the next step fails naming it, within the engine's
    timeout (no exit code to read: the rank is on another machine as far as the engine
    knows, so it is named as one that did not take the step); rank 1, on its own machine as far as the engine knows, ends by itself, and
    nothing listens on MASTER_PORT even while the error is held."""
    workers = [apart(rank) for rank in (1, 2)]
    llm = LLM(model, block_size=4, num_gpu_blocks=32, tensor_parallel_size=3,
              distributed_init_method="env://")
    for i, prompt in enumerate(random_prompts([6, 9], 192)):
        llm.add_request(str(i), prompt, GREEDY)
    llm.step()
    workers[1].kill()
    with pytest.raises(WorkerFailed, match="rank 2 did not take step 2"):
        llm.step()  # (rank 1 may be named too: rank 0 cannot tell whether it got the step)
    code, err = ended(workers[0])
    assert code == 1 and "pagedlab worker rank 1: the group at 127.0.0.1" in err
    assert not dist.is_initialized() and nothing_listens_on(apart.port)  # error still held
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # a group formed since (another engine's) outlives this engine's second shutdown
        llm.shutdown()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_worker_with_another_world_size_is_refused_and_named(model, apart, monkeypatch):
    """Rank 2 says WORLD_SIZE=4 to an engine of 3: it exits naming WORLD_SIZE, the engine
    fails naming the rank that never joined, and rank 1 ends too."""
    monkeypatch.setattr(tensor_parallel, "DEFAULT_TIMEOUT", 8.0)
    good, wrong = apart(1), apart(2, world=4)
    with pytest.raises(WorkerFailed, match="rank 2 did not join"):
        LLM(model, block_size=4, num_gpu_blocks=32, tensor_parallel_size=3,
            distributed_init_method="env://")
    code, err = ended(wrong)
    assert code == 1 and "WORLD_SIZE=4 but the engine at 127.0.0.1" in err
    assert "tensor_parallel_size=3" in err
    assert ended(good)[0] == 1
    assert not dist.is_initialized() and nothing_listens_on(apart.port)


@pytest.mark.parametrize("change, named", [
    (dict(MASTER_PORT=None), "set MASTER_PORT"),
    (dict(MASTER_ADDR=None, RANK=None), "set MASTER_ADDR, RANK"),
    (dict(MASTER_PORT="29x"), "MASTER_PORT='29x' is not an integer"),
    (dict(MASTER_PORT="70000"), "MASTER_PORT=70000"),
    (dict(WORLD_SIZE="1"), "WORLD_SIZE=1"),
    (dict(RANK="3"), "RANK=3: ranks are 0 to WORLD_SIZE - 1 = 2"),
])
def test_a_missing_or_malformed_variable_is_named(change, named):
    env = {k: v for k, v in {**rendezvous(29500, 1), **change}.items() if v is not None}
    with pytest.raises(ValueError, match=re.escape(named)):
        tensor_parallel.env_rendezvous(env)


def test_the_engine_refuses_a_rendezvous_it_cannot_be_rank_0_of(model, monkeypatch):
    """Before it listens: RANK must be 0 and WORLD_SIZE the tensor-parallel size; nothing is
    left listening and no group is formed."""
    port = tensor_parallel._free_port()
    for (name, value), named in [(("RANK", "1"), "RANK=1: the engine is rank 0"),
                                 (("WORLD_SIZE", "2"),
                                  "WORLD_SIZE=2 but tensor_parallel_size=3"),
                                 (("MASTER_ADDR", ""), "set MASTER_ADDR")]:
        for k, v in {**rendezvous(port, 0), name: value}.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(ValueError, match=re.escape(named)):
            LLM(model, block_size=4, num_gpu_blocks=8, tensor_parallel_size=3,
                distributed_init_method="env://")
        assert not dist.is_initialized() and nothing_listens_on(port)
    with pytest.raises(ValueError, match="'tcp://127.0.0.1:1'"):
        LLM(model, block_size=4, num_gpu_blocks=8, tensor_parallel_size=3,
            distributed_init_method="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="needs tensor_parallel_size > 1"):
        LLM(model, block_size=4, num_gpu_blocks=8, distributed_init_method="env://")
    assert not dist.is_initialized()


def test_a_worker_refuses_rank_0_and_an_address_where_no_engine_answers(monkeypatch, capsys):
    """The worker's command says what is wrong and exits 1: rank 0 is the engine's, and no
    engine listening at MASTER_ADDR:MASTER_PORT is named within the timeout."""
    port = tensor_parallel._free_port()
    assert tensor_parallel.main([], rendezvous(port, 0)) == 1
    assert "RANK=0 is the engine's" in capsys.readouterr().err
    monkeypatch.setattr(tensor_parallel, "DEFAULT_TIMEOUT", 1.0)
    assert tensor_parallel.main([], rendezvous(port, 1)) == 1
    assert (f"no pagedlab engine answered at MASTER_ADDR=127.0.0.1 MASTER_PORT={port} "
            "within 1 s") in capsys.readouterr().err
    assert not dist.is_initialized()


def test_the_server_passes_its_rendezvous_flag_to_the_engine(monkeypatch):
    """``python -m pagedlab.serve --distributed-init-method env://`` builds rank 0 of a group
    whose workers are started apart; any other method is refused by the parser."""
    from pagedlab import serve

    built = {}
    monkeypatch.setattr(serve, "LLM", lambda model, **kwargs: built.update(kwargs))
    serve.engine(serve.parser().parse_args(["--model", "m", "--tensor-parallel-size", "3",
                                            "--distributed-init-method", "env://"]))
    assert built["tensor_parallel_size"] == 3 and built["distributed_init_method"] == "env://"
    serve.engine(serve.parser().parse_args(["--model", "m"]))
    assert built["distributed_init_method"] is None  # the engine starts its own workers
    with pytest.raises(SystemExit):
        serve.parser().parse_args(["--distributed-init-method", "tcp://10.0.0.1:29500"])
