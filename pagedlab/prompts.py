"""Chat workloads for speculative decoding (chapter 12 and ``benchmarks/bench_speculative.py``).

*Editing* asks the model to return a given paragraph with its spelling fixed, so the prompt
predicts most of the reply and n-gram lookup has something to find; *open* questions ask
for new text, so it has little.
"""

from __future__ import annotations

PARAGRAPHS = [  # the book's own sentences, misspelt on purpose
    "A paged KV cache stores the keys and values of each sequense in fixed-size blocks. A "
    "block table maps the logical blocks of a sequence to physical blocks, so memory is "
    "alocated only when a block fills and is never reserved for tokens that do not exist.",
    "Continuous batching lets new requests join a running batch at every step. When the "
    "cache runs out of blocks, the scheduler preempts the latest arival and either swaps its "
    "blocks to the CPU or frees them and recomputes its prompt later.",
    "Prefix caching hashes each full block together with everything before it. A new prompt "
    "that starts with the same tokens finds those blocks in the index and skips their "
    "computation, which is why a shared system prompt costs almost nothing after the frist.",
    "The decode kernel reads each sequence's keys through its block table, one block at a "
    "time, and keeps a running maximum and sum so that the softmax never needs the whole row "
    "at once. Split-KV launches spread a long context over several programs.",
]
QUESTIONS = [
    "What would you pack for a week of hiking in the mountains?",
    "Explain why the sky looks blue during the day.",
    "Suggest three names for a small bakery and say why.",
    "Describe how a bicycle gear system works.",
]


def conversations(kind: str, n: int) -> list[list[dict]]:
    """``n`` one-turn chats of the ``kind`` "editing" or "open", cycling through its texts."""
    if kind not in ("editing", "open"):
        raise ValueError(f"workload kind {kind!r} must be 'editing' or 'open'")
    if kind == "editing":
        texts = [f"Fix the spelling in this paragraph and return it unchanged otherwise:\n\n{p}"
                 for p in PARAGRAPHS]
    else:
        texts = QUESTIONS
    return [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(n)]
