"""The real server end to end: ``python -m labsrc.serving`` in a subprocess on a free port (127.0.0.1 only),
spoken to over raw HTTP with httpx and with the official ``openai`` client; greedy completions equal
``model.generate``, streaming agrees with the whole completion, stop/n/echo/logprobs behave as OpenAI defines
them, bad requests get 4xx with a message, clients that go away free their blocks, and the server keeps
serving; a hypothesis fuzz of random valid and invalid requests, concurrent clients and disconnects ends the
file."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from labsrc.models import CHECKPOINTS, load

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NUM_BLOCKS, BODY_LIMIT = 64, 65536


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")  # a file, not a pipe nobody drains
    proc = subprocess.Popen([sys.executable, "-m", "labsrc.serving", "--model", "lab-target", "--port", str(port),
                             "--host", "127.0.0.1", "--kernels", "torch", "--num-blocks", str(NUM_BLOCKS),
                             "--block-size", "8", "--max-request-bytes", str(BODY_LIMIT)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the server exited: {log.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not come up within 120 s")
            time.sleep(0.3)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def lab():
    return load("lab-target")


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def settle(url, timeout=30.0) -> dict:
    """Wait until the engine holds no request; return its books. Every block must then be free."""
    deadline = time.monotonic() + timeout
    while True:
        s = httpx.get(f"{url}/stats", timeout=5).json()
        if s["running"] == s["waiting"] == s["active"] == s["queued"] == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine still holds requests after {timeout} s: {s}")
        time.sleep(0.1)


def test_greedy_completion_equals_generate(server, lab):
    model, tok = lab
    prompt = [17, 400, 93, 1201, 55, 8, 302]
    r = httpx.post(f"{server}/v1/completions", json=dict(model="lab-target", prompt=prompt, max_tokens=6,
                                                         temperature=0, ignore_eos=True), timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, pad_token_id=1)[0, 7:]
    assert body["choices"][0]["token_ids"] == want.tolist()[:len(body["choices"][0]["token_ids"])]
    assert body["usage"] == dict(prompt_tokens=7, completion_tokens=len(body["choices"][0]["token_ids"]),
                                 total_tokens=7 + len(body["choices"][0]["token_ids"]))
    assert body["choices"][0]["text"] == tok.decode(body["choices"][0]["token_ids"], skip_special_tokens=True)


def test_streaming_agrees_with_the_whole_completion(server):
    import json

    req = dict(model="lab-target", prompt="Once upon a time", max_tokens=8, temperature=0)
    whole = httpx.post(f"{server}/v1/completions", json=req, timeout=60).json()["choices"][0]
    pieces, reasons = [], []
    with httpx.stream("POST", f"{server}/v1/completions", json=dict(req, stream=True), timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        choice = json.loads(line[6:])["choices"][0]
        pieces.append(choice["text"])
        reasons.append(choice["finish_reason"])
    assert "".join(pieces) == whole["text"]
    assert reasons[-1] == whole["finish_reason"] and all(r is None for r in reasons[:-1])


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    post = lambda **kw: httpx.post(f"{server}/v1/completions", json=kw, timeout=60)  # noqa: E731
    r = post(model="gpt-4", prompt="hi", max_tokens=2)
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    r = post(model="lab-target", prompt="hi", max_tokens=-3)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    config = json.loads((CHECKPOINTS / "lab-target" / "config.json").read_text())
    context = config["max_position_embeddings"]                   # the served model's whole context
    r = post(model="lab-target", prompt=[5] * context, max_tokens=2)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    r = post(model="lab-target", prompt=[5, 6], max_tokens=2, temperature=-1)
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = post(model="lab-target", prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert r.status_code == 200 and 1 <= r.json()["usage"]["completion_tokens"] <= 2
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["id"] == "lab-target"


def test_bench_client_reports_percentiles(server):
    from labsrc.serving import bench

    s = bench.run(server, n=4, rate=float("inf"), prompt_range=(4, 12), output_range=(3, 5), seed=1)
    assert s["requests"] == 4 and 12 <= s["output_tokens"] <= 20
    assert 0 < s["ttft"]["p50"] <= s["ttft"]["p99"] <= s["e2e"]["p99"]
    assert s["tpot"]["p50"] > 0 and "TTFT" in bench.format_report(s)


def post(url, **kw):
    return httpx.post(f"{url}/v1/completions", json=kw, timeout=60)


def reference_text(lab, prompt_ids, n):
    model, tok = lab
    ids = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=n, pad_token_id=1,
                         eos_token_id=None)[0, len(prompt_ids):].tolist()
    return ids, tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_openai_client_streaming_and_not(server, client, lab):
    model, tok = lab
    assert [m.id for m in client.models.list()] == ["lab-target"]
    prompt = [17, 400, 93, 1201, 55, 8, 302]
    ids, text = reference_text(lab, prompt, 10)
    c = client.completions.create(model="lab-target", prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert c.object == "text_completion" and c.choices[0].text == text and c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == 7 and c.usage.completion_tokens == 10
    chunks = list(client.completions.create(model="lab-target", prompt=prompt, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == text
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "length"
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="lab-target", prompt="hi", max_tokens=2, best_of=2)
    # the client's own fields with values that ask for nothing: the same completion
    same = client.completions.create(model="lab-target", prompt=prompt, max_tokens=10, temperature=0,
                                     presence_penalty=0, frequency_penalty=0, best_of=1, logit_bias={},
                                     user="student-7", suffix=None, extra_body={"ignore_eos": True})
    assert same.choices[0].text == text
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="lab-target", prompt="hi", max_tokens=2, logit_bias={"17": -100})


def test_stop_n_echo_and_logprobs_as_openai_defines_them(server, client, lab):
    model, tok = lab
    prompt = [23, 1800, 77, 3001, 9, 640, 12, 88]
    ids, text = reference_text(lab, prompt, 16)
    assert len(text) >= 6, text
    stop = text[3:6]
    cut = text[:text.find(stop)]
    for stream in (False, True):
        r = client.completions.create(model="lab-target", prompt=prompt, max_tokens=16, temperature=0,
                                      stop=[stop, "\u2603never"], stream=stream, extra_body={"ignore_eos": True})
        chunks = list(r) if stream else [r]
        assert "".join(ch.choices[0].text for ch in chunks) == cut, (stream, stop, text)
        assert chunks[-1].choices[0].finish_reason == "stop"
    # n: greedy completions are all equal; seeded sampling is reproducible and gives n indexed choices
    r = client.completions.create(model="lab-target", prompt=prompt, max_tokens=5, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text == ids_text(tok, ids[:5])
    a = client.completions.create(model="lab-target", prompt=prompt, max_tokens=6, temperature=1.0, n=3, seed=7)
    b = client.completions.create(model="lab-target", prompt=prompt, max_tokens=6, temperature=1.0, n=3, seed=7)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 3
    # batched prompts: choice i * n + j
    r = client.completions.create(model="lab-target", prompt=[prompt, prompt[:4]], max_tokens=3, temperature=0,
                                  n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.choices[0].text == ids_text(tok, ids[:3])
    assert r.usage.prompt_tokens == 12 and r.usage.completion_tokens == 12
    # echo: the prompt's text first
    text_prompt = "Once upon a time"
    r = client.completions.create(model="lab-target", prompt=text_prompt, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith(text_prompt)
    # logprobs (echo too): values against one forward of prompt + output
    r = client.completions.create(model="lab-target", prompt=prompt, max_tokens=5, temperature=0, logprobs=2,
                                  echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    full = prompt + ids[:5]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)
    assert len(lp.tokens) == len(full) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(full)):
        assert lp.token_logprobs[p] == pytest.approx(float(want[p - 1, full[p]]), abs=1e-3)
        # the 2 most likely and the prompt's own token when it is not among them (OpenAI: up to logprobs + 1)
        assert 2 <= len(lp.top_logprobs[p]) <= 3 and lp.tokens[p] in lp.top_logprobs[p]
        assert max(lp.top_logprobs[p].values()) == pytest.approx(float(want[p - 1].max()), abs=1e-3)
    assert lp.text_offset[len(prompt)] == len(ids_text(tok, prompt))
    chunks = list(client.completions.create(model="lab-target", prompt=prompt, max_tokens=5, temperature=0,
                                            logprobs=1, stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for ch in chunks if ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx([float(want[len(prompt) - 1 + i, ids[i]]) for i in range(5)], abs=1e-3)


def ids_text(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_fields_are_checked_at_the_door(server):
    """Unknown fields, OpenAI fields the engine does not implement, strings for numbers, non-finite floats
    (JSON's Infinity/NaN), out-of-range values: 400 naming the field, never 200 and never 500."""
    base = dict(model="lab-target", prompt=[5, 6, 7], max_tokens=2)
    for extra, field in ((dict(foo=1), "foo"), (dict(best_of=2), "best_of"), (dict(frequency_penalty=0.5),
                         "frequency_penalty"), (dict(suffix="x"), "suffix"), (dict(max_tokens="5"), "max_tokens"),
                         (dict(n=0), "n"), (dict(n=True), "n"), (dict(logprobs=6), "logprobs"),
                         (dict(stop=["a"] * 5), "stop"), (dict(stop=""), "stop"), (dict(seed=2 ** 64), "seed"),
                         (dict(temperature=2.5), "temperature"), (dict(top_p=0), "top_p"),
                         (dict(prompt=[5, -1]), "prompt"), (dict(prompt=[]), "prompt"),
                         (dict(prompt=[[5], "x"]), "prompt"), (dict(prompt=[5, 6], n=16, max_tokens=1,
                                                                    ), None)):
        r = post(server, **{**base, **extra})
        if field is None:
            assert r.status_code == 200, r.text
            continue
        assert r.status_code == 400, (extra, r.text)
        assert field in r.text, (extra, r.text)
    for raw in (b'{"model": "lab-target", "prompt": [5], "temperature": Infinity}',
                b'{"model": "lab-target", "prompt": [5], "top_p": NaN}', b'{"model": "lab-target", "prompt": [5',
                b'[1, 2]'):
        r = httpx.post(f"{server}/v1/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 400, (raw, r.text)
    r = post(server, model="lab-target", prompt=[[5, 6]] * 33, n=2, max_tokens=1)
    assert r.status_code == 400 and "at most 64" in r.text
    # OpenAI's fields with a value that asks for nothing are accepted (they were all 400); null is the default
    for noop in (dict(presence_penalty=0), dict(frequency_penalty=0.0), dict(best_of=1), dict(logit_bias={}),
                 dict(logit_bias={"17": 0}), dict(user="student-7"), dict(suffix=None), dict(suffix=""),
                 dict(stream_options=None), dict(max_tokens=None, temperature=None, top_p=None, n=None, echo=None,
                                                 stream=None, logprobs=None, seed=None, stop=None)):
        r = post(server, **{**base, **noop})
        assert r.status_code == 200, (noop, r.text)
    for extra, field in ((dict(presence_penalty=-0.1), "presence_penalty"), (dict(best_of=1, n=2), "best_of"),
                         (dict(logit_bias={"17": 5}), "logit_bias"), (dict(user=3), "user"),
                         (dict(stream_options={"include_usage": True}), "stream_options"),
                         (dict(suffix="!"), "suffix")):
        r = post(server, **{**base, **extra})
        assert r.status_code == 400 and field in r.text, (extra, r.text)


def test_size_limits_and_huge_prompts(server):
    """A body over the limit is 413 (declared or chunked); a text of far more tokens than the context is 400,
    found from a bounded prefix; the server answers others meanwhile and after."""
    r = httpx.post(f"{server}/v1/completions", content=b"x" * (BODY_LIMIT + 1), timeout=30)
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]

    def chunks():
        for _ in range(BODY_LIMIT // 4096 + 2):
            yield b" " * 4096

    r = httpx.post(f"{server}/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413
    t0 = time.perf_counter()
    r = post(server, model="lab-target", prompt="word " * 12000, max_tokens=2)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert time.perf_counter() - t0 < 20
    assert post(server, model="lab-target", prompt="hello", max_tokens=2).status_code == 200
    assert settle(server)["free_blocks"] == NUM_BLOCKS


def test_edge_sampling_parameters_fail_nobody(server, lab):
    """Sampling parameters at the edge of the float range used to make the engine step raise, and every
    request in flight got 500. Now they sample, and concurrent greedy requests keep their exact tokens."""
    from concurrent.futures import ThreadPoolExecutor

    prompt = [44, 901, 3, 77, 1500, 6]
    ids, _ = reference_text(lab, prompt, 6)
    reqs = [dict(temperature=0.0)] * 2 + [dict(temperature=5e-324, seed=1), dict(temperature=2.0, top_p=5e-324,
                                                                                     seed=2),
                                          dict(temperature=1e-300, top_p=1.0, seed=3), dict(temperature=2.0, seed=4)]
    with ThreadPoolExecutor(len(reqs)) as pool:
        rs = list(pool.map(lambda kw: post(server, model="lab-target", prompt=prompt, max_tokens=6,
                                           ignore_eos=True, **kw), reqs))
    assert [r.status_code for r in rs] == [200] * len(reqs), [r.text for r in rs]
    assert [r.json()["choices"][0]["token_ids"] for r in rs[:2]] == [ids, ids]
    assert rs[2].json()["choices"][0]["token_ids"] == ids  # a tiny temperature is the argmax limit
    assert settle(server)["free_blocks"] == NUM_BLOCKS


def test_clients_that_go_away_free_their_blocks(server):
    """A streaming client that closes after two events and a non-streaming client that times out: both
    requests are aborted (not run to their 400 tokens), and every block is free again."""
    before = settle(server)["aborted"]
    body = dict(model="lab-target", prompt=[5, 6, 7, 8, 9], max_tokens=400, temperature=0, ignore_eos=True)
    with httpx.stream("POST", f"{server}/v1/completions", json=dict(body, stream=True), timeout=60) as resp:
        events = 0
        for line in resp.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                break
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 30
    while settle(server)["aborted"] < before + 2:
        assert time.monotonic() < deadline, "the requests of clients that went away were not aborted"
        time.sleep(0.1)
    assert settle(server)["free_blocks"] == NUM_BLOCKS
    assert post(server, model="lab-target", prompt=[5, 6], max_tokens=2).status_code == 200


# ------------------------------------------------------------------------------------- in-process server
@pytest.fixture
def inprocess(lab, monkeypatch):
    """The app on uvicorn in a thread of this process (127.0.0.1), so a test can force what the engine samples:
    ``forced[seed]`` lists the tokens a request with that seed (and temperature > 0) produces; seed 666 makes
    sampling raise."""
    import threading

    import uvicorn

    from labsrc.serving import engine as engine_module
    from labsrc.serving.engine import Engine
    from labsrc.serving.server import create_app

    model, tok = lab
    forced: dict[int, list[int]] = {}
    real = engine_module._sample

    def sample(logits, params, generator):
        if params.seed == 666:
            raise RuntimeError("sampling exploded")
        if params.seed in forced:
            return forced[params.seed].pop(0)
        return real(logits, params, generator)

    monkeypatch.setattr(engine_module, "_sample", sample)
    engine = Engine(model, num_blocks=64, block_size=8, tokenizer=tok, kernels="torch")
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "lab-target"), host="127.0.0.1", port=free_port(),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}", forced, engine
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_streamed_non_ascii_text_arrives_whole(inprocess, lab):
    """Characters that span several byte-level tokens (accents, CJK, an emoji) forced through the real tokenizer
    and the server's stream: no chunk carries U+FFFD, and the chunks join to the non-streamed text (before the
    fix every such character was streamed as U+FFFD and never sent whole)."""
    import json

    url, forced, _ = inprocess
    tok = lab[1]
    text = "café 中文 😀 naïve ü"
    ids = tok(text)["input_ids"]
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # the case: tokens that are parts of characters
    body = dict(model="lab-target", prompt=[5, 6], max_tokens=len(ids), temperature=1.0, ignore_eos=True)
    forced[11] = list(ids)
    whole = post(url, **body, seed=11).json()["choices"][0]
    assert whole["text"] == text
    forced[12] = list(ids)
    with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, seed=12, stream=True), timeout=60) as r:
        pieces = [json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces), pieces
    forced[13] = list(ids)  # a stop string made of a multi-token character
    with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, seed=13, stream=True, stop="文"),
                      timeout=60) as r:
        events = [json.loads(line[6:])["choices"][0] for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["text"] for e in events) == "café 中" and events[-1]["finish_reason"] == "stop"


def test_a_failing_sequence_gets_500_and_the_others_their_tokens(inprocess, lab):
    from concurrent.futures import ThreadPoolExecutor

    url, _, engine = inprocess
    prompt = [31, 415, 9, 2200, 71]
    ids, _ = reference_text(lab, prompt, 5)
    reqs = [dict(temperature=1.0, seed=666), dict(temperature=0.0), dict(temperature=1.0, seed=666, stream=True),
            dict(temperature=0.0)]
    with ThreadPoolExecutor(len(reqs)) as pool:
        rs = list(pool.map(lambda kw: post(url, model="lab-target", prompt=prompt, max_tokens=5, ignore_eos=True,
                                           **kw), reqs))
    assert rs[0].status_code == 500 and "sampling exploded" in rs[0].json()["error"]["message"]
    assert rs[0].json()["error"]["type"] == "server_error"
    assert rs[2].status_code == 200 and '"server_error"' in rs[2].text and "sampling exploded" in rs[2].text
    assert [r.json()["choices"][0]["token_ids"] for r in (rs[1], rs[3])] == [ids, ids]
    deadline = time.monotonic() + 10
    while engine.has_unfinished():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert engine.blocks.num_free_blocks == 64
    engine.blocks.check_invariants()


def _events(url, body):
    with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True), timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:])["choices"][0] for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_stream_equals_completion_for_every_stop_string(inprocess, lab):
    """The server's stream against its own non-streamed completion, on forced non-ASCII tokens and stop
    strings of every kind the detokenizer fuzz draws (a multi-byte last character, U+FFFD, cut from the text):
    the same text, the same finish reason, the same tokens and log-probabilities."""
    from hypothesis import HealthCheck, given, settings

    url, forced, _ = inprocess
    tok = lab[1]
    seeds = iter(range(1000, 100000))

    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(_text_ids_and_stops())
    def check(case):
        text, stop, _ = case
        ids = list(tok(text)["input_ids"])
        stop = [x for x in stop if x][:4]
        if not ids or any(len(x) > 256 for x in stop):
            return
        body = dict(model="lab-target", prompt=[5, 6], max_tokens=len(ids), temperature=1.0, ignore_eos=True,
                    logprobs=1, stop=stop or None)
        a, b = next(seeds), next(seeds)
        forced[a], forced[b] = list(ids), list(ids)
        whole = post(url, **body, seed=a).json()["choices"][0]
        events = _events(url, dict(body, seed=b))
        assert "".join(e["text"] for e in events) == whole["text"], (text, stop, events)
        assert events[-1]["finish_reason"] == whole["finish_reason"]
        streamed = [e["logprobs"] for e in events if e["logprobs"]]
        assert [t for lp in streamed for t in lp["tokens"]] == whole["logprobs"]["tokens"]
        offsets = [o for lp in streamed for o in lp["text_offset"]]
        assert offsets == sorted(offsets) and all(o <= len(whole["text"]) for o in offsets)
        forced.pop(a, None), forced.pop(b, None)

    check()


def test_echo_logprobs_offsets_top_entries_and_seeds(inprocess, lab, monkeypatch):
    """echo + logprobs on a non-ASCII prompt with a special token in it and a non-ASCII generation: one
    offset rule for prompt and generated tokens (each offset is where its token's text starts in the returned
    text, non-decreasing; they used to overshoot on the prompt and then run backwards); top_logprobs keeps
    every alternative (byte tokens collided on U+FFFD) and holds the chosen token, up to logprobs + 1 entries;
    n choices of a seed near 2**63 sample with n different seeds."""
    from labsrc.serving import engine as engine_module
    from labsrc.serving.logprobs import TokenStrings

    url, forced, _ = inprocess
    tok = lab[1]
    strings = TokenStrings(tok)
    prompt = tok("Café “中文” ok")["input_ids"]
    prompt = prompt[:3] + [0] + prompt[3:]  # <|endoftext|> in the middle: a token with no text
    gen = tok(" naïve… 😀")["input_ids"]
    for k in (0, 2):
        forced[21 + k] = list(gen)
        body = dict(model="lab-target", prompt=prompt, max_tokens=len(gen), temperature=1.0, seed=21 + k,
                    ignore_eos=True, echo=True, logprobs=k)
        c = post(url, **body).json()["choices"][0]
        text, lp = c["text"], c["logprobs"]
        assert text == tok.decode(prompt, skip_special_tokens=True) + tok.decode(gen)
        ids = prompt + gen
        assert lp["tokens"] == [strings[t] for t in ids]
        offsets = lp["text_offset"]
        assert offsets == sorted(offsets) and offsets[-1] < len(text)
        for t, o, piece in zip(ids, offsets, lp["tokens"]):
            if t == 0:
                assert o == len(tok.decode(prompt[:3]).rstrip("\ufffd"))  # where the next character starts
            elif not piece.startswith("bytes:"):
                assert text[o:o + len(piece)] == piece, (piece, o, text)
        for i, (piece, top) in enumerate(zip(lp["tokens"], lp["top_logprobs"])):
            if i == 0:
                assert top is None
                continue
            assert piece in top and k <= len(top) <= k + 1, (i, piece, top)
    seen = []
    sample = engine_module._sample
    monkeypatch.setattr(engine_module, "_sample", lambda lg, p, g: (seen.append(p.seed), sample(lg, p, g))[1])
    r = post(url, model="lab-target", prompt=[5, 6], max_tokens=1, temperature=1.0, n=3, seed=2 ** 63 - 1)
    assert r.status_code == 200 and sorted(seen) == [0, 1, 2 ** 63 - 1]


MULTIBYTE = "”“’。、…中é😀"  # characters of two to four bytes, several byte-level tokens each


def _text_ids_and_stops():
    """A text with multi-byte characters, its tokens (sometimes with a random token spliced in: a stray byte
    of a character, a special token), and up to three stop strings: random, cut from the text, ending in a
    multi-byte character, or holding U+FFFD."""
    from hypothesis import strategies as st

    chars = st.one_of(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), st.sampled_from(MULTIBYTE))

    @st.composite
    def draw(draw):
        text = draw(st.text(alphabet=chars, max_size=24))
        stops = []
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from(["random", "cut", "multibyte-end", "replacement"]))
            if kind == "cut" and text:
                i = draw(st.integers(0, len(text) - 1))
                stops.append(text[i:draw(st.integers(i + 1, min(len(text), i + 4)))])
            elif kind == "multibyte-end":
                stops.append(draw(st.text(alphabet=chars, max_size=2)) + draw(st.sampled_from(MULTIBYTE)))
            elif kind == "replacement":
                stops.append(draw(st.sampled_from(["\ufffd", "\ufffd\ufffd", "a\ufffd", "\ufffd "])))
            else:
                stops.append(draw(st.text(min_size=1, max_size=3)))
        splice = draw(st.none() | st.tuples(st.integers(0, 64), st.integers(0, 4095)))
        return text, stops, splice

    return draw()


def _stop_reference(tok, ids, stops):
    """What the completion must be, computed the slow way: decode every prefix from scratch; the first prefix
    whose settled text (every prefix but the whole sequence is searched without its trailing U+FFFD) holds a
    stop string ends it, cut before the earliest stop string found. Returns (text, stopped, tokens kept)."""
    from labsrc.serving.detokenizer import settled

    for i in range(1, len(ids) + 1):
        text = tok.decode(ids[:i], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        searched = text if i == len(ids) else settled(text)
        hits = [searched.find(s) for s in stops if s in searched]
        if hits:
            return text[:min(hits)], True, i
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), False, len(ids)


def test_incremental_detokenizer_on_real_tokens(lab):
    """The fuzz of the stream against the whole completion, with stop strings of every kind that broke it: one
    whose last character is multi-byte (the held-back window counted the unfinished character's U+FFFD, and
    the stream leaked the stop string's first character) and one holding U+FFFD (it fired inside every
    unfinished character). The pieces join to the detokenizer's final text (what the non-streamed completion
    returns), and that text is the slow reference's."""
    from hypothesis import given, settings

    from labsrc.serving.detokenizer import IncrementalDetokenizer

    tok = lab[1]

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(_text_ids_and_stops())
    def check(case):
        text, stop, splice = case
        ids = list(tok(text)["input_ids"])
        if splice is not None:
            ids.insert(min(splice[0], len(ids)), splice[1])
        if not ids:
            return
        whole = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        d = IncrementalDetokenizer(tok, stop)
        pieces = [d.add(t) for t in ids] + [d.flush()]
        want, stopped, kept = _stop_reference(tok, ids, [s for s in stop if s])
        assert "".join(pieces) == d.text == want, (text, stop, pieces)
        assert d.stopped == stopped and d.num_tokens_kept == kept
        if "\ufffd" not in whole:  # valid text: no placeholder is ever sent, and no U+FFFD stop fires
            assert not any("\ufffd" in p for p in pieces)
            assert not (stopped and all("\ufffd" in s for s in stop))

    check()


def test_leaks_the_fuzz_found_stay_fixed(lab):
    from labsrc.serving.detokenizer import IncrementalDetokenizer

    tok = lab[1]
    ids = tok("he said “ab” and 中文。ok")["input_ids"]
    for stop, want in (("ab”", "he said “"), ("b”", "he said “a"), ("文。", "he said “ab” and 中"),
                       ("\ufffd", "he said “ab” and 中文。ok")):
        d = IncrementalDetokenizer(tok, [stop])
        assert "".join([d.add(t) for t in ids] + [d.flush()]) == want, stop
        assert d.stopped == (stop != "\ufffd")


def test_logprob_token_strings_are_distinct_and_offsets_locate_tokens(lab):
    """Byte-level tokens that are parts of characters all decode to U+FFFD: as keys of top_logprobs they
    collided. Every token now has its own string, and each offset (prompt or generated: one rule) points at the
    character holding the token's first byte, never decreasing, never past the text; a special token sits
    where the next text begins."""
    from hypothesis import given, settings, strategies as st

    from labsrc.serving.logprobs import TokenStrings, text_offsets, token_bytes, top_entries

    tok = lab[1]
    strings = TokenStrings(tok)
    table = strings.table()
    assert len(set(table)) == len(table) == len(tok)
    specials = set(tok.all_special_ids)
    for t in range(len(tok)):
        piece = tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert table[t] == piece or ("\ufffd" in piece and table[t].startswith(("bytes:", "token_id:")))
    e4 = tok.convert_tokens_to_ids("ä")  # the first byte of 中, alone
    assert strings[e4] == "bytes:\\xe4" and token_bytes(tok, e4) == b"\xe4"
    top = {e4: -1.0, tok.convert_tokens_to_ids("æ"): -1.5}  # two lead bytes, both U+FFFD when decoded
    assert len(top_entries(strings, e4, -1.0, top)) == 2 and len(top_entries(strings, 73, -3.0, top)) == 3

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(st.text(alphabet=st.one_of(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
                                      st.sampled_from(MULTIBYTE)), max_size=20),
           st.lists(st.tuples(st.integers(0, 40), st.sampled_from(sorted(specials))), max_size=3),
           st.integers(0, 40))
    def check(text, inserted, split):
        ids = list(tok(text)["input_ids"])
        for at, special in inserted:
            ids.insert(min(at, len(ids)), special)
        whole = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        # the echoed prompt and the generation are decoded apart and joined: split the tokens in two
        split = min(split, len(ids))
        head = tok.decode(ids[:split], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        tail = tok.decode(ids[split:], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        returned = head + tail
        offsets = text_offsets(tok, ids[:split]) + text_offsets(tok, ids[split:], base=len(head))
        assert offsets == sorted(offsets) and all(0 <= o <= len(returned) for o in offsets)
        if split in (0, len(ids)):
            assert returned == whole
        consumed = [b"", b""]  # bytes before each token, in its part
        for i, (t, o) in enumerate(zip(ids, offsets)):
            part = 0 if i < split else 1
            text_part, o = (head, o) if part == 0 else (tail, o - len(head))
            if "\ufffd" not in text_part:  # valid text: the offset is exact
                # the character at the offset holds the token's first byte (a special token, which has no
                # byte, sits at the boundary where the next byte goes, or on the character it splits)
                start, end = len(text_part[:o].encode()), len(text_part[:o + 1].encode())
                b = len(consumed[part])
                assert start <= b and (b < end or b == start), (text, ids, i)
            if t not in specials:
                consumed[part] += token_bytes(tok, t)

    check()


def test_choice_seeds_are_distinct_for_every_seed():
    """``n`` completions of one seed sample with ``n`` different seeds, up to the largest (clamping at 2**63 - 1
    gave every choice of a seed near it the same one)."""
    from hypothesis import given, settings, strategies as st

    from labsrc.serving.protocol import MAX_N, CompletionRequest
    from labsrc.serving.scheduler import MAX_SEED, SamplingParams

    @settings(max_examples=200, deadline=None, derandomize=True)
    @given(st.one_of(st.integers(0, MAX_SEED), st.integers(MAX_SEED - 20, MAX_SEED)), st.integers(1, MAX_N))
    def check(seed, n):
        req = CompletionRequest(model="m", prompt="x", seed=seed, n=n)
        seeds = [req.choice_seed(j) for j in range(n)]
        assert len(set(seeds)) == n and seeds[0] == seed
        for s in seeds:
            SamplingParams(seed=s)  # every one is a seed the engine takes

    check()
    assert CompletionRequest(model="m", prompt="x").choice_seed(3) is None


# ------------------------------------------------------------------------------------------------ the fuzz
def _fuzz_strategies():
    from hypothesis import strategies as st

    ids = st.lists(st.integers(0, 4095), min_size=1, max_size=24)
    text = st.text(alphabet=st.sampled_from("ab cé中😀.\n"), min_size=1, max_size=24)
    optional = dict(
        temperature=st.one_of(st.just(0.0), st.floats(0, 2), st.just(5e-324)),
        top_p=st.one_of(st.floats(5e-324, 1.0), st.just(1.0)), n=st.integers(1, 2),
        stop=st.one_of(st.none(), st.text(alphabet="ab cé”。…\ufffd", min_size=1, max_size=3),
                       st.lists(st.text(alphabet="ab cé”。…\ufffd", min_size=1, max_size=3), max_size=4)),
        presence_penalty=st.just(0), frequency_penalty=st.just(0.0), logit_bias=st.just({}),
        user=st.text(max_size=8), suffix=st.sampled_from([None, ""]),
        echo=st.booleans(), logprobs=st.one_of(st.none(), st.integers(0, 5)), seed=st.integers(0, 2 ** 63 - 1),
        ignore_eos=st.booleans())
    prompt = st.one_of(ids, text, st.lists(st.one_of(ids), min_size=1, max_size=2),
                       st.lists(text, min_size=1, max_size=2))
    valid = st.fixed_dictionaries(dict(model=st.just("lab-target"), prompt=prompt, max_tokens=st.integers(1, 6)),
                                  optional=optional)
    breakers = st.sampled_from([
        ("foo", 1), ("best_of", 2), ("presence_penalty", 0.1), ("max_tokens", 0), ("max_tokens", "3"),
        ("temperature", -0.5), ("temperature", 3.0), ("top_p", 0.0), ("top_p", 1.5), ("n", 17), ("n", 0),
        ("logprobs", 9), ("seed", -1), ("seed", 2 ** 64), ("stop", ["x"] * 5), ("prompt", []), ("prompt", [4096]),
        ("prompt", [-3]), ("prompt", [1.5]), ("prompt", 7), ("prompt", [5] * 600), ("echo", "yes"),
        ("model", "other"), ("stream", 1), ("logit_bias", {"5": 1.0}), ("suffix", "x"),
        ("frequency_penalty", 0.3), ("user", 5)])
    invalid = st.tuples(valid, breakers).map(lambda vb: {**vb[0], vb[1][0]: vb[1][1]})
    action = st.one_of(
        st.tuples(st.just("valid"), valid, st.none()),
        st.tuples(st.just("stream-then-leave"), valid, st.integers(1, 3)),
        st.tuples(st.just("invalid"), invalid, st.none()))
    return st.lists(action, min_size=1, max_size=4)


def _run_action(url, kind, body, leave_after):
    import json

    if kind == "stream-then-leave":
        with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True), timeout=60) as r:
            if r.status_code != 200:
                return r.status_code, r.read().decode()
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    data = json.loads(line[6:])
                    assert "error" not in data, data
                    seen += 1
                    if seen == leave_after:
                        break
            return 200, ""
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    return r.status_code, r.text


def test_fuzz_random_requests_concurrent_clients_and_disconnects(server):
    """Random valid and invalid requests from concurrent clients, some streaming and leaving mid-stream: a valid
    request gets 200 with n choices per prompt, an invalid one 4xx, never 5xx; after each run every block is
    free and the server still answers."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from hypothesis import HealthCheck, given, settings

    deadline = time.monotonic() + 240  # the fuzz's own budget on a shared CPU

    @settings(max_examples=15, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(_fuzz_strategies())
    def run(actions):
        if time.monotonic() > deadline:
            return
        with ThreadPoolExecutor(len(actions)) as pool:
            results = list(pool.map(lambda a: _run_action(server, *a), actions))
        for (kind, body, _), (status, text) in zip(actions, results):
            if kind == "invalid":
                assert 400 <= status < 500, (body, status, text)
                assert "error" in json.loads(text), text
            else:
                assert status == 200, (body, status, text)
                if kind == "valid":
                    reply = json.loads(text)
                    prompts = 1 if isinstance(body["prompt"], str) or isinstance(body["prompt"][0], int) else \
                        len(body["prompt"])
                    assert len(reply["choices"]) == prompts * body.get("n", 1)
                    assert all(c["finish_reason"] in ("stop", "length") for c in reply["choices"])
        books = settle(server)
        assert books["free_blocks"] == books["num_blocks"] == NUM_BLOCKS, books
        assert httpx.get(f"{server}/health", timeout=10).status_code == 200

    run()
    assert post(server, model="lab-target", prompt=[5, 6], max_tokens=2).status_code == 200


def test_tokenize_bounded_reads_a_prefix_of_a_huge_text(lab):
    """A prompt of a million characters is refused after tokenizing a prefix of it (the engine thread used to
    tokenize all of it before checking the length); a text within the limit gets its exact token ids, and the
    prefix's tokens are a prefix of the whole text's (the property the early refusal rests on)."""
    from labsrc.serving.server import tokenize_bounded

    tok = lab[1]
    seen = []

    def counting(text):
        seen.append(len(text))
        return tok(text)

    huge = "ünïcode words and 12345 digits " * 40000
    with pytest.raises(ValueError, match="at least .* tokens; the model's context is 511"):
        tokenize_bounded(counting, huge, 511)
    assert seen and max(seen) <= 16 * 512
    text = "Once upon a time, café 中文 " * 10
    assert tokenize_bounded(tok, text, 511) == list(tok(text)["input_ids"])
    with pytest.raises(ValueError, match="the prompt has"):
        tokenize_bounded(tok, text, 20)
    cut = text.rfind(" ", 0, 100)
    head = tok(text[:cut])["input_ids"]
    assert tok(text)["input_ids"][:len(head)] == head
