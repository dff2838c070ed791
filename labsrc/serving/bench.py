"""``python -m labsrc.serving.bench``: replay a request trace against a running server and report throughput,
time to first token (TTFT), time per output token (TPOT) and end-to-end latency percentiles, as vLLM's serving
benchmark does.

Requests arrive as a Poisson process (``--rate`` per second; ``inf`` sends them all at once), each with random
prompt token ids and a fixed number of output tokens (``ignore_eos``), and stream their tokens back; TTFT is
the time from sending to the first streamed token, TPOT the time between later tokens of a request.

``python -m labsrc.serving.bench --compare`` needs no server: in one process it times the engine against
``transformers`` on one mixed greedy workload (:func:`compare`), repetitions interleaved so that a machine
that slows down (a shared CPU) slows every system alike.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time

import numpy as np

from labsrc.serving.experiments import poisson_trace

__all__ = ["run", "main", "percentiles", "compare", "format_compare"]


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


async def _counted(coro, bar):
    result = await coro
    bar.update()
    return result


async def _run(url, model, trace, arrivals, progress=False):
    import httpx
    from tqdm.auto import tqdm

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        t0 = time.perf_counter()
        with tqdm(total=len(trace), desc="requests", unit="req", disable=not progress) as bar:
            results = await asyncio.gather(*(_counted(_one(client, url, model, it, at, t0), bar)
                                             for it, at in zip(trace, arrivals)))
        wall = time.perf_counter() - t0
    return results, wall


def _run_sync(coro):
    """``asyncio.run(coro)``, also from code that already runs in an event loop (a notebook): there in a thread
    of its own, since one thread holds at most one running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def run(url: str, model: str = "lab-target", n: int = 16, rate: float = math.inf, prompt_range=(8, 64),
        output_range=(8, 32), seed: int = 0, progress: bool = False) -> dict:
    """Replay ``n`` requests against the server at ``url``; return the summary (see the module docstring).
    ``progress`` shows a bar of the requests finished (the command line; a chapter's page stays quiet)."""
    trace = poisson_trace(n, 0.0, prompt_range, output_range, seed=seed)
    rng = np.random.default_rng(seed + 1)
    arrivals = np.zeros(n) if math.isinf(rate) else np.cumsum(rng.exponential(1 / rate, size=n))
    results, wall = _run_sync(_run(url.rstrip("/"), model, trace, arrivals, progress))
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


def _padded_generate(model, trace):
    """One left-padded batch through ``model.generate``: every prompt runs to the longest request's length."""
    import torch

    width = max(len(t["prompt"]) for t in trace)
    pad = model.generation_config.pad_token_id
    pad = 1 if pad is None else pad
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(t["prompt"])) + t["prompt"] for t in trace], device=device)
    mask = torch.tensor([[0] * (width - len(t["prompt"])) + [1] * len(t["prompt"]) for t in trace], device=device)
    out = model.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=pad,
                         max_new_tokens=max(t["max_tokens"] for t in trace))
    return [out[i, width:width + t["max_tokens"]].tolist() for i, t in enumerate(trace)]


def _continuous_batching(model, trace, page_size, num_blocks, max_batch_tokens, max_seqs):
    """transformers' continuous batching: the manager ``model.generate_batch`` runs, given each request its own
    ``max_new_tokens`` (``generate_batch`` itself takes one for all, which would make it run every request to
    the longest length)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=1,
                          max_new_tokens=max(t["max_tokens"] for t in trace))
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=max_seqs, use_cuda_graph=False, use_async_batching=False)
    with model.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cb,
                                                   block=True, timeout=5, warmup=False) as manager:
        ids = [manager.add_request(t["prompt"], request_id=f"r{i}", max_new_tokens=t["max_tokens"])
               for i, t in enumerate(trace)]
        results = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=60)
            if r is None:
                raise RuntimeError("transformers' continuous batching returned nothing for 60 s")
            if r.is_finished():
                results[r.request_id] = r.generated_tokens
    return [results[i] for i in ids]


def compare(model_name: str = "lab-target", n: int = 24, prompt_range=(8, 96), output_range=(4, 32),
            reps: int = 5, seed: int = 0, block_size: int = 16, num_blocks: int = 256,
            max_num_batched_tokens: int = 2048, max_num_seqs: int = 32, device: str = "cpu",
            progress: bool = False) -> dict:
    """Time the engine (PyTorch path) against one left-padded batched ``model.generate`` and transformers'
    continuous batching on ``n`` greedy requests (EOS ignored), ``reps`` interleaved repetitions each.

    Every system's output is checked: the engine's must equal ``model.generate`` run on each prompt alone
    (a mismatch raises). Throughput counts the tokens the requests asked for (a padded batch computes more,
    to the longest request, and that is its cost). On ``device="cuda"`` the engine runs the Triton kernels.
    Returns the tokens/s of every run and the per-repetition ratios of the engine to each baseline.
    ``progress`` shows a bar over the timed runs (the command line; a chapter's page stays quiet)."""
    import statistics

    import torch
    from tqdm.auto import tqdm

    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 2:
        raise ValueError(f"reps must be an int >= 2 (the ratio's interval needs two pairs), got {reps!r}")

    from labsrc import claims
    from labsrc.models import load
    from labsrc.serving.engine import Engine
    from labsrc.serving.experiments import greedy_reference
    from labsrc.serving.scheduler import SamplingParams

    model, tok = load(model_name, device=device)
    kernels = "triton" if torch.device(device).type == "cuda" else "torch"
    trace = poisson_trace(n, 0.0, prompt_range, output_range, seed=seed)
    want = [greedy_reference(model, t["prompt"], t["max_tokens"]) for t in trace]
    tokens = sum(t["max_tokens"] for t in trace)

    def engine_run():
        eng = Engine(model, num_blocks=num_blocks, block_size=block_size, tokenizer=tok, kernels=kernels,
                     max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                     enable_prefix_caching=False)  # random prompts share nothing; no reuse across repetitions
        return [r["token_ids"] for r in eng.generate([t["prompt"] for t in trace],
                                                      [SamplingParams(max_tokens=t["max_tokens"], ignore_eos=True)
                                                       for t in trace])]

    systems = {"engine": engine_run,
               "padded generate": lambda: _padded_generate(model, trace),
               "generate_batch": lambda: _continuous_batching(model, trace, block_size, num_blocks,
                                                              max_num_batched_tokens, max_num_seqs)}
    outputs = {k: f() for k, f in systems.items()}  # warm-up run, and the outputs to check
    if outputs["engine"] != want:
        bad = sum(o != w for o, w in zip(outputs["engine"], want))
        raise AssertionError(f"the engine differs from per-prompt greedy generate on {bad} of {n} requests")
    same = {k: sum(o == w for o, w in zip(v, want)) for k, v in outputs.items()}
    tps = {k: [] for k in systems}
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    bar = tqdm(total=reps * len(systems), desc="timed runs", unit="run", disable=not progress)
    with torch.inference_mode():
        for _ in range(reps):
            for k, f in systems.items():
                sync()
                t0 = time.perf_counter()
                f()
                sync()
                tps[k].append(tokens / (time.perf_counter() - t0))
                bar.update()
    bar.close()
    ratios = {k: claims.Estimate.mean([e / b for e, b in zip(tps["engine"], tps[k])])
              for k in systems if k != "engine"}
    return dict(requests=n, prompt_range=tuple(prompt_range), output_range=tuple(output_range), tokens=tokens,
                reps=reps, threads=torch.get_num_threads(), device=device,
                kernels=kernels,
                tokens_per_s={k: statistics.median(v) for k, v in tps.items()}, runs=tps, ratios=ratios,
                same_as_generate=same)


def format_compare(r: dict) -> str:
    """The table of :func:`compare` (Markdown)."""
    (lo, hi), (olo, ohi) = r["prompt_range"], r["output_range"]
    lines = [f"{r['requests']} greedy requests (prompts of {lo}-{hi} tokens, {olo}-{ohi} new tokens each), "
             f"{r['tokens']} output tokens, median of {r['reps']} interleaved "
             f"repetitions on {r['device']} ({r['kernels']} kernels in the engine, {r['threads']} torch "
             "thread(s)):", "",
             "| system | outputs equal to per-prompt generate | tokens/s | engine / system (95% interval) |",
             "|---|---:|---:|---:|"]
    for k, v in r["tokens_per_s"].items():
        ratio = r["ratios"].get(k)
        cell = "-" if ratio is None else f"{ratio.value:.2f}x ({ratio.lo:.2f}-{ratio.hi:.2f})"
        lines.append(f"| {k} | {r['same_as_generate'][k]} of {r['requests']} | {v:.0f} | {cell} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m labsrc.serving.bench", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="lab-target")
    parser.add_argument("--n", type=int, default=None, help="requests (default 16; 24 with --compare)")
    parser.add_argument("--rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="default 8 64; 8 96 with --compare")
    parser.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="default 8 32; 4 32 with --compare")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true",
                        help="no server: time the engine against transformers in this process (24 requests, "
                             "prompts of 8-96 tokens, 4-32 new tokens, unless --n/--prompt-len/--output-len)")
    parser.add_argument("--reps", type=int, default=5, help="--compare: interleaved repetitions (at least 2)")
    parser.add_argument("--device", default="cpu", help="--compare: cpu, or cuda (the engine's Triton kernels)")
    args = parser.parse_args(argv)
    # the two modes have their own default workloads (the server's: vLLM-like; --compare: issue 31's mix)
    n = args.n or (24 if args.compare else 16)
    prompt = tuple(args.prompt_len or ((8, 96) if args.compare else (8, 64)))
    output = tuple(args.output_len or ((4, 32) if args.compare else (8, 32)))
    if args.compare:
        result = compare(args.model, n, prompt, output, args.reps, args.seed, device=args.device, progress=True)
        print(format_compare(result))
        return result
    summary = run(args.url, args.model, n, args.rate, prompt, output, args.seed, progress=True)
    print(format_report(summary))
    return summary


if __name__ == "__main__":
    main()
