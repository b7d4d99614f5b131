"""The persistent batch writes only what changed in the block tables, and the engine's
outputs do not depend on it (the equivalence tests run through it)."""

from types import SimpleNamespace

from _tiny import random_prompts, tiny_hf

from pagedlab import LLM, SamplingParams
from pagedlab.engine.batch import PersistentBatch
from pagedlab.engine.step import Chunk
from pagedlab.model import from_hf


def chunks(tables: dict[int, list[int]]) -> list[Chunk]:
    return [Chunk(SimpleNamespace(seq_id=s), 0, 1, t, [0], True) for s, t in tables.items()]


def test_only_changed_entries_are_written():
    batch = PersistentBatch("cpu", rows=2, width=2)
    tables = {7: [4], 9: [5, 6]}
    rows = batch.update(chunks(tables))
    assert batch.entries_written == 3
    assert batch.gather(rows).tolist() == [[4, 0], [5, 6]]
    assert batch.update(chunks(tables)) == rows and batch.entries_written == 3  # unchanged
    tables[7] = [4, 8, 10]  # two blocks appended: the table widens
    batch.update(chunks(tables))
    assert batch.entries_written == 5 and batch.tables.shape[1] == 4
    tables[9] = [5, 11]  # copy-on-write replaced the last block: the row is rewritten
    batch.update(chunks(tables))
    assert batch.entries_written == 7
    assert batch.gather(rows).tolist() == [[4, 8, 10], [5, 11, 0]]


def test_a_sequence_that_leaves_gives_its_row_back():
    batch = PersistentBatch("cpu", rows=1, width=1)
    (first,) = batch.update(chunks({1: [3]}))
    (again,) = batch.update(chunks({2: [4]}))  # 1 left the batch: its row is 2's now
    assert again == first and batch.row_of == {2: first}
    rows = batch.update(chunks({2: [4], 1: [3]}))  # 1 is back: a new row, written whole
    assert batch.tables.shape[0] == 2 and batch.gather(rows).tolist() == [[4], [3]]
    assert batch.entries_written == 3


def test_the_engine_writes_each_block_id_once():
    """Without forks or preemption, a sequence's table only grows, so over a whole run the
    device receives each block id once: the tables' final sizes, summed."""
    hf = tiny_hf("llama-gqa-d64")
    llm = LLM(from_hf(hf), block_size=4, num_gpu_blocks=64, max_num_batched_tokens=8,
              max_num_seqs=4)  # prompts in chunks of 8 tokens: tables grow in prefill too
    prompts = random_prompts([5, 11, 3, 9], hf.config.vocab_size)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    cached = [len(p) + len(o.outputs[0].token_ids) - 1 for p, o in zip(prompts, outs)]
    assert llm.runner.batch.entries_written == sum(-(-n // 4) for n in cached)
    assert llm.stats.preemptions == 0


def test_padding_the_decodes_changes_no_token():
    """Decodes padded to fixed batch sizes (what CUDA graphs replay at) with dummy rows that
    write nowhere: every token the same as unpadded, the fp8 cache's path included."""
    hf = tiny_hf("qwen2-gqa-d64")
    model = from_hf(hf)
    prompts = random_prompts([5, 11, 3, 9, 6], hf.config.vocab_size, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True)
              for i in range(len(prompts))]  # the batch shrinks as they finish: 5, 4, ... 1
    for dtype in ("auto", "fp8"):
        plain = LLM(model, block_size=4, num_gpu_blocks=64, kv_cache_dtype=dtype)
        padded = LLM(model, block_size=4, num_gpu_blocks=64, kv_cache_dtype=dtype,
                     decode_batch_sizes=(2, 8))
        seen, prepare = [], padded.runner.prepare

        def spy(step):
            batch, *rows = prepare(step)
            seen.append(batch.seq_lens.numel())  # decode rows, padding included
            return batch, *rows

        padded.runner.prepare = spy
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in padded.generate(prompts, params, use_tqdm=False)]
        assert got == want, dtype
        assert set(seen) == {0, 2, 8}  # prefill-only steps, then batches of 2 or 8
