"""``/metrics`` read the way chapter 13 reads it: by the sample names Prometheus writes, so a
check that no request was preempted can fail, and does when a preemption is forced."""

import asyncio

import pytest
from _tiny import random_prompts, tiny_hf

from pagedlab import LLM, SamplingParams
from pagedlab.model import from_hf

pytest.importorskip("prometheus_client")
from prometheus_client import generate_latest  # noqa: E402

from pagedlab.engine.async_llm import AsyncLLM  # noqa: E402
from pagedlab.metrics import ServerMetrics, scrape  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return from_hf(tiny_hf("llama-gqa-d64"))


def served(model, num_gpu_blocks):
    """Four requests of 8 prompt and 24 output tokens served at once by an AsyncLLM over
    ``num_gpu_blocks`` blocks of 4 tokens; the /metrics page afterwards, scraped."""
    llm = LLM(model, block_size=4, num_gpu_blocks=num_gpu_blocks)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = random_prompts([8] * 4, model.args.vocab_size, seed=3)

    async def main():
        engine = AsyncLLM(llm)
        metrics = ServerMetrics(engine, "tiny")

        async def one(i):
            async for out in engine.generate(prompts[i], params, str(i)):
                pass
            return out

        outs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        page = generate_latest(metrics.registry).decode()
        await engine.shutdown()
        return outs, page

    outs, page = asyncio.run(main())
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    return scrape(page)


def no_preemption(samples) -> bool:
    """Chapter 13's check, over its samples of /metrics: indexed, so a wrong name fails."""
    return max(m["vllm:num_preemptions_total"] for m in samples) == 0


def test_the_chapters_preemption_check_passes_with_room_and_fails_when_forced(model):
    roomy = served(model, num_gpu_blocks=64)  # 4 x 8 blocks fit
    assert no_preemption([roomy])
    tight = served(model, num_gpu_blocks=12)  # 4 requests need 32 blocks at the end
    assert tight["vllm:num_preemptions_total"] > 0
    assert not no_preemption([tight])
    assert tight["vllm:kv_cache_usage_perc"] == 0 and tight["vllm:num_requests_running"] == 0


def test_counters_are_read_under_the_names_prometheus_writes(model):
    samples = served(model, num_gpu_blocks=64)
    assert "vllm:num_preemptions" not in samples  # the family's name, never a sample's
    assert {"vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
            "vllm:request_success_total", "vllm:kv_cache_usage_perc"} <= set(samples)
    with pytest.raises(KeyError):
        no_preemption([{"vllm:num_preemptions": 0.0}])  # the old, never-failing spelling
