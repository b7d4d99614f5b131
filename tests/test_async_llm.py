"""The engine online (AsyncLLM): streamed tokens equal generate's, requests that arrive while
others run share their steps, a consumer that leaves gives its blocks back, a bad request fails
alone, and the streamed deltas add up to the text without sending what may still change."""

import asyncio

import pytest
from _tiny import lose_device_at, random_prompts, tiny_hf, tiny_over_smollm2_tokenizer

from pagedlab import LLM, SamplingParams
from pagedlab.engine import InvalidPrompt
from pagedlab.engine.async_llm import AsyncLLM, _with_deltas
from pagedlab.engine.outputs import CompletionOutput, RequestOutput
from pagedlab.model import from_hf


@pytest.fixture(scope="module")
def model():
    return from_hf(tiny_hf("llama-gqa-d64"))


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_streams_match_generate_and_late_requests_join_the_batch(model):
    prompts = random_prompts([5, 9, 3, 12], model.args.vocab_size, seed=8)
    lengths = [12, 4, 9, 6]
    want = [o.outputs[0].token_ids for o in LLM(model, block_size=4, num_gpu_blocks=64)
            .generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)]
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    batch_sizes = []
    step = llm.step
    llm.step = lambda: (step(), batch_sizes.append(len(llm.last_step.decodes)))[0]

    async def main():
        engine = AsyncLLM(llm)
        started = [asyncio.Event() for _ in prompts]  # request i streams: i + 1 may arrive

        async def one(i):
            if i:
                await started[i - 1].wait()  # arrive while the one before is running
            outs = []
            async for out in engine.generate(prompts[i], greedy(lengths[i]), str(i)):
                outs.append(out)
                if len(outs) == 2:
                    started[i].set()
            started[i].set()
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            return outs[-1].outputs[0].token_ids

        got = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        await engine.shutdown()
        return got

    assert asyncio.run(main()) == want
    assert max(batch_sizes) >= 2  # a late request decoded beside an earlier one
    assert llm.manager.num_used_blocks == 0


def test_a_consumer_that_leaves_frees_its_blocks_and_a_bad_request_fails_alone(model):
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    prompt, other = random_prompts([6, 7], model.args.vocab_size, seed=9)

    async def main():
        engine = AsyncLLM(llm)
        seen = 0
        async for _ in engine.generate(prompt, greedy(40), "leaves"):
            seen += 1
            if seen == 3:
                break  # closing the stream aborts the request
        with pytest.raises(InvalidPrompt, match="request 'bad': prompt token ids"):
            async for _ in engine.generate([10**9], greedy(3), "bad"):
                pass
        outs = [o async for o in engine.generate(other, greedy(5), "stays")]
        # before shutdown (which aborts whatever runs): the request that left is gone
        assert not llm.has_unfinished_requests() and llm.manager.num_used_blocks == 0
        await engine.shutdown()
        return outs[-1]

    last = asyncio.run(main())
    assert last.finished and len(last.outputs[0].token_ids) == 5


def outputs(*texts, stop_reason=None):
    """A request's successive outputs with these texts, the last finished."""
    return [RequestOutput("r", None, [1], [CompletionOutput(
        0, text, [], 0.0, None, "stop" if i == len(texts) - 1 else None,
        stop_reason if i == len(texts) - 1 else None)], i == len(texts) - 1)
        for i, text in enumerate(texts)]


@pytest.mark.parametrize("texts, stops, deltas", [
    (["He", "Hel\ufffd", "Hello", "Hello!"], (), ["He", "l", "lo", "!"]),  # half a character
    (["x", "xa", "xab", "x"], ("abc",), ["", "", "x", ""]),  # a stop string's start held back
    (["ab", "abcd"], ("zz",), ["a", "bcd"]),  # a one-character tail held for a 2-char stop
])
def test_deltas_send_only_what_cannot_change(texts, stops, deltas):
    sent = {}
    got = [_with_deltas(out, sent, stops).outputs[0].delta for out in outputs(*texts)]
    assert got == deltas and "".join(got) == texts[-1]


def test_streamed_deltas_of_random_tokens_add_up_to_the_text():
    """A random model over SmolLM2's byte-level vocabulary emits pieces of characters: the
    deltas still concatenate to the final text, and no delta but a final one ends in half a
    character."""
    tokenizer, model = tiny_over_smollm2_tokenizer()
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_gpu_blocks=128)

    async def main():
        engine = AsyncLLM(llm)

        async def one(seed):
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True)
            outs = [o async for o in engine.generate([1, 2, 3], params, str(seed))]
            return [o.outputs[0].delta for o in outs], outs[-1].outputs[0].text

        got = await asyncio.gather(*(one(seed) for seed in range(3)))
        await engine.shutdown()
        return got

    for deltas, text in asyncio.run(main()):
        assert "".join(deltas) == text and len(text) > 20
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])


def test_a_failed_step_fails_the_requests_it_served_and_the_engine_serves_on(model):
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    prompt = random_prompts([6], model.args.vocab_size, seed=10)[0]
    lose_device_at(llm, 3)

    async def main():
        engine = AsyncLLM(llm)
        with pytest.raises(RuntimeError, match="device lost"):
            async for _ in engine.generate(prompt, greedy(10), "a"):
                pass
        outs = [o async for o in engine.generate(prompt, greedy(4), "b")]
        await engine.shutdown()
        return outs[-1]

    last = asyncio.run(main())
    assert last.finished and len(last.outputs[0].token_ids) == 4
    assert llm.manager.num_used_blocks == 0


def test_a_request_whose_text_cannot_be_decoded_fails_alone():
    """A tokenizer that raises on one token (a broken vocabulary entry, say): the request a
    logit bias drives to that token fails with the tokenizer's error, and the request that
    shares its steps streams on to the text it gets alone."""
    tokenizer, model = tiny_over_smollm2_tokenizer()
    cursed = 1234

    class Broken(type(tokenizer)):
        def decode(self, ids, *args, **kwargs):
            if cursed in list(ids):
                raise ValueError(f"token {cursed} cannot be decoded")
            return super().decode(ids, *args, **kwargs)

    tokenizer.__class__ = Broken
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_gpu_blocks=128)
    fine = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (alone,) = llm.generate("a fine story", fine, use_tqdm=False)
    doomed = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            logit_bias={cursed: 100.0})

    async def main():
        engine = AsyncLLM(llm)

        async def last(prompt, params, request_id):
            outs = [o async for o in engine.generate(prompt, params, request_id)]
            return outs[-1]

        results = await asyncio.gather(last("a fine story", fine, "fine"),
                                       last("a doomed story", doomed, "doomed"),
                                       return_exceptions=True)
        await engine.shutdown()
        return results

    ok, failed = asyncio.run(main())
    assert isinstance(failed, ValueError) and "cannot be decoded" in str(failed)
    assert ok.outputs[0].text == alone.outputs[0].text
    assert llm.manager.num_used_blocks == 0
