"""The OpenAI-compatible server, through the official ``openai`` client and raw HTTP: the same
text as the engine offline, streamed or whole, for completions and chat; every bad request
refused alone, before the engine, with OpenAI's error object naming its field (the review of
2026-12-04, ``../shared/reviews/server-2026-12-04.md``: each of its failing rows is a test here,
and a fuzz of request bodies runs beside live streams); the API as OpenAI's clients use it;
concurrent streams, clients that disconnect, an API key, content types, and shutdown, with no
block leaked."""

import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _tiny import lose_device_at, tiny_over_smollm2_tokenizer

pytest.importorskip("fastapi", reason="the server's extra is not installed")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402
import uvicorn  # noqa: E402

from pagedlab import LLM, SamplingParams  # noqa: E402
from pagedlab.checkpoints import ModelNotInstalled, smollm2  # noqa: E402
from pagedlab.serve import MAX_BODY_BYTES, Server, build_app, parser  # noqa: E402

NAME = "tiny"
MAX_MODEL_LEN = 256


@contextlib.contextmanager
def serving(app, shutdown_timeout=0.0):
    """``app`` served by pagedlab's uvicorn server on a free loopback port from a thread;
    yields (base url, the server, its thread); stops it after."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server(uvicorn.Config(app, log_level="warning"), shutdown_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread
    server.should_exit = True
    thread.join(timeout=30)


def tiny_llm(model, tokenizer, **kwargs):
    return LLM(model, tokenizer=tokenizer, block_size=4, num_gpu_blocks=512, max_num_seqs=16,
               max_model_len=MAX_MODEL_LEN, **kwargs)


@pytest.fixture(scope="module")
def tiny():
    return tiny_over_smollm2_tokenizer()


@pytest.fixture(scope="module")
def server(tiny):
    """A tiny random model over SmolLM2's tokenizer (and chat template), served on a free
    port from a thread; yields (base url, the engine's LLM, a reference LLM)."""
    tokenizer, model = tiny
    llm = tiny_llm(model, tokenizer)
    reference = LLM(model, tokenizer=tokenizer, block_size=4, num_gpu_blocks=512)
    abort, llm.aborted = llm.abort_request, []

    def recorded_abort(request_id):  # what the disconnect tests read
        llm.aborted.append(request_id)
        abort(request_id)

    llm.abort_request = recorded_abort
    with serving(build_app(llm, NAME)) as (url, _, thread):
        llm.server_thread = thread
        yield url, llm, reference


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def idle(llm, timeout=30.0):
    """Wait until the engine serves nothing; then no block may be in use."""
    deadline = time.monotonic() + timeout
    while llm.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)
    return llm.manager.num_used_blocks


GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def test_completions_whole_and_streamed_match_the_engine(server):
    url, llm, reference = server
    prompt = "The capital of France is"
    want = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                     ignore_eos=True), use_tqdm=False)
    whole = client(url).completions.create(model=NAME, prompt=prompt, **GREEDY)
    assert whole.choices[0].text == want[0].outputs[0].text
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    pieces = [c.choices[0].text for c in client(url).completions.create(
        model=NAME, prompt=prompt, stream=True, **GREEDY)]
    assert "".join(pieces) == want[0].outputs[0].text and len(pieces) > 1
    assert idle(llm) == 0


def test_a_stream_can_end_with_its_usage(server):
    """stream_options.include_usage: a last chunk with no choices and the token counts (what a
    load generator counts tokens by, since one chunk may carry several: speculative decoding)."""
    url, llm, _ = server
    chunks = list(client(url).completions.create(
        model=NAME, prompt="count my tokens", stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(llm.tokenizer.encode("count my tokens"))
    assert all(c.usage is None for c in chunks[:-1])
    assert idle(llm) == 0


def test_chat_whole_and_streamed_match_the_engine(server):
    url, llm, reference = server
    messages = [{"role": "user", "content": "Name three primary colors."}]
    want = reference.chat(messages, SamplingParams(temperature=0, max_tokens=12,
                                                   ignore_eos=True), use_tqdm=False)
    whole = client(url).chat.completions.create(model=NAME, messages=messages, **GREEDY)
    assert whole.choices[0].message.content == want[0].outputs[0].text
    assert whole.choices[0].message.role == "assistant"
    stream = client(url).chat.completions.create(model=NAME, messages=messages, stream=True,
                                                 **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want[0].outputs[0].text
    models = client(url).models.list()
    assert [m.id for m in models.data] == [NAME]
    assert idle(llm) == 0


def test_completion_logprobs_are_the_engine_s_whole_and_streamed(server):
    """``logprobs: k`` on /v1/completions: each token's log-probability and its alternatives
    (the k likeliest and the sampled one) as the engine computes them offline, the same
    whether streamed or not, with offsets that add up to the text."""
    url, llm, reference = server
    prompt = "The capital of France is"
    want = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=8,
                                                     ignore_eos=True, logprobs=3),
                              use_tqdm=False)[0].outputs[0]
    decode = llm.tokenizer.decode
    whole = client(url).completions.create(model=NAME, prompt=prompt, logprobs=3, **dict(
        GREEDY, max_tokens=8)).choices[0].logprobs
    assert whole.tokens == [decode([i]) for i in want.token_ids]
    assert whole.token_logprobs == pytest.approx([a[i] for i, a in zip(want.token_ids,
                                                                      want.logprobs)])
    assert [sorted(d.values()) for d in whole.top_logprobs] == [
        pytest.approx(sorted({decode([j]): v for j, v in a.items()}.values()))
        for a in want.logprobs]
    assert all(3 <= len(d) <= 4 for d in whole.top_logprobs)
    assert whole.text_offset == [sum(map(len, whole.tokens[:i])) for i in range(8)]
    chunks = [c.choices[0].logprobs for c in client(url).completions.create(
        model=NAME, prompt=prompt, logprobs=3, stream=True, **dict(GREEDY, max_tokens=8))]
    assert sum((c.tokens for c in chunks), []) == whole.tokens
    assert sum((c.token_logprobs for c in chunks), []) == pytest.approx(whole.token_logprobs)
    assert sum((c.text_offset for c in chunks), []) == whole.text_offset
    assert idle(llm) == 0


def test_chat_logprobs_are_the_engine_s_with_the_top_k_in_order(server):
    url, llm, reference = server
    messages = [{"role": "user", "content": "Name three primary colors."}]
    want = reference.chat(messages, SamplingParams(temperature=0, max_tokens=6,
                                                   ignore_eos=True, logprobs=2),
                          use_tqdm=False)[0].outputs[0]
    reply = client(url).chat.completions.create(
        model=NAME, messages=messages, logprobs=True, top_logprobs=2,
        **dict(GREEDY, max_tokens=6))
    content = reply.choices[0].logprobs.content
    assert [t.logprob for t in content] == pytest.approx(
        [a[i] for i, a in zip(want.token_ids, want.logprobs)])
    for t, i, a in zip(content, want.token_ids, want.logprobs):
        assert t.token == llm.tokenizer.decode([i]) and bytes(t.bytes) == t.token.encode()
        assert [x.logprob for x in t.top_logprobs] == pytest.approx(
            sorted(a.values(), reverse=True)[:2])
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy: the likeliest
    plain = client(url).chat.completions.create(model=NAME, messages=messages, **GREEDY)
    assert plain.choices[0].logprobs is None
    assert idle(llm) == 0


HI = [{"role": "user", "content": "hi"}]
NESTED = '{"model": "tiny", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"


@pytest.mark.parametrize("path, body, field, status", [
    # (the review's row, where it has one) what OpenAI or vLLM answer
    ("completions", "{not json", None, 400),  # 27
    ("completions", NESTED, None, 400),  # 28: not a plain-text 500
    ("completions", {"model": "gpt-4", "prompt": "hi"}, "model", 404),  # 21: NotFoundError
    ("completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens", 400),  # 31
    ("completions", {"prompt": "hi", "n": 2.5}, "n", 400),  # 33
    ("completions", {"prompt": "hi", "stop": 5}, "stop", 400),  # 34
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", 400),  # 37
    ("completions", {"prompt": "hi", "temperature": float("nan")}, "temperature", 400),  # 39
    ("completions", {"prompt": "hi", "top_k": 2**64}, "top_k", 400),  # 41
    ("completions", {"prompt": "hi", "top_k": 10**6}, "top_k", 400),
    ("completions", {"prompt": "hi", "seed": -1}, "seed", 400),  # 42
    ("completions", {"prompt": ""}, "prompt", 400),  # 43
    ("completions", {"prompt": []}, "prompt", 400),  # 44
    ("completions", {"prompt": [[]]}, "prompt", 400),
    ("completions", {"prompt": "\ud800"}, "prompt", 400),  # 47
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages",
     400),  # 48
    ("completions", {"prompt": [99999999]}, "prompt", 400),  # 49
    ("completions", {"prompt": "hi", "n": 17}, "n", 400),  # 52: over max_num_seqs
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages",
     400),  # 57
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages", 400),  # 58
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options", 400),  # 59
    ("completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens", 400),  # 60
    ("completions", {"prompt": [5] * 200, "max_tokens": 64}, "max_tokens", 400),  # 65
    ("chat/completions", {"messages": HI, "max_completion_tokens": 300},
     "max_completion_tokens", 400),
    ("completions", {"prompt": "word " * 300}, "prompt", 400),  # 46
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", 400),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", 400),
    ("completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty", 400),
    ("completions", {"prompt": "hi", "suffix": "!"}, "suffix", 400),
    ("completions", {"prompt": "hi", "best_of": 3}, "best_of", 400),
    ("completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo", 400),
    ("chat/completions", {"messages": HI, "tools": [{"type": "function"}]}, "tools", 400),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages", 400),
    ("completions", {}, "prompt", 400),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs", 400),
    ("completions", {"prompt": "hi", "logprobs": -1}, "logprobs", 400),
    ("chat/completions", {"messages": HI, "top_logprobs": 2}, "top_logprobs", 400),
    ("chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21},
     "top_logprobs", 400),
    ("chat/completions", {"messages": HI, "logprobs": 3}, "logprobs", 400),
])
def test_bad_input_gets_openai_s_error_naming_the_field_and_the_server_serves_on(
        server, path, body, field, status):
    url, llm, _ = server
    content = body if isinstance(body, str) else json.dumps(body)
    reply = httpx.post(f"{url}/v1/{path}", content=content,
                       headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and error["code"] == status
    assert field is None or field in error["message"]  # named for a person too
    assert error["type"] == ("NotFoundError" if status == 404 else "invalid_request_error")
    ok = client(url).completions.create(model=NAME, prompt="hello", **GREEDY)
    assert ok.usage.completion_tokens == 12
    assert idle(llm) == 0


def test_concurrent_streams_all_complete_and_leak_nothing(server):
    url, llm, _ = server

    def one(i):
        stream = client(url).completions.create(
            model=NAME, prompt=f"request {i}:", stream=True, temperature=0,
            max_tokens=4 + i % 9, extra_body={"ignore_eos": True})
        chunks = list(stream)
        return chunks[-1].choices[0].finish_reason, len(chunks)

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(24)))
    assert all(reason == "length" for reason, _ in results)
    assert idle(llm) == 0


def test_a_client_that_disconnects_gives_its_blocks_back(server):
    url, llm, _ = server
    body = {"model": NAME, "prompt": "a long story:", "max_tokens": 200, "stream": True,
            "temperature": 0, "ignore_eos": True}
    before = len(llm.aborted)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
    request_id = json.loads(got[0][len("data:"):])["id"]
    assert idle(llm) == 0
    assert llm.aborted[before:] == [request_id]  # aborted, not run to its 200 tokens


@contextlib.contextmanager
def served(*flags, up_within: float = 180):
    """``python -m pagedlab.serve`` (SmolLM2, a small CPU cache) on a free port with ``flags``,
    once its /health answers: (the process, its URL). Killed on the way out if still running."""
    import os
    import subprocess
    import sys

    try:
        smollm2()
    except ModelNotInstalled as missing:
        pytest.skip(str(missing))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PAGEDLAB_CPU_KVCACHE_SPACE": "0.1"}
    proc = subprocess.Popen([sys.executable, "-m", "pagedlab.serve", "--port", str(port),
                             "--max-num-seqs", "4", *flags], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + up_within
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_python_m_pagedlab_serve_starts_answers_and_stops_on_sigterm():
    """The README's server command: SmolLM2 by default, answering the openai client; SIGTERM
    with two streams in flight (the review's row 79: it waited for them) ends them at once,
    each with an error event and [DONE], and the process cleanly."""
    import signal

    with served() as (proc, url):
        (model,) = client(url).models.list().data
        reply = client(url).chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": "What is 2 + 2?"}],
            temperature=0, max_tokens=4)
        assert reply.usage.completion_tokens <= 4 and reply.choices[0].message.content
        body = {"model": model.id, "prompt": "Once upon a time", "max_tokens": 150,
                "temperature": 0, "ignore_eos": True, "stream": True}
        started = [threading.Event() for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(sse_lines, url, body, s) for s in started]
            assert all(s.wait(120) for s in started)
            proc.send_signal(signal.SIGTERM)
            for stream in streams:
                lines = stream.result()
                assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == 503
                assert len(lines) < 150  # ended, not drained to its 150 tokens
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    # uvicorn shuts the app down (the engine's loop stopped, its requests aborted), then exits
    # by the signal it caught, as a process killed by it would
    assert "Application shutdown complete" in output, output
    assert proc.returncode in (0, -signal.SIGTERM), output


def test_metrics_count_what_was_served_under_vllm_s_names(server):
    from prometheus_client.parser import text_string_to_metric_families

    url, llm, _ = server

    def scrape():
        text = httpx.get(f"{url}/metrics", timeout=30).text
        return {s.name: s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.labels.get("model_name") == NAME}

    before = scrape()
    for _ in range(2):
        client(url).completions.create(model=NAME, prompt="count me", **GREEDY)
    after = scrape()
    assert idle(llm) == 0
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 2
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 24
    assert after["vllm:time_to_first_token_seconds_count"] - before[
        "vllm:time_to_first_token_seconds_count"] == 2
    assert after["vllm:inter_token_latency_seconds_count"] - before[
        "vllm:inter_token_latency_seconds_count"] == 2 * 11  # 12 tokens, 11 gaps each
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:num_preemptions_total"] >= 0 and "vllm:prefix_cache_hits_total" in after


def sse_lines(url, body, started=None, headers=None):
    """The data lines of a streamed request, read to the end; ``started`` set at the first."""
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120,
                      headers=headers) as reply:
        for line in reply.iter_lines():
            if line.startswith("data:"):
                lines.append(line[len("data:"):].strip())
                if started is not None:
                    started.set()
    return lines


def streamed_text(lines):
    return "".join(json.loads(line)["choices"][0]["text"] for line in lines[:-1]
                   if json.loads(line).get("choices"))


def test_a_bad_request_sent_while_others_run_fails_alone(server):
    """The review's row 75: top_k=2**64 crashed the step that two other requests shared. It is
    refused before the engine now, and a stream and a whole request beside it are unchanged."""
    url, llm, reference = server
    body = {"model": NAME, "prompt": "a story:", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    (want,) = reference.generate("a story:", SamplingParams(temperature=0, max_tokens=40,
                                                             ignore_eos=True), use_tqdm=False)
    started = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        stream = pool.submit(sse_lines, url, {**body, "stream": True}, started)
        whole = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
        assert started.wait(60)
        attack = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": NAME, "prompt": "x", "top_k": 2**64, "temperature": 1.0})
        lines, whole = stream.result(), whole.result()
    assert attack.status_code == 400 and attack.json()["error"]["param"] == "top_k"
    assert lines[-1] == "[DONE]" and streamed_text(lines) == want.outputs[0].text
    assert whole.status_code == 200
    assert whole.json()["choices"][0]["text"] == want.outputs[0].text
    assert idle(llm) == 0


def test_the_api_as_openai_s_clients_use_it(server):
    """The review's rows 19 to 26: max_completion_tokens; chat with no limit runs to its end
    (EOS or the context); a list of prompts; content as text parts; echo; logit_bias; and the
    penalties, each as the engine computes them offline."""
    url, llm, reference = server
    openai_client = client(url)
    chat = openai_client.chat.completions.create
    five = chat(model=NAME, messages=HI, max_completion_tokens=5, temperature=0,
                extra_body={"ignore_eos": True})
    assert five.usage.completion_tokens == 5 and five.choices[0].finish_reason == "length"
    free = chat(model=NAME, messages=HI, temperature=0)
    assert free.choices[0].finish_reason == "stop" or (
        free.usage.total_tokens == MAX_MODEL_LEN and free.usage.completion_tokens > 16)
    parts = chat(model=NAME, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Name three"}, {"type": "text", "text": "colors."}]}],
        **GREEDY)
    joined = chat(model=NAME, messages=[{"role": "user", "content": "Name three\ncolors."}],
                  **GREEDY)
    assert parts.choices[0].message.content == joined.choices[0].message.content

    prompts = ["The capital of France is", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].text for o in reference.generate(prompts, params, use_tqdm=False)]
    batch = openai_client.completions.create(model=NAME, prompt=prompts, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == want and batch.usage.completion_tokens == 24
    streamed = {}
    for chunk in openai_client.completions.create(model=NAME, prompt=prompts, stream=True,
                                                  **GREEDY):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: want[0], 1: want[1]}
    echo = openai_client.completions.create(model=NAME, prompt=prompts[0], echo=True, **GREEDY)
    assert echo.choices[0].text == prompts[0] + want[0]

    eos = llm.tokenizer.eos_token_id  # the tiny model has none of its own: a stop token
    biased = openai_client.completions.create(
        model=NAME, prompt=prompts[0], max_tokens=12, temperature=0,
        logit_bias={str(eos): 100}, extra_body={"stop_token_ids": [eos]})
    assert biased.choices[0].finish_reason == "stop" and biased.usage.completion_tokens == 1
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    (offline,) = reference.generate(prompts[1], SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, **penalties), use_tqdm=False)
    online = openai_client.completions.create(
        model=NAME, prompt=prompts[1], temperature=0, max_tokens=24,
        presence_penalty=1.5, frequency_penalty=0.5,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    assert online.choices[0].text == offline.outputs[0].text
    assert idle(llm) == 0


def test_an_unknown_model_is_openai_s_not_found(server):
    url, llm, _ = server
    with pytest.raises(openai.NotFoundError):
        client(url).completions.create(model="no-such-model", prompt="hi", max_tokens=2)


def test_a_non_streamed_request_is_aborted_when_its_client_leaves(server):
    """The review's row 72: the request ran all its tokens after its client had gone."""
    url, llm, _ = server
    before = len(llm.aborted)
    body = json.dumps({"model": NAME, "prompt": "a long story:", "max_tokens": 240,
                       "temperature": 0, "ignore_eos": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while not llm.has_unfinished_requests():  # the request is running
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    assert idle(llm) == 0
    assert len(llm.aborted) == before + 1  # aborted, not run to its 240 tokens


def test_a_huge_prompt_is_refused_without_tokenizing_and_prompts_are_tokenized_off_the_loop(
        server, monkeypatch):
    """The review's row 76: a 2.4 MB prompt was tokenized on the event loop, stalling every
    client for seconds. No tokenization of it can fit the context, so it is refused unread;
    any other prompt is tokenized in a worker thread, not the server's event loop."""
    url, llm, _ = server
    encode, threads = llm.tokenizer.encode, []

    def recorded(text, *args, **kwargs):
        threads.append((threading.current_thread(), len(text)))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "encode", recorded)
    huge = httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"model": NAME, "prompt": "lorem ipsum " * 200_000})
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "prompt"
    assert threads == []
    client(url).completions.create(model=NAME, prompt="hello", **GREEDY)
    client(url).chat.completions.create(model=NAME, messages=HI, **GREEDY)
    assert len(threads) == 2 and all(t is not llm.server_thread for t, _ in threads)
    assert idle(llm) == 0


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    url, llm, _ = server
    reply = httpx.post(f"{url}/v1/completions", content=b" " * (MAX_BODY_BYTES + 1),
                       headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == 413
    assert idle(llm) == 0


def test_json_endpoints_refuse_other_content_types(server):
    """The review's row 84: a page in any browser may POST text/plain to another origin
    without a CORS preflight, so JSON sent as text/plain must not start a generation."""
    url, llm, _ = server
    body = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 2})
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        reply = httpx.post(f"{url}/v1/completions", content=body,
                           headers={"content-type": kind}, timeout=60)
        assert reply.status_code == 415 and reply.json()["error"]["code"] == 415
    assert idle(llm) == 0


def test_an_api_key_guards_v1(tiny, monkeypatch):
    """The review's row 82: ``--api-key`` (or $PAGEDLAB_API_KEY, as vLLM's VLLM_API_KEY):
    401 without it under /v1; /health stays open for probes."""
    tokenizer, model = tiny
    monkeypatch.setenv("PAGEDLAB_API_KEY", "s3cret")
    assert parser().parse_args([]).api_key == "s3cret"
    assert parser().parse_args(["--api-key", "other"]).api_key == "other"
    with serving(build_app(tiny_llm(model, tokenizer), NAME, api_key="s3cret")) as (url, *_):
        for key in ("wrong", "none"):
            wrong = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                wrong.completions.create(model=NAME, prompt="hi", max_tokens=2)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        right = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert right.completions.create(model=NAME, prompt="hi", max_tokens=2).choices


@pytest.mark.parametrize("shutdown_timeout", [0.0, 120.0])
def test_shutdown_ends_streams_in_flight_at_once_or_drains_them(tiny, shutdown_timeout):
    """vLLM's shape (the review's rows 79, 80): by default the requests in flight end at once,
    each stream with an error event and [DONE] (never cut); ``--shutdown-timeout`` lets them
    finish first. Either way the engine is shut down, with no block left in use."""
    tokenizer, model = tiny
    llm = tiny_llm(model, tokenizer)
    app = build_app(llm, NAME)
    body = {"model": NAME, "prompt": "a long story:", "max_tokens": 240, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with serving(app, shutdown_timeout) as (url, server, thread):
        started = [threading.Event() for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(sse_lines, url, body, s) for s in started]
            assert all(s.wait(60) for s in started)
            server.should_exit = True  # what SIGTERM and Ctrl-C do
            results = [s.result() for s in streams]
        thread.join(timeout=60)
        assert not thread.is_alive()
    for lines in results:
        assert lines[-1] == "[DONE]"
        last = json.loads(lines[-2])
        if shutdown_timeout:
            assert last["choices"][0]["finish_reason"] == "length"
        else:
            assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"]
    assert app.state.engine._loop_task.done() and not llm.has_unfinished_requests()
    assert llm.manager.num_used_blocks == 0


FUZZED = {  # field -> the endpoint whose body carries it
    **dict.fromkeys(["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n",
                     "seed", "stop", "stop_token_ids", "logprobs", "echo", "stream",
                     "stream_options", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logit_bias", "ignore_eos", "best_of", "suffix",
                     "user"], "completions"),
    **dict.fromkeys(["messages", "max_completion_tokens", "top_logprobs"], "chat/completions"),
}
BASES = {"completions": {"model": NAME, "prompt": "hi", "max_tokens": 4},
         "chat/completions": {"model": NAME, "messages": HI, "max_tokens": 4}}


def random_value(rng, depth=0):
    """Any JSON value: numbers small, huge and not finite, text of any length with lone
    surrogates and emoji, lists and objects nested a little or very deep."""
    kind = rng.choice(["int", "huge", "float", "nonfinite", "text", "bool", "null", "list",
                       "object", "deep"])
    if kind == "int":
        return rng.randint(-3, 300)
    if kind == "huge":
        return rng.choice([2**31, 2**63, 2**64, -(2**70), 10**30])
    if kind == "float":
        return rng.uniform(-3, 3)
    if kind == "nonfinite":
        return rng.choice([float("nan"), float("inf"), float("-inf")])
    if kind == "text":
        size = rng.choice([0, 3, 40, 3000])
        return "".join(rng.choice(["a", " ", "\ud800", "\U0001f600", "\u05d0", "\x00", "7"])
                       for _ in range(size))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "deep":
        return json.loads("[" * 50 + "]" * 50) if rng.random() < 0.5 else "deep"
    if depth > 2:
        return 1
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["role", "content", "type", "text", "5", "x"]): random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def test_fuzzed_bodies_fail_alone_while_other_streams_run(server, seed_offset):
    """Bodies with one field set to a random value (type, size, nesting), sent while other
    streams run: each gets a 200 (a value that happens to be valid) or a 4xx naming that
    field, never a 5xx; every other stream's reply is the one it gets alone; no block leaks."""
    import random

    url, llm, reference = server
    rng = random.Random(47 + seed_offset)
    body = {"model": NAME, "prompt": "a steady stream:", "max_tokens": 30, "temperature": 0,
            "ignore_eos": True, "stream": True}
    (want,) = reference.generate(body["prompt"], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    done, replies = threading.Event(), []

    def steady():
        while not done.is_set():
            replies.append(streamed_text(sse_lines(url, body)))

    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(steady) for _ in range(2)]
        try:
            for _ in range(120):
                field = rng.choice(list(FUZZED))
                path = FUZZED[field]
                sent = {**BASES[path], field: random_value(rng)}
                reply = httpx.post(f"{url}/v1/{path}", content=json.dumps(sent), timeout=120,
                                   headers={"content-type": "application/json"})
                assert reply.status_code in (200, 400, 404), (sent, reply.text)
                if reply.status_code != 200:
                    assert reply.json()["error"]["param"] == field, (sent, reply.text)
        finally:
            done.set()
        for run in runs:
            run.result()
    assert replies and all(text == want.outputs[0].text for text in replies)
    assert idle(llm) == 0


def test_a_failed_step_ends_each_reply_with_an_error_it_can_read(tiny):
    """A step that fails for no one request's fault (the device, say) fails the requests it
    served: a stream gets an error event and [DONE] (the review's row 75 saw one cut), a
    whole request a JSON 500 (it saw plain text); the server serves on."""
    tokenizer, model = tiny
    llm = tiny_llm(model, tokenizer)
    calls = lose_device_at(llm, 3)
    body = {"model": NAME, "prompt": "a story:", "max_tokens": 20, "temperature": 0,
            "ignore_eos": True}
    with serving(build_app(llm, NAME)) as (url, *_):
        lines = sse_lines(url, {**body, "stream": True})
        assert lines[-1] == "[DONE]"
        error = json.loads(lines[-2])["error"]
        assert error["code"] == 500 and "device lost" in error["message"]
        calls.clear()
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert whole.status_code == 500 and whole.json()["error"]["code"] == 500
        ok = client(url).completions.create(model=NAME, prompt="hello", **GREEDY)
        assert ok.usage.completion_tokens == 12
    assert llm.manager.num_used_blocks == 0


@pytest.mark.slow
def test_the_server_answers_at_tensor_parallelism_three_and_its_workers_end_with_it():
    """``python -m pagedlab.serve --tensor-parallel-size 3``: SmolLM2 split over three
    processes answers the openai client as one process does (greedy); on SIGTERM the server
    exits cleanly and takes its two worker processes with it."""
    import signal
    import subprocess

    question = [{"role": "user", "content": "What is the capital of France?"}]
    with served("--tensor-parallel-size", "3", up_within=240) as (proc, url):
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                  text=True).stdout.split()
        assert len(children) >= 2  # the two workers (and the spawn tracker)
        (model,) = client(url).models.list().data
        reply = client(url).chat.completions.create(model=model.id, messages=question,
                                                    temperature=0, max_tokens=8)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM), proc.stdout.read()
    with LLM(smollm2(), max_num_seqs=4, num_gpu_blocks=64) as one:
        alone = one.chat(question, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert reply.choices[0].message.content == alone[0].outputs[0].text
    time.sleep(1)
    for pid in children:  # every worker ended with the server (a zombie left to init is ended)
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "\nState:\tZ" in status.read_text(), status.read_text()
