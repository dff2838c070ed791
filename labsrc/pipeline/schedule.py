"""What each rank of the pipeline does: stage 0 drafts and schedules, the others forward, the last verifies.

The target processes a *stream* of tokens, cut into windows. A window is ``(seq, epoch, pos, tokens)``: the
tokens of sequence ``seq`` at positions ``pos .. pos + n - 1``. Every stage runs it through its layers (its
cache first cropped to ``pos``) and sends the hidden states on; the last stage compares each window token
with the token the target wanted there (:func:`labsrc.kernels.pipeline.greedy_verify`) and replies to stage 0
with how many were accepted and the target's next token (a correction, or the prediction after a fully
accepted window). The last stage keeps, per sequence, the prediction for the next position (``pending``).

Stage 0 keeps, per sequence, the confirmed tokens ``ctx`` and the speculative ``stream`` beyond them. It
launches a window when the schedule allows:

* ``plain``: one window in flight in the whole pipeline (draft, send, wait for the verdict): speculative
  decoding with its layers split over stages, bubbles included;
* ``overlapped``: up to ``depth`` windows in flight per sequence (stage 0 drafts cycle ``n + 1`` as if cycle
  ``n`` were fully accepted) and every sequence in flight at once (micro-batches, round robin). A
  rejection bumps the sequence's ``epoch``: windows sent after the rejected one are stale; the middle
  stages still compute them (they cannot know), the last stage skips them and stage 0 discards them.

Greedy output is the target's own greedy continuation whatever the schedule: every committed token is one
the target's argmax chose.
"""
from __future__ import annotations

import time
from collections import deque

import torch

WINDOW, PREFILL, END = 0, 1, 2
_HEADER = 6   # kind, seq, epoch, pos, n, wid; the window's tokens follow


class _Link:
    """Point-to-point messages between neighbouring ranks (``torch.distributed`` send/recv)."""

    def __init__(self, rank: int, world: int, width: int, hidden: int, dtype, device):
        import torch.distributed as dist

        self.dist, self.rank, self.world = dist, rank, world
        self.width, self.hidden, self.dtype, self.device = width, hidden, dtype, device
        self.pending_sends = []

    def _isend(self, tensor, dst):
        self.pending_sends.append((self.dist.isend(tensor, dst), tensor))
        if len(self.pending_sends) > 64:
            work, _ = self.pending_sends.pop(0)
            work.wait()

    def send_window(self, header: list[int], tokens: list[int], hidden: torch.Tensor | None) -> None:
        msg = torch.full((self.width,), -1, dtype=torch.int64)
        msg[:_HEADER] = torch.tensor(header)
        if tokens:
            msg[_HEADER:_HEADER + len(tokens)] = torch.tensor(tokens)
        self._isend(msg.to(self.device), self.rank + 1)
        if hidden is not None:
            self._isend(hidden.to(self.dtype).contiguous(), self.rank + 1)

    def recv_window(self):
        msg = torch.empty(self.width, dtype=torch.int64, device=self.device)
        self.dist.recv(msg, self.rank - 1)
        msg = msg.cpu()
        kind, seq, epoch, pos, n, wid = (int(v) for v in msg[:_HEADER])
        tokens = msg[_HEADER:_HEADER + n].tolist() if kind != END else []
        hidden = None
        if kind != END:
            hidden = torch.empty(n, self.hidden, dtype=self.dtype, device=self.device)
            self.dist.recv(hidden, self.rank - 1)
        return kind, seq, epoch, pos, n, wid, tokens, hidden

    def send_reply(self, reply: list[int]) -> None:
        self._isend(torch.tensor(reply, dtype=torch.int64, device=self.device), 0)

    def post_reply(self):
        buf = torch.empty(6, dtype=torch.int64, device=self.device)
        return self.dist.irecv(buf, self.world - 1), buf

    def flush(self):
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends.clear()


class Timeline:
    """``(what, start, end, seq, wid)`` events in seconds since the job started on this rank."""

    def __init__(self, t0: float):
        self.t0, self.events = t0, []

    def add(self, what: str, start: float, seq: int = -1, wid: int = -1) -> float:
        end = time.perf_counter()
        self.events.append((what, start - self.t0, end - self.t0, seq, wid))
        return end


def verify_window(logits: torch.Tensor, tokens: list[int], first: int, impl: str):
    """``(preds, accepted)`` for one window on the last stage: the Triton kernel or its reference."""
    from labsrc.kernels.pipeline import greedy_verify, greedy_verify_ref

    fn = greedy_verify if impl == "kernel" else greedy_verify_ref
    preds, accepted = fn(logits[None], torch.tensor([tokens], device=logits.device),
                         torch.tensor([first], device=logits.device))
    return preds[0].tolist(), int(accepted[0])


class LastStage:
    """The verdict side: per sequence the target's pending prediction, its position and the epoch."""

    def __init__(self, impl: str):
        self.impl = impl
        self.pending, self.pos_next, self.epoch = {}, {}, {}

    def stale(self, seq: int, epoch: int) -> bool:
        return epoch != self.epoch.get(seq, 0)

    def verdict(self, kind: int, seq: int, epoch: int, pos: int, wid: int, tokens: list[int], logits):
        """The reply ``[seq, epoch, wid, accepted, token, full]`` for a window that is not stale."""
        n = len(tokens)
        if kind == PREFILL:
            self.pending[seq] = int(logits[-1].argmax())
            self.pos_next[seq], self.epoch[seq] = n, 0
            return [seq, epoch, wid, n, self.pending[seq], 1]
        if pos != self.pos_next[seq]:
            raise RuntimeError(f"sequence {seq}: window {wid} starts at {pos}, the target expects {self.pos_next[seq]}")
        preds, accepted = verify_window(logits, tokens, self.pending[seq], self.impl)
        if accepted == n:
            self.pending[seq], self.pos_next[seq] = preds[-1], pos + n
            return [seq, epoch, wid, n, preds[-1], 1]
        token = self.pending[seq] if accepted == 0 else preds[accepted - 1]
        self.pending[seq], self.pos_next[seq] = token, pos + accepted
        self.epoch[seq] = epoch + 1
        return [seq, epoch, wid, accepted, token, 0]


class _Seq:
    """Stage 0's view of one sequence."""

    def __init__(self, prompt: list[int]):
        self.prompt_len = len(prompt)
        self.ctx = list(prompt)          # confirmed tokens
        self.stream = list(prompt)       # ctx + speculative tokens (sent or about to be)
        self.sent = 0                    # stream tokens sent to the target in the current epoch
        self.epoch = 0
        self.inflight = deque()          # (wid, kind, pos, tokens) of the current epoch, oldest first
        self.draft_fed: list[int] = []   # tokens the draft's cache holds
        self.prefilled = False


def run_stage0(job: dict, stage, draft_stage, link, last: LastStage | None, timeline: Timeline) -> dict:
    """Stage 0's loop for one job: draft, forward its layers, send; take replies; commit tokens."""
    k, max_new = job["k"], job["max_new_tokens"]
    depth, total_cap = (1, 1) if job["schedule"] == "plain" else (job["depth"], 10 ** 9)
    seqs = [_Seq(p) for p in job["prompts"]]
    n_seq = len(seqs)
    replies = deque()                    # P == 1: the verdicts of the local last stage
    in_flight = 0
    next_wid = 0
    windows = []                         # per window: seq, wid, kind, drafted, accepted, committed, stale
    meta = {}
    discarded = []
    turn = 0
    req = None                           # the posted receive of the next verdict (P > 1)

    def done(s: _Seq) -> bool:
        return len(s.ctx) - s.prompt_len >= max_new

    def draft(si: int, s: _Seq) -> list[int]:
        """k greedy draft tokens after ``s.stream``; the draft's cache keeps the common prefix."""
        common = 0
        for a, b in zip(s.draft_fed, s.stream):
            if a != b:
                break
            common += 1
        common = min(common, len(s.stream) - 1)      # at least one token to feed
        feed = s.stream[common:]
        out = []
        for _ in range(k):
            logits = draft_stage.forward(si, common, torch.tensor(feed))
            common += len(feed)
            tok = int(logits[-1].argmax())
            out.append(tok)
            feed = [tok]
        s.draft_fed = s.stream[:] + out[:-1]
        return out

    def launch(si: int, s: _Seq) -> None:
        nonlocal in_flight, next_wid
        wid = next_wid
        next_wid += 1
        if not s.prefilled:
            kind, tokens, pos = PREFILL, list(s.stream), 0
            s.prefilled = True
        else:
            t = time.perf_counter()
            drafted = draft(si, s)
            timeline.add("draft", t, si, wid)
            s.stream.extend(drafted)
            kind, tokens, pos = WINDOW, s.stream[s.sent:], s.sent
        meta[wid] = dict(seq=si, wid=wid, kind="prefill" if kind == PREFILL else "window",
                         drafted=0 if kind == PREFILL else k, accepted=None, committed=0, stale=False)
        t = time.perf_counter()
        h = stage.forward(si, pos, torch.tensor(tokens))
        if last is not None:         # one stage: verify here
            reply = last.verdict(kind, si, s.epoch, pos, wid, tokens, h)
            timeline.add("verify", t, si, wid)
            replies.append(reply)
        else:
            timeline.add("forward", t, si, wid)
            link.send_window([kind, si, s.epoch, pos, len(tokens), wid], tokens, h)
        s.sent = pos + len(tokens)
        s.inflight.append((wid, kind, pos, tokens))
        in_flight += 1

    def handle(reply: list[int]) -> None:
        nonlocal in_flight
        si, epoch, wid, accepted, token, full = reply
        s = seqs[si]
        wid0, kind, pos, tokens = s.inflight.popleft()
        if wid0 != wid or epoch != s.epoch:
            raise RuntimeError(f"sequence {si}: reply for window {wid} (epoch {epoch}) but window {wid0} "
                               f"(epoch {s.epoch}) is the oldest in flight")
        in_flight -= 1
        before = len(s.ctx)
        if full:
            s.ctx = s.ctx[:pos] + tokens
            if not s.inflight:                     # nothing sent after it: the prediction is the next token
                s.ctx.append(token)
                s.stream = s.ctx[:]
        else:
            s.ctx = s.ctx[:pos] + tokens[:accepted] + [token]
            s.stream = s.ctx[:]
            s.sent = pos + accepted
            s.epoch += 1
            for w in s.inflight:                  # sent after the rejected window: stale
                meta[w[0]]["stale"] = True
                discarded.append(w[0])
            in_flight -= len(s.inflight)
            s.inflight.clear()
        m = meta[wid]
        # drafted tokens of this window that were accepted (a window after a correction starts with it)
        m["accepted"] = max(0, accepted - (len(tokens) - m["drafted"])) if kind == WINDOW else 0
        m["full"] = bool(full)
        m["committed"] = len(s.ctx) - before
        windows.append(m)

    while True:
        while replies:
            handle(replies.popleft())
        if link is not None and req is None and in_flight:
            req = link.post_reply()
        while req is not None and req[0].is_completed():
            handle(req[1].tolist())
            req = link.post_reply() if in_flight else None
        if all(done(s) for s in seqs) and in_flight == 0:
            break
        launched = False
        if in_flight < total_cap:
            for j in range(n_seq):
                si = (turn + j) % n_seq
                s = seqs[si]
                ahead = len(s.stream) - s.prompt_len
                if (not done(s) and len(s.inflight) < depth and ahead < max_new + 1
                        and (s.prefilled or not s.inflight)):
                    launch(si, s)
                    turn = si + 1
                    launched = True
                    break
        if not launched and not replies and req is None:
            raise RuntimeError("stage 0 has nothing in flight and nothing it may launch (a scheduling bug)")
        if not launched and not replies:
            t = time.perf_counter()
            req[0].wait()
            timeline.add("wait", t)
            handle(req[1].tolist())
            req = link.post_reply() if in_flight else None
    if link is not None:
        link.send_window([END, 0, 0, 0, 0, -1], [], None)
        link.flush()
    outputs = [s.ctx[s.prompt_len:s.prompt_len + max_new] for s in seqs]
    return dict(outputs=outputs, windows=windows, discarded=discarded)


def run_stage(stage, link, last: LastStage | None, timeline: Timeline) -> None:
    """A later stage's loop for one job: receive, forward (the last stage: verify and reply), pass on."""
    while True:
        kind, seq, epoch, pos, n, wid, tokens, hidden = link.recv_window()
        if kind == END:
            if last is None:
                link.send_window([END, 0, 0, 0, 0, -1], [], None)
            link.flush()
            return
        if last is not None and kind == WINDOW and last.stale(seq, epoch):
            timeline.events.append(("skip", time.perf_counter() - timeline.t0,
                                    time.perf_counter() - timeline.t0, seq, wid))
            continue
        t = time.perf_counter()
        h = stage.forward(seq, pos, hidden)
        if last is not None:
            reply = last.verdict(kind, seq, epoch, pos, wid, tokens, h)
            timeline.add("verify", t, seq, wid)
            link.send_reply(reply)
        else:
            timeline.add("forward", t, seq, wid)
            link.send_window([kind, seq, epoch, pos, n, wid], tokens, h)
