"""Tensor parallelism: the split is the same arithmetic (checked without processes), the
engine at N ranks gives N = 1's tokens, and a rank that dies or stalls fails the engine with
an error naming it, no process or port left behind."""

import os
import signal
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tiny import random_prompts, tiny_hf

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
