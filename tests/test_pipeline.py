"""Pipeline speculative decoding (labsrc.pipeline): the layer split, the stage caches, the verdicts, the
greedy identity with target.generate on one process and on two gloo ranks (both schedules), a rank that
raises or hangs failing the launch instead of hanging it, and the simulator against hand-computed
schedules."""
import labsrc  # noqa: F401

import itertools
import time

import pytest
import torch

from labsrc import pipeline
from labsrc.models import load
from labsrc.pipeline import schedule as sch
from labsrc.pipeline.simulate import (bubble_fraction, busy_fraction, expected_committed, simulate,
                                      source_throughput_max, source_time_per_token, stage_times_from)
from labsrc.pipeline.stages import Stage, StageCache, split_layers

N_NEW = 16


@pytest.fixture(scope="module")
def models():
    target, tok = load("lab-target")
    draft, _ = load("lab-draft")
    prompts = pipeline.corpus_prompts(tok, 3, length=20)
    refs = [target.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=tok.pad_token_id)[0, len(p):].tolist() for p in prompts]
    return target, draft, prompts, refs


# ------------------------------------------------------------------------------------------- layer split

def test_even_split_is_contiguous_and_balanced():
    assert split_layers(6, 2) == [range(0, 3), range(3, 6)]
    assert split_layers(80, 8)[3] == range(30, 40)
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_layers(5, 5) == [range(i, i + 1) for i in range(5)]


def test_weighted_split_minimises_the_largest_stage():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        L, P = int(torch.randint(2, 9, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen))
        P = min(P, L)
        w = (torch.rand(L, generator=gen) * 10).tolist()
        got = split_layers(L, P, w)
        assert [r.start for r in got][0] == 0 and got[-1].stop == L
        assert all(a.stop == b.start and len(a) > 0 for a, b in zip(got, got[1:]))
        best = min(max(sum(w[a:b]) for a, b in zip((0,) + cuts, cuts + (L,)))
                   for cuts in itertools.combinations(range(1, L), P - 1))
        assert max(sum(w[r.start:r.stop]) for r in got) == pytest.approx(best)


@pytest.mark.parametrize("args,words", [((0, 1), "n_layers"), ((3, 0), "stages"), ((2, 3), "must not exceed"),
                                        ((3, 2, [1, 2]), "weights"), ((3, 2, [1, -1, 2]), "weights")])
def test_split_errors(args, words):
    with pytest.raises(ValueError, match=words):
        split_layers(*args)


# ---------------------------------------------------------------------------------------- stages, caches

def test_stage_cache_crop_and_update():
    c = StageCache()
    k = torch.randn(1, 2, 5, 4)
    c.update(k, k, 3)
    c.update(k[:, :, :2], k[:, :, :2], 3)
    assert c.length() == 7
    c.crop(4)
    assert c.length() == 4 and torch.equal(c.keys[3], k[:, :, :4])


def test_split_stages_with_rollback_equal_one_forward(models):
    """Windows through two stages, one of them rejected and overwritten, give the logits of one forward
    pass over the final sequence."""
    target, _, prompts, refs = models
    seq = torch.tensor(prompts[0] + refs[0])
    stages = [Stage(target, r, i == 0, i == 1) for i, r in enumerate(split_layers(6, 2))]

    def run(pos, ids):
        h = ids
        for s in stages:
            h = s.forward(0, pos, h)
        return h

    n = len(prompts[0])
    run(0, seq[:n])
    run(n, torch.tensor([1, 2, 3, 4]))                 # a window that is then rejected at its first token
    a = run(n, seq[n:n + 6])                            # the correction overwrites it
    b = run(n + 6, seq[n + 6:])
    with torch.no_grad():
        full = target(seq[None]).logits[0]
    assert torch.allclose(torch.cat([a, b]), full[n:], atol=1e-4)
    with pytest.raises(RuntimeError, match="hole"):
        run(len(seq) + 3, torch.tensor([5]))


def test_last_stage_verdicts_by_hand():
    last = sch.LastStage("reference")

    def logits_for(preds, V=10):
        x = torch.zeros(len(preds), V)
        x[torch.arange(len(preds)), torch.tensor(preds)] = 1.0
        return x

    assert last.verdict(sch.PREFILL, 0, 0, 0, 0, [4, 4, 4], logits_for([1, 1, 7])) == [0, 0, 0, 3, 7, 1]
    # target wants 7 next, then 2, 3, 9: a window 7 2 5 accepts two and corrects to 3
    assert last.verdict(sch.WINDOW, 0, 0, 3, 1, [7, 2, 5], logits_for([2, 3, 9])) == [0, 0, 1, 2, 3, 0]
    assert last.stale(0, 0) and not last.stale(0, 1)
    # the next window starts with the correction at position 5; all accepted: the prediction comes back
    assert last.verdict(sch.WINDOW, 0, 1, 5, 2, [3, 6], logits_for([6, 8])) == [0, 1, 2, 2, 8, 1]
    with pytest.raises(RuntimeError, match="expects 7"):
        last.verdict(sch.WINDOW, 0, 1, 9, 3, [8], logits_for([1]))


# ------------------------------------------------------------------------------------- greedy identity

@pytest.mark.parametrize("schedule,k", [("plain", 3), ("overlapped", 5)])
def test_one_stage_equals_target_generate(models, schedule, k):
    target, draft, prompts, refs = models
    res = pipeline.run_local(prompts, target, draft, k=k, schedule=schedule, max_new_tokens=N_NEW)
    assert res["outputs"] == refs
    # every output token was committed by a reply: the prefill's commits the first, windows the rest (a window
    # may commit past N_NEW, which is cut off)
    committed = sum(w["committed"] for w in res["windows"])
    assert committed >= len(prompts) * N_NEW
    assert sum(w["committed"] for w in res["windows"] if w["kind"] == "prefill") == len(prompts)


def test_one_stage_equals_chapter_10_speculative_generate(models):
    """The same greedy tokens as chapter 10's single-process speculative decoding (which is itself checked
    against generate() and transformers' assisted generation)."""
    from labsrc.speculative import speculative_generate

    target, draft, prompts, _ = models
    res = pipeline.run_local(prompts[:2], target, draft, k=4, schedule="plain", max_new_tokens=N_NEW)
    for p, out in zip(prompts[:2], res["outputs"]):
        ids, _ = speculative_generate(target, draft, torch.tensor(p), N_NEW, k=4, stop_at_eos=False)
        assert out == ids[0, len(p):].tolist()


def test_last_stage_agrees_with_chapter_10_greedy_verify():
    """Our verdict (accepted drafts, then the correction or next token) equals labsrc.speculative.verify
    with greedy=True on random windows: the window is [pending token, k drafts]."""
    from labsrc.speculative import verify

    gen = torch.Generator().manual_seed(3)
    for trial in range(30):
        k, V = int(torch.randint(1, 7, (1,), generator=gen)), 11
        target_logits = torch.randn(k + 1, V, generator=gen)
        preds = target_logits.argmax(-1)
        drafts = torch.where(torch.rand(k, generator=gen) < 0.6, preds[:k], torch.randint(0, V, (k,), generator=gen))
        want_tokens, want_n = verify(drafts, torch.full((k, V), 1.0 / V), target_logits.softmax(-1), greedy=True)
        last = sch.LastStage("kernel")
        last.pending[0], last.pos_next[0], last.epoch[0] = 5, 10, 0
        # window = [the known next token 5, drafts]: logits row i is the target after window token i
        verdict = last.verdict(sch.WINDOW, 0, 0, 10, 0, [5] + drafts.tolist(), target_logits)
        accepted, token = verdict[3], verdict[4]
        got = drafts[:accepted - 1].tolist() + [token]
        assert accepted - 1 == want_n and got == want_tokens.tolist()


def test_two_gloo_ranks_equal_target_generate_both_schedules(models):
    _, _, prompts, refs = models
    jobs = [dict(k=3, schedule="plain", max_new_tokens=N_NEW),
            dict(k=4, schedule="overlapped", depth=2, max_new_tokens=N_NEW),
            dict(k=2, schedule="overlapped", depth=1, max_new_tokens=N_NEW)]
    results = pipeline.sweep(prompts, jobs, stages=2, verify="kernel", timeout=60)
    for job, res in zip(jobs, results):
        assert res["outputs"] == refs, job
        assert res["layers"] == [[0, 3], [3, 6]]
        # each rank holds only its slice: together about one model (rank 0 the embeddings, rank 1 the head)
        total = sum(p.numel() * p.element_size() for p in models[0].parameters())
        assert all(b < 0.75 * total for b in res["param_bytes"]) and sum(res["param_bytes"]) == total
        ranks = res["timelines"]
        assert {e[0] for e in ranks[0]} >= {"draft", "forward"} and {e[0] for e in ranks[1]} >= {"verify"}
        assert 0 < bubble_fraction(ranks, res["wall"]) < 1 and res["comm"] > 0
    # the overlapped schedule with two windows in flight speculates, so some windows are discarded
    assert results[1]["discarded"] and not results[0]["discarded"]


def test_a_rank_that_raises_fails_the_launch_with_its_error(models):
    _, _, prompts, _ = models
    t = time.monotonic()
    with pytest.raises(pipeline.PipelineError, match=r"(?s)rank 1 of 2 failed.*injected failure"):
        pipeline.generate(prompts[:1], stages=2, k=2, max_new_tokens=8, timeout=30,
                          fault=dict(rank=1, mode="raise", after=2))
    assert time.monotonic() - t < 120


def test_a_rank_that_hangs_fails_the_launch_after_the_timeout(models):
    """Rank 1 hangs in its second window: rank 0, waiting for the verdict, times out after 4 s (the
    rendezvous before it has its own, longer timeout) and the launcher reports it, rank 1 still running."""
    _, _, prompts, _ = models
    with pytest.raises(pipeline.PipelineError) as err:
        pipeline.generate(prompts[:1], stages=2, k=2, max_new_tokens=8, timeout=4,
                          fault=dict(rank=1, mode="hang", after=1))
    message = str(err.value)
    print(message[-1500:])
    assert "rank 0 of 2 failed (ranks still running: [1])" in message
    assert "run_stage0" in message and "timed out" in message.lower()


@pytest.mark.parametrize("kwargs,words", [(dict(prompts=[]), "prompts"), (dict(prompts=[[1, -2]]), "prompts"),
                                          (dict(stages=0), "stages"), (dict(schedule="fast"), "schedule"),
                                          (dict(k=0), "k must"), (dict(verify="gpu"), "verify")])
def test_generate_refuses_bad_arguments_before_launching(kwargs, words):
    args = dict(prompts=[[1, 2, 3]], stages=1, k=2, schedule="plain")
    args.update(kwargs)
    with pytest.raises(ValueError, match=words):
        pipeline.generate(args.pop("prompts"), **args)


@pytest.mark.parametrize("kwargs,words", [
    (dict(k=0), "k must"), (dict(k=-3), "k must"), (dict(k=2.5), "k must"), (dict(k=True), "k must"),
    (dict(depth=0), "depth must"), (dict(depth=None), "depth must"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens="8"), "max_new_tokens"), (dict(schedule="fast"), "schedule"), (dict(verify="gpu"), "verify"),
])
def test_run_local_refuses_what_sweep_refuses(kwargs, words):
    """run_local accepted k=0, depth=0 and max_new_tokens=0 (and ran, or failed deep inside); it now checks its
    job with the same function as sweep, before touching the models (None stands in for them here)."""
    args = dict(k=2, schedule="plain", max_new_tokens=4, depth=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=words):
        pipeline.run_local([[1, 2, 3]], None, None, **args)
    if "verify" not in kwargs:
        with pytest.raises(ValueError, match=words):
            pipeline.sweep([[1, 2, 3]], [dict(args)], stages=1)


def _listening_addresses(port):
    """Local addresses of the sockets listening on ``port`` (hex, as /proc/net/tcp{,6} write them)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            addr, p = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(p, 16) == port:       # 0A: LISTEN
                out.append(addr)
    return out


@pytest.mark.skipif(not __import__("os").path.exists("/proc/net/tcp"), reason="reads Linux's socket tables")
def test_rendezvous_store_listens_on_loopback_only():
    """torch's TCPStore server binds every interface; the pipeline's store must listen on 127.0.0.1 alone."""
    from datetime import timedelta

    port = pipeline.free_port()
    store = pipeline.loopback_store(port, 1, 0, timedelta(seconds=10))
    store.set("probe", "1")
    assert store.get("probe") == b"1"
    addrs = _listening_addresses(port)
    assert addrs, "the store listens on the port"
    assert set(addrs) == {"0100007F"}, f"listening on {addrs}, not only 127.0.0.1"
    del store


# ------------------------------------------------------------------------------------------- simulator

def test_simulated_plain_schedule_by_hand():
    """Cycle = draft k * 0.25 + stage 0 1.0 + hop 0.1 + stage 1 1.0 + verdict back 0.1 = 3.2 s; each window
    accepts all 4 drafts and gains the target's next token: 5 tokens, 2 windows for 10."""
    r = simulate([1.0, 1.0], 0.25, 0.1, k=4, alpha=1.0, schedule="plain", tokens=10, accept=lambda s, i: 4)
    assert r["time"] == pytest.approx(6.4) and r["tokens"] == 10 and r["windows"] == 2
    assert r["busy"] == pytest.approx([4 / 6.4, 2 / 6.4])
    assert r["bubble"] == pytest.approx(1 - (4 + 2) / 12.8)


def test_simulated_micro_batches_by_hand():
    """Two sequences, one window each in flight: stage 0 is busy 0-2, 2-4, 4-6, 6-8 and stage 1 at 2-3,
    4-5, 6-7, 8-9, so the run ends at 9 s instead of the plain schedule's 4 x 3 = 12 s."""
    over = simulate([1.0, 1.0], 0.25, 0.0, k=4, alpha=1.0, micro_batches=2, depth=1, tokens=10,
                    accept=lambda s, i: 4)
    plain = simulate([1.0, 1.0], 0.25, 0.0, k=4, alpha=1.0, micro_batches=2, schedule="plain", tokens=10,
                     accept=lambda s, i: 4)
    assert over["time"] == pytest.approx(9.0) and plain["time"] == pytest.approx(12.0)
    assert [e[1:3] for e in over["timelines"][1]] == [(2, 3), (4, 5), (6, 7), (8, 9)]


def test_simulated_stale_window_by_hand():
    """Depth 2, one sequence: window 0 (drafted 0-1, stage 0 1-2, stage 1 2-3) is rejected at its first
    draft; window 1, sent at 4 behind it, is stale: stage 1 skips it and stage 0 discards it when the
    verdict arrives (3, seen at 4). Window 2 (4-7) accepts both drafts: 1 + 2 + 1 tokens by 7 s."""
    r = simulate([1.0, 1.0], 0.5, 0.0, k=2, alpha=0.5, depth=2, tokens=2, accept=lambda s, i: [0, 2][i])
    assert r["time"] == pytest.approx(7.0) and r["windows"] == 3 and r["stale"] == 1
    assert [e[0] for e in r["timelines"][1]] == ["verify", "skip", "verify"]


def test_simulated_one_stage_is_draft_plus_target():
    r = simulate([2.0], 0.1, 5.0, k=3, alpha=1.0, tokens=8, accept=lambda s, i: 3)   # comm unused at P = 1
    assert r["time"] == pytest.approx(2 * 2.3) and r["busy"] == [pytest.approx(1.0)]


def test_simulated_tokens_per_window_match_the_closed_form():
    for alpha, k in ((0.6, 4), (0.85, 8)):
        r = simulate([1.0], 0.0, 0.0, k=k, alpha=alpha, schedule="plain", tokens=3000, seed=1)
        assert r["tokens"] / r["windows"] == pytest.approx(expected_committed(alpha, k), rel=0.05)


def test_closed_forms_by_hand():
    assert expected_committed(0.0, 5) == 1.0 and expected_committed(1.0, 5) == 6.0
    assert expected_committed(0.5, 2) == pytest.approx(1.75)
    assert source_time_per_token(0.05, 4, 0.032, 0.001, 4.0) == pytest.approx(0.033 / 4)
    assert source_time_per_token(0.05, 2, 0.010, 0.0, 2.0) == pytest.approx(0.0125)
    assert source_throughput_max(0.05, 4, 6.6) == pytest.approx(528.0)


def test_busy_and_bubble_fractions_ignore_waits_and_skips():
    ranks = [[("draft", 0, 1, 0, 0), ("forward", 1, 2, 0, 0), ("wait", 2, 4, -1, -1)],
             [("verify", 2, 3, 0, 0), ("skip", 3, 3, 0, 1)]]
    assert busy_fraction(ranks[0], 4) == 0.5 and bubble_fraction(ranks, 4) == pytest.approx(1 - 3 / 8)
    st = stage_times_from([[("forward", 0, 1, 0, 0), ("draft", 1, 3, 0, 1), ("forward", 3, 4.5, 0, 1)],
                           [("verify", 1, 1.5, 0, 0), ("verify", 5, 5.25, 0, 1)]], k=4)
    assert st == dict(stage_times=[1.5, 0.25], draft_time=0.5)


@pytest.mark.parametrize("kwargs,words", [(dict(P=3), "stage_times must hold"), (dict(alpha=1.5), "alpha"),
                                          (dict(k=0), "k must"), (dict(schedule="x"), "schedule"),
                                          (dict(draft_time=-1.0), "draft_time")])
def test_simulator_errors(kwargs, words):
    args = dict(stage_times=[1.0, 1.0], draft_time=0.1, comm_time=0.0, k=2, alpha=0.5)
    args.update(kwargs)
    with pytest.raises(ValueError, match=words):
        simulate(**args)
