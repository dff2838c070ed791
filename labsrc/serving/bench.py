"""``python -m labsrc.serving.bench``: replay a request trace against a running server and report throughput,
time to first token (TTFT), time per output token (TPOT) and end-to-end latency percentiles, as vLLM's serving
benchmark does.

Requests arrive as a Poisson process (``--rate`` per second; ``inf`` sends them all at once), each with random
prompt token ids and a fixed number of output tokens (``ignore_eos``), and stream their tokens back; TTFT is
the time from sending to the first streamed token, TPOT the time between later tokens of a request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time

import numpy as np

from labsrc.serving.experiments import poisson_trace

__all__ = ["run", "main", "percentiles"]


def percentiles(values, qs=(50, 90, 99)) -> dict:
    """``{"p50": ..., "p90": ..., "p99": ...}`` of ``values`` (NaN when there are none)."""
    arr = np.asarray(list(values), dtype=float)
    return {f"p{q}": float(np.percentile(arr, q)) if arr.size else math.nan for q in qs}


async def _one(client, url, model, item, start_at, t0):
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    sent = time.perf_counter()
    body = dict(model=model, prompt=item["prompt"], max_tokens=item["max_tokens"], temperature=0.0,
                stream=True, ignore_eos=True)
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(data["error"]["message"])
            times.append(time.perf_counter())
    return dict(sent=sent, times=times)


async def _run(url, model, trace, arrivals):
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, model, it, at, t0) for it, at in zip(trace, arrivals)))
        wall = time.perf_counter() - t0
    return results, wall


def run(url: str, model: str = "lab-target", n: int = 16, rate: float = math.inf, prompt_range=(8, 64),
        output_range=(8, 32), seed: int = 0) -> dict:
    """Replay ``n`` requests against the server at ``url``; return the summary (see the module docstring)."""
    trace = poisson_trace(n, 0.0, prompt_range, output_range, seed=seed)
    rng = np.random.default_rng(seed + 1)
    arrivals = np.zeros(n) if math.isinf(rate) else np.cumsum(rng.exponential(1 / rate, size=n))
    results, wall = asyncio.run(_run(url.rstrip("/"), model, trace, arrivals))
    ttft = [r["times"][0] - r["sent"] for r in results]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in results if len(r["times"]) > 1]
    e2e = [r["times"][-1] - r["sent"] for r in results]
    out_tokens = sum(len(r["times"]) for r in results)
    return dict(requests=n, seconds=wall, output_tokens=out_tokens, request_throughput=n / wall,
                output_throughput=out_tokens / wall, ttft=percentiles(ttft), tpot=percentiles(tpot),
                e2e=percentiles(e2e))


def format_report(s: dict) -> str:
    lines = [f"{s['requests']} requests, {s['output_tokens']} output tokens in {s['seconds']:.2f} s: "
             f"{s['request_throughput']:.2f} requests/s, {s['output_throughput']:.1f} output tokens/s",
             f"{'':18}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for key, label in (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("e2e", "latency (ms)")):
        lines.append(f"{label:18}" + "".join(f"{s[key][p] * 1e3:>10.1f}" for p in ("p50", "p90", "p99")))
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m labsrc.serving.bench", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="lab-target")
    parser.add_argument("--n", type=int, default=16, help="requests")
    parser.add_argument("--rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(8, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(8, 32), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    summary = run(args.url, args.model, args.n, args.rate, tuple(args.prompt_len), tuple(args.output_len),
                  args.seed)
    print(format_report(summary))
    return summary


if __name__ == "__main__":
    main()
