"""The real server end to end: ``python -m labsrc.serving`` in a subprocess on a free port, spoken to over HTTP
with httpx; greedy completions equal ``model.generate``, streaming agrees with the whole completion, bad
requests get 4xx with a message and the server keeps serving, and the bench client reports percentiles."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "labsrc.serving", "--model", "lab-target", "--port", str(port),
                             "--kernels", "torch", "--num-blocks", "64", "--block-size", "8"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {proc.stdout.read()[-2000:]}")
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


def test_greedy_completion_equals_generate(server):
    from labsrc.models import load

    model, tok = load("lab-target")
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
    r = post(model="lab-target", prompt=[5] * 600, max_tokens=2)
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
