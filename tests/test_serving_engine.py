"""The engine against transformers: greedy outputs equal ``model.generate(do_sample=False)`` run on each prompt
alone, for mixed prompt lengths, chunked prefill, prefix hits and forced preemption, on the PyTorch references
and (one small case) on the Triton kernels; and equal to transformers' own continuous batching
(``model.generate_batch``) on the same requests."""
import labsrc  # noqa: F401

import pytest
import torch

from labsrc.models import load
from labsrc.serving.engine import Engine, SamplingParams
from labsrc.serving.scheduler import Scheduler
from labsrc.serving.blocks import BlockManager


@pytest.fixture(scope="module")
def lab():
    return load("lab-target")


def prompts_of(seed, lengths, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(5, 4096, (n,), generator=g).tolist() for n in lengths]


def reference(model, prompts, max_new):
    outs = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new, pad_token_id=1)[0]
        outs.append(ids[len(p):].tolist())
    return outs


@pytest.mark.parametrize("num_blocks,budget,seed", [(64, 64, 0), (14, 16, 1), (13, 7, 2)])
def test_greedy_equals_generate_per_prompt_with_chunking_and_preemption(lab, num_blocks, budget, seed):
    model, tok = lab
    prompts = prompts_of(seed, [5, 23, 40, 12])
    eng = Engine(model, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4,
                 tokenizer=tok, kernels="torch")
    got = eng.generate(prompts, SamplingParams(max_tokens=12))
    assert [r["token_ids"] for r in got] == reference(model, prompts, 12)
    if num_blocks < 20:
        assert eng.scheduler.num_preemptions > 0, "the small pool must force preemption"
    assert eng.blocks.num_free_blocks == num_blocks  # everything given back
    eng.blocks.check_invariants()


def test_prefix_hits_skip_prefill_and_keep_outputs(lab):
    model, tok = lab
    system = prompts_of(9, [24])[0]
    prompts = prompts_of(3, [3, 7, 5], prefix=system)
    eng = Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=1, tokenizer=tok,
                 kernels="torch")  # one at a time: each later request finds the system prompt cached
    got = eng.generate(prompts, SamplingParams(max_tokens=6))
    assert [r["token_ids"] for r in got] == reference(model, prompts, 6)
    assert eng.blocks.cache_hits >= 2 * (24 // 4)
    prefill = sum(row["prefill_tokens"] for row in eng.step_log)
    assert prefill < sum(len(p) for p in prompts) - 2 * 24 + 1


def test_triton_kernels_give_the_same_tokens(lab):
    model, tok = lab
    prompts = prompts_of(4, [6, 9])  # interpreted Triton is slow: two prompts, one prefill and one decode step
    eng = Engine(model, num_blocks=16, block_size=4, max_num_batched_tokens=32, max_num_seqs=2, tokenizer=tok,
                 kernels="triton")
    got = eng.generate(prompts, SamplingParams(max_tokens=2))
    assert [r["token_ids"] for r in got] == reference(model, prompts, 2)


def test_same_tokens_as_transformers_continuous_batching(lab):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, tok = lab
    prompts = prompts_of(5, [9, 30, 17])
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=1)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=64, max_requests_per_batch=4,
                                  use_cuda_graph=False, use_async_batching=False)
    theirs = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb, warmup=False)
    theirs = [theirs[k].generated_tokens for k in sorted(theirs, key=lambda k: int(k.split("_")[1]))]
    eng = Engine(model, num_blocks=32, block_size=16, max_num_batched_tokens=64, max_num_seqs=4, tokenizer=tok,
                 kernels="torch")
    ours = [r["token_ids"] for r in eng.generate(prompts, SamplingParams(max_tokens=8))]
    assert ours == theirs


def test_text_prompts_sampling_and_static_policy(lab):
    model, tok = lab
    eng = Engine(model, num_blocks=32, block_size=8, max_num_seqs=2, tokenizer=tok, kernels="torch")
    a, b = eng.generate(["Once upon a time", "The capital of"], SamplingParams(max_tokens=5))
    assert isinstance(a["text"], str) and len(a["token_ids"]) <= 5 and b["finish_reason"] in ("stop", "length")
    hot = SamplingParams(max_tokens=6, temperature=1.5, seed=7)
    x = eng.generate(["Once upon a time"], hot)[0]["token_ids"]
    y = eng.generate(["Once upon a time"], hot)[0]["token_ids"]
    assert x == y  # the seed fixes the draw
    narrow = eng.generate(["Once upon a time"], SamplingParams(max_tokens=5, temperature=1.0, top_p=1e-6))[0]
    assert narrow["token_ids"] == a["token_ids"]  # top_p that keeps one token is greedy
    static = Engine(model, num_blocks=32, block_size=8, max_num_seqs=2, tokenizer=tok, kernels="torch",
                    policy="static")
    prompts = prompts_of(6, [4, 9, 6])
    assert [r["token_ids"] for r in static.generate(prompts, SamplingParams(max_tokens=4))] == \
        reference(model, prompts, 4)
    # static batching never admits while a batch runs
    assert all(row["running"] <= 2 for row in static.step_log)


def test_requests_that_can_never_run_are_refused(lab):
    model, tok = lab
    eng = Engine(model, num_blocks=4, block_size=4, tokenizer=tok, kernels="torch")
    with pytest.raises(ValueError, match="could never finish"):
        eng.add_request(list(range(5, 15)), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="context"):
        eng.add_request([5] * model.config.max_position_embeddings)   # fills the whole context
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([])
    with pytest.raises(ValueError, match="token ids must lie"):
        eng.add_request([5000])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="policy"):
        Scheduler(BlockManager(4, 4), 8, 2, policy="fifo")


def test_finishes_on_eos_like_generate(lab):
    model, tok = lab
    # a pass-key question: lab-target answers the key and then ends the answer with EOS (a trained task)
    prompt = tok("The pass key is 4821. What is the pass key? The pass key is")["input_ids"]
    want = reference(model, [prompt], 60)[0]
    assert want[-1] == tok.eos_token_id and len(want) < 60
    eng = Engine(model, num_blocks=16, block_size=8, tokenizer=tok, kernels="torch")
    got = eng.generate([prompt], SamplingParams(max_tokens=60))[0]
    assert got["token_ids"] == want and got["finish_reason"] == "stop"
    more = eng.generate([prompt], SamplingParams(max_tokens=len(want) + 3, ignore_eos=True))[0]
    assert more["token_ids"][:len(want)] == want and more["finish_reason"] == "length"


@pytest.mark.parametrize("policy", ["value", "attention", "recency", "random"])
def test_evicting_blocks_equals_masking_those_positions(lab, policy):
    """Eviction in pages (10.3.10): after dropping whole blocks, later tokens attend to the kept keys only, at
    their true positions. The same computation in transformers: a 4-D mask that hides the dropped positions
    from every query after the eviction point (the earlier queries saw everything, as in the engine)."""
    model, tok = lab
    prompt = prompts_of(8, [40])[0]
    eng = Engine(model, num_blocks=16, block_size=4, max_num_batched_tokens=39, max_num_seqs=1, tokenizer=tok,
                 kernels="torch")
    eng.record_queries = 8
    rid = eng.add_request(prompt, SamplingParams(max_tokens=6))
    eng.step()  # all but the last prompt token
    table = eng.blocks.block_table(rid)
    freed = eng.evict_blocks(rid, 3, policy=policy, generator=torch.Generator().manual_seed(0))
    gone = [i for i, b in enumerate(table) if b in freed]
    assert len(gone) == 3 and 0 not in gone and len(table) - 1 not in gone
    assert eng.blocks.num_free_blocks == 16 - (len(table) - 3)
    while eng.has_unfinished():
        eng.step()
    eng.blocks.check_invariants()
    hidden = torch.zeros(80, dtype=torch.bool)
    for i in gone:
        hidden[i * 4:(i + 1) * 4] = True
    ids = list(prompt)
    for _ in range(6):
        t = len(ids)
        visible = torch.tril(torch.ones(t, t, dtype=torch.bool))
        visible[39:, :] &= ~hidden[:t]
        mask = torch.zeros(1, 1, t, t).masked_fill(~visible, float("-inf"))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), attention_mask=mask).logits[0, -1]
        ids.append(int(logits.argmax()))
    assert eng.seqs[rid].output == ids[40:]


def test_block_policies_drop_what_they_say(lab):
    """Recency drops the oldest blocks after the first (StreamingLLM's sinks and window, in pages); attention
    drops by the value-aware score with the value and recency exponents at 0."""
    model, tok = lab
    prompt = prompts_of(10, [40])[0]

    def prefilled():
        eng = Engine(model, num_blocks=16, block_size=4, max_num_batched_tokens=40, max_num_seqs=1, tokenizer=tok,
                     kernels="torch")
        eng.record_queries = 8
        rid = eng.add_request(prompt, SamplingParams(max_tokens=2))
        eng.step()
        return eng, rid

    eng, rid = prefilled()
    table = eng.blocks.block_table(rid)
    assert eng.evict_blocks(rid, 3, policy="recency") == sorted(table[1:4])
    eng, rid = prefilled()
    table = eng.blocks.block_table(rid)
    scores = eng.block_scores(rid, beta=0.0, gamma=0.0)
    lowest = sorted(range(1, len(table) - 1), key=lambda i: float(scores[i]))[:3]
    assert eng.evict_blocks(rid, 3, policy="attention") == sorted(table[i] for i in lowest)


def test_blocks_to_keep_matches_chapter_6s_token_budget_within_half_a_block():
    from labsrc.kv_eviction import budget_for
    from labsrc.serving.experiments import blocks_to_keep

    for n in (17, 100, 915, 921, 1024):
        for kept in (0.1, 0.3, 0.5, 0.7, 0.9):
            k = blocks_to_keep(n, kept, 16)
            last = n - (-(-n // 16) - 1) * 16
            tokens = (k - 1) * 16 + last
            assert 2 <= k <= -(-n // 16)
            assert k == 2 or abs(tokens - budget_for(n, 1 - kept)) <= 8, (n, kept, k)
    with pytest.raises(ValueError, match="kept"):
        blocks_to_keep(100, 1.0, 16)


def test_eviction_refuses_protected_blocks(lab):
    model, tok = lab
    eng = Engine(model, num_blocks=16, block_size=4, max_num_batched_tokens=11, tokenizer=tok, kernels="torch")
    rid = eng.add_request(prompts_of(9, [12])[0], SamplingParams(max_tokens=2))
    eng.step()
    with pytest.raises(ValueError, match="n_blocks must lie"):
        eng.evict_blocks(rid, 2, policy="random")  # 3 blocks: the first and the last are protected
    with pytest.raises(ValueError, match="policy"):
        eng.evict_blocks(rid, 1, policy="lru")
    with pytest.raises(ValueError, match="recorded queries"):
        eng.evict_blocks(rid, 1, policy="value")
    with pytest.raises(ValueError, match="never the last"):
        eng.blocks.drop_blocks(rid, [2])


def test_kernels_default_follows_the_models_device(lab, monkeypatch):
    """The default follows where the model's tensors are, not what the machine has: a CPU model on a CUDA
    machine gets the PyTorch steps (it used to get Triton, whose compiled kernels cannot read CPU tensors)."""
    from labsrc import runtime

    model, tok = lab
    assert next(model.parameters()).device.type == "cpu"
    eng = Engine(model, num_blocks=8, block_size=4, tokenizer=tok)
    assert eng.kernels == "torch"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine...
    monkeypatch.setattr(runtime, "HAS_CUDA", True)
    eng = Engine(model, num_blocks=8, block_size=4, tokenizer=tok)
    assert eng.kernels == "torch"  # ...and still the model's device decides
    monkeypatch.setattr(runtime, "INTERPRETED", False)  # compiled Triton, CPU tensors: refused by name
    with pytest.raises(ValueError, match="kernels='triton' needs the model on a CUDA device"):
        Engine(model, num_blocks=8, block_size=4, tokenizer=tok, kernels="triton")


def test_step_log_is_bounded(lab):
    """A served engine steps for days: its step log keeps the latest ``step_log_size`` rows and counts all."""
    model, tok = lab
    eng = Engine(model, num_blocks=32, block_size=4, tokenizer=tok, kernels="torch", step_log_size=3)
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert eng.num_steps == 8 and len(eng.step_log) == 3
    assert [r["decode_seqs"] for r in eng.step_log] == [1, 1, 1]
    with pytest.raises(ValueError, match="step_log_size"):
        Engine(model, num_blocks=8, block_size=4, tokenizer=tok, kernels="torch", step_log_size=0)
    # a replay keeps its own trace's rows, all of them, whatever the engine's log keeps
    from labsrc.serving import experiments as X

    trace = [dict(arrival=0, prompt=[5, 6, 7, 8], max_tokens=4), dict(arrival=2, prompt=[9, 10], max_tokens=3)]
    run = X.replay(eng, trace)
    assert len(run["log"]) > len(eng.step_log) == 3
    assert run["prefill_tokens"] == 6 and sum(r["decode_seqs"] for r in run["log"]) == 4 + 3 - 2


def test_bad_prompts_and_params_lists_are_named(lab):
    """A params list of the wrong length used to drop prompts silently (zip), and a tensor prompt failed with
    'Boolean value of Tensor ... is ambiguous'. Both are refused by name, and nothing stays queued."""
    import numpy as np

    model, tok = lab
    eng = Engine(model, num_blocks=16, block_size=4, tokenizer=tok, kernels="torch")
    with pytest.raises(ValueError, match="params has 1 entries but there are 2 prompts"):
        eng.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=2)])
    for bad in (torch.tensor([5, 6, 7]), np.array([5, 6, 7]), torch.tensor([[5, 6]])):
        with pytest.raises(TypeError, match=r"prompts? must be .*tolist\(\)"):
            eng.generate(bad)
        with pytest.raises(TypeError, match=r"prompt must be .*tolist\(\)"):
            eng.add_request(bad)
    with pytest.raises(TypeError, match="prompt must be a str or a list of token ids"):
        eng.generate([[5, 6], torch.tensor([7, 8])])
    with pytest.raises(TypeError, match="token ids must be ints"):
        eng.add_request([5, 6.0])
    with pytest.raises(ValueError, match="token ids must lie"):  # the first prompt is queued, then taken back
        eng.generate([[5, 6], [9999]])
    assert not eng.has_unfinished() and not eng.seqs and eng.blocks.num_free_blocks == 16
    for kw in (dict(temperature=float("inf")), dict(temperature=float("nan")), dict(top_p=float("nan")),
               dict(seed=2 ** 64), dict(seed=-1), dict(logprobs=21)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)


def test_extreme_temperatures_sample_without_error(lab):
    """A temperature at the edge of the float range used to give inf / inf = NaN probabilities and made the
    whole step raise: now a tiny temperature is the argmax limit and a huge one samples, for every request."""
    model, tok = lab
    prompts = prompts_of(11, [5, 7])
    eng = Engine(model, num_blocks=16, block_size=4, tokenizer=tok, kernels="torch")
    got = eng.generate(prompts, [SamplingParams(max_tokens=4, temperature=5e-324, seed=1, ignore_eos=True),
                                 SamplingParams(max_tokens=4, temperature=1e308, seed=2, ignore_eos=True)])
    assert [r["finish_reason"] for r in got] == ["length", "length"]
    assert got[0]["token_ids"] == reference(model, prompts[:1], 4)[0]  # the argmax limit is greedy


def test_a_failing_sequence_is_finished_alone_and_the_engine_stays_consistent(lab, monkeypatch):
    """A sampling failure in one sequence finishes it with 'error'; the others produce their greedy tokens. A
    forward that raises leaves nothing marked computed: the next step runs the same tokens, and the outputs
    still equal generate's (before, the next valid call failed with an unrelated error)."""
    from labsrc.serving import engine as engine_module

    model, tok = lab
    prompts = prompts_of(12, [6, 9, 5])
    want = reference(model, prompts, 5)
    eng = Engine(model, num_blocks=32, block_size=4, tokenizer=tok, kernels="torch")
    real = engine_module._sample

    def failing(logits, params, generator):
        if params.seed == 666:
            raise RuntimeError("sampling exploded")
        return real(logits, params, generator)

    monkeypatch.setattr(engine_module, "_sample", failing)
    got = eng.generate(prompts, [SamplingParams(max_tokens=5, ignore_eos=True),
                                 SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.0, seed=666),
                                 SamplingParams(max_tokens=5, ignore_eos=True)])
    assert got[1]["finish_reason"] == "error" and "sampling exploded" in got[1]["error"]
    assert [got[0]["token_ids"], got[2]["token_ids"]] == [want[0], want[2]]
    assert eng.blocks.num_free_blocks == 32 and not eng.has_unfinished()
    eng.blocks.check_invariants()

    calls = {"n": 0}

    def boom(module, args):
        calls["n"] += 1
        if calls["n"] in (2, 5):  # a prefill step and a decode step fail once each
            raise RuntimeError("a fault inside the forward")

    handle = model.model.layers[3].register_forward_pre_hook(boom)
    try:
        ids = [eng.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in prompts]
        failures = 0
        while eng.has_unfinished():
            try:
                eng.step()
            except RuntimeError as err:
                assert "fault inside" in str(err)
                failures += 1
    finally:
        handle.remove()
    assert failures == 2
    assert [eng.result(i)["token_ids"] for i in ids] == want
    assert eng.blocks.num_free_blocks == 32
    eng.blocks.check_invariants()


def test_abort_frees_slot_and_blocks(lab):
    model, tok = lab
    eng = Engine(model, num_blocks=16, block_size=4, max_num_seqs=1, tokenizer=tok, kernels="torch")
    a = eng.add_request(prompts_of(13, [9])[0], SamplingParams(max_tokens=20, ignore_eos=True))
    b = eng.add_request(prompts_of(14, [5])[0], SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()
    assert eng.blocks.num_free_blocks < 16
    eng.abort(a)  # running
    assert eng.seqs[a].finish_reason == "abort" and eng.blocks.num_free_blocks == 16
    while eng.has_unfinished():
        eng.step()
    assert eng.result(b)["token_ids"] == reference(model, prompts_of(14, [5]), 3)[0]
    c = eng.add_request([5, 6, 7])
    eng.abort(c)  # waiting
    eng.abort(c)  # twice: nothing
    assert not eng.has_unfinished() and eng.blocks.num_free_blocks == 16


def test_logprobs_equal_log_softmax_of_the_full_forward(lab):
    """Generated and prompt log-probabilities (with a prefix-cache hit that must be bypassed) against the
    log-softmax of one plain forward of prompt + output."""
    model, tok = lab
    prompt = prompts_of(15, [13])[0]
    eng = Engine(model, num_blocks=32, block_size=4, max_num_batched_tokens=5, tokenizer=tok, kernels="torch")
    eng.generate([prompt], SamplingParams(max_tokens=1))  # publishes the prompt's blocks
    got = eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3,
                                                prompt_logprobs=True))[0]
    full = prompt + got["token_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)
    assert got["prompt_logprobs"][0] is None
    for p in range(1, len(prompt)):
        value, top = got["prompt_logprobs"][p]
        assert value == pytest.approx(float(lp[p - 1, prompt[p]]), abs=1e-4)
        assert list(top) == torch.topk(lp[p - 1], 3).indices.tolist()
    for i, (value, top) in enumerate(got["logprobs"]):
        at = len(prompt) + i - 1
        assert value == pytest.approx(float(lp[at, full[at + 1]]), abs=1e-4)
        assert max(top.values()) == pytest.approx(float(lp[at].max()), abs=1e-4)


def test_batched_torch_attention_equals_the_paged_references():
    """The engine's PyTorch path (all decodes in one gather and one SDPA call; a prefill chunk in one fused
    call) against the per-sequence references of labsrc.kernels.serving, on shuffled, partly filled
    tables and a chunk that starts mid-sequence."""
    from labsrc.kernels import serving as pa
    from labsrc.serving import engine as em

    g = torch.Generator().manual_seed(3)
    nb, bs, hkv, hq, d = 20, 4, 2, 8, 40
    kp, vp = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    lens = [1, 7, 13, 4]
    perm = torch.randperm(nb, generator=g).tolist()
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at:at + -(-n // bs)])
        at += -(-n // bs)
    width = max(map(len, tables))
    tab = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g)
    longest = max(lens)
    pos = torch.arange(longest)
    mask = pos[None] < lens_t.long()[:, None]
    slots = torch.where(mask, tab.long().gather(1, (pos // bs).clamp(max=width - 1).expand(len(lens), -1)) * bs
                        + pos % bs, 0)
    got = em.batched_decode_attention(q, kp, vp, slots, mask, 0.3)
    torch.testing.assert_close(got, pa.paged_decode_attention_ref(q, kp, vp, tab, lens_t, sm_scale=0.3))
    qc = torch.randn(hq, 5, d, generator=g)
    for ctx in (5, 13):  # a whole prompt, and a chunk after 8 cached tokens
        torch.testing.assert_close(em.prefill_attention(qc, kp, vp, tab[2], ctx, sm_scale=0.3),
                                   pa.paged_prefill_attention_ref(qc, kp, vp, tab[2], ctx, sm_scale=0.3))


def test_bench_compare_checks_outputs_on_a_small_workload():
    """The --compare bench runs all three systems and checks the engine against per-prompt generate (a smoke
    run on four short requests; the speed table is for the bench, not a test)."""
    from labsrc.serving.bench import compare, format_compare

    r = compare("lab-target", n=4, prompt_range=(8, 20), output_range=(2, 4), reps=2)
    assert r["same_as_generate"]["engine"] == 4 and set(r["tokens_per_s"]) == {"engine", "padded generate",
                                                                              "generate_batch"}
    assert all(len(v) == 2 and min(v) > 0 for v in r["runs"].values())
    assert "| engine | 4 of 4 |" in format_compare(r)
    with pytest.raises(ValueError, match="reps"):
        compare("lab-target", reps=1)
