"""Decode steps through CUDA graphs' static buffers: on a CPU the captured function runs
eagerly on those buffers, so these tests check the buffers and the padding; on a GPU (-m gpu)
the replayed graph against the eager engine."""

import pytest
import torch
from _tiny import random_prompts, tiny_hf

from pagedlab import LLM, SamplingParams
from pagedlab.model import ForwardBatch, from_hf

PARAMS = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True) for i in range(5)]


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def graph_rows(llm) -> list[int]:
    """Record the rows of every step that runs through the graphs."""
    seen, run = [], llm.runner.graphs.run

    def spy(batch):
        seen.append(len(batch.seq_lens))
        return run(batch)

    llm.runner.graphs.run = spy
    return seen


def test_decode_graphs_change_no_token():
    """Five sequences finishing one by one (batch 5, 4, ... 1), padded to 2 or 8 rows: every
    decode-only step through the static buffers, each token as the plain engine's."""
    hf = tiny_hf("qwen2-gqa-d64")
    model = from_hf(hf)
    prompts = random_prompts([5, 11, 3, 9, 6], hf.config.vocab_size, seed=2)
    plain = LLM(model, block_size=4, num_gpu_blocks=64)
    graphed = LLM(model, block_size=4, num_gpu_blocks=64, decode_batch_sizes=(2, 8),
                  cuda_graphs=True)
    seen = graph_rows(graphed)
    assert tokens(graphed, prompts) == tokens(plain, prompts)
    # one prefill step samples every first token; then every step decodes, 8 rows while
    # 3-5 sequences remain, 2 after, until the longest has its max_tokens
    assert len(seen) == max(p.max_tokens for p in PARAMS) - 1 and set(seen) == {2, 8}


def test_default_sizes_stop_at_max_num_seqs_and_bad_batches_are_refused():
    hf = tiny_hf("llama-gqa-d64")
    llm = LLM(from_hf(hf), block_size=4, num_gpu_blocks=32, max_num_seqs=6, cuda_graphs=True,
              max_model_len=40)
    graphs = llm.runner.graphs
    assert graphs.sizes == llm.runner.decode_batch_sizes == (1, 2, 4, 6)
    assert graphs.block_tables.shape == (6, 10)  # 40 tokens: 10 blocks of 4

    def batch(rows, width):
        ids = torch.zeros(rows, dtype=torch.int64)
        return ForwardBatch(ids, ids, ids, [], torch.zeros(rows, width, dtype=torch.int32),
                            torch.ones(rows, dtype=torch.int32))

    with pytest.raises(ValueError, match=r"3 rows cannot replay: the sizes captured are "
                                         r"\(1, 2, 4, 6\)"):
        graphs.run(batch(3, 2))
    with pytest.raises(ValueError, match="11 blocks is wider than the 10 captured"):
        graphs.run(batch(2, 11))
    with pytest.raises(ValueError, match="cuda_graphs='yes' must be a bool"):
        LLM(from_hf(hf), block_size=4, num_gpu_blocks=32, cuda_graphs="yes")


@pytest.mark.gpu
def test_replayed_graphs_match_the_eager_engine_on_a_gpu():
    hf = tiny_hf("llama-gqa-d64").to("cuda")
    model = from_hf(hf)
    prompts = random_prompts([5, 11, 3, 9, 6], hf.config.vocab_size, seed=4)
    eager = LLM(model, block_size=16, num_gpu_blocks=64, decode_batch_sizes=(2, 8))
    graphed = LLM(model, block_size=16, num_gpu_blocks=64, decode_batch_sizes=(2, 8),
                  cuda_graphs=True)
    assert sorted(graphed.runner.graphs.graphs) == [2, 8]  # captured
    assert tokens(graphed, prompts) == tokens(eager, prompts)
