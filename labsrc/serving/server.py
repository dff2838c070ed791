"""An OpenAI-compatible ``/v1/completions`` endpoint on the engine (FastAPI + uvicorn).

One background thread owns the :class:`~labsrc.serving.engine.Engine` (:class:`EngineLoop`): it takes new
requests from a queue, runs :meth:`Engine.step` while anything is unfinished, and hands each sampled token to
the request's ``asyncio`` queue on the server's event loop. HTTP handlers never touch the engine's state, so no
lock is needed around it.

What the door does, so that one client cannot hurt the others:

* the body is bounded (``max_request_bytes``; 413 beyond it), and the fields are checked by
  :class:`~labsrc.serving.protocol.CompletionRequest` (400 with the field's name; any unknown field is 400);
* prompts are tokenized in a worker thread, never on the engine's, and a text far longer than the context is
  refused after tokenizing a bounded prefix of it (:func:`tokenize_bounded`);
* lengths and blocks are checked with :meth:`Engine.check_request` before the request is queued.

Inside the engine a failure stays with its sequence (a sampling error finishes that sequence alone); a fault
of a whole step fails the requests that were in it with 500 and aborts them, and the others go on. A client
that goes away, streaming or not, has its requests aborted: their batch slots and blocks are free at once.

Errors follow OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad field, 404
for an unknown model, 413 for a body too large, 500 only for the server's own faults.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from labsrc.serving.detokenizer import IncrementalDetokenizer
from labsrc.serving.logprobs import TokenStrings, text_offsets, top_entries
from labsrc.serving.protocol import MAX_CHOICES, CompletionRequest
from labsrc.serving.scheduler import SamplingParams

__all__ = ["BodyLimit", "CompletionRequest", "EngineLoop", "create_app", "tokenize_bounded", "MAX_REQUEST_BYTES"]

MAX_REQUEST_BYTES = 1 << 20  # default body limit: 1 MiB, far more than a 512-token context needs
_FINISH = {"stop": "stop", "length": "length", "context": "length"}  # engine reason -> OpenAI's


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None):
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


class _RequestFailed(Exception):
    """A request (or one of its choices) failed: ``status`` 4xx for its own fault, 5xx for the server's."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def tokenize_bounded(tokenizer, text: str, max_tokens: int) -> list[int]:
    """``text``'s token ids, raising ``ValueError`` when there are more than ``max_tokens``, without tokenizing
    all of a huge text.

    A byte-level BPE tokenizer first splits the text into words (a space starts a new word) and merges within
    a word only, so the words that end before a space tokenize the same whether the text goes on or not: the
    tokens of a prefix cut just before a space are a prefix of the whole text's tokens. When the prefix of
    about ``16 x max_tokens`` characters ending at a space already has more than ``max_tokens`` tokens, the
    text is refused without reading further. (A text with no space in that prefix is tokenized whole; the
    server's body limit bounds it.)"""
    cut = 16 * (max_tokens + 1)
    if len(text) > cut:
        space = text.rfind(" ", 0, cut)
        if space > 0:
            head = tokenizer(text[:space])["input_ids"]
            if len(head) > max_tokens:
                raise ValueError(f"the prompt has at least {len(head)} tokens; the model's context is "
                                 f"{max_tokens}")
    ids = list(tokenizer(text)["input_ids"])
    if len(ids) > max_tokens:
        raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {max_tokens}")
    return ids


class BodyLimit:
    """ASGI middleware: refuse a POST body over ``limit`` bytes with 413 before anything parses it, by its
    Content-Length when given and by counting what arrives when it is chunked. (Pure ASGI, not Starlette's
    ``BaseHTTPMiddleware``: after the body, ``receive`` is the server's own again, so a handler still hears
    the client's disconnect.)"""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def _reject(self, scope, receive, send):
        await _error(413, f"the request body exceeds {self.limit} bytes", param="body")(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._reject(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await self._reject(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class _Handle:
    """One sequence submitted to the engine thread: its outbox on the event loop, and a cancel flag."""

    def __init__(self, ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop):
        self.ids, self.params, self.loop = ids, params, loop
        self.out: asyncio.Queue = asyncio.Queue()
        self.cancelled = False  # set by the handler (client gone, stop string found); read by the engine thread
        self.rid: int | None = None

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class EngineLoop:
    """The thread that drives the engine (see the module docstring).

    Items put on a handle's queue: ``("token", id, logprob entry or None, prompt logprobs or None)`` for each
    token (the prompt's log-probabilities, when asked for, come with the first: the prefill that gives the
    first token computed them); ``("done", finish_reason)`` at the end; ``("error", status, message)`` instead
    when it failed.
    """

    def __init__(self, engine):
        self.engine = engine
        self._incoming: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._active: dict[int, _Handle] = {}
        self.aborted = 0  # requests aborted because their client went away or their stop string was found
        self.stats = self._stats()

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(self, handle: _Handle) -> None:
        self._incoming.put(handle)
        self._wake.set()

    def cancel(self, handle: _Handle) -> None:
        """Abort the handle's request (its client went away, or its stop string was found)."""
        handle.cancelled = True
        self._wake.set()

    def _stats(self) -> dict:
        e = self.engine
        return dict(num_blocks=e.blocks.num_blocks, free_blocks=e.blocks.num_free_blocks,
                    running=len(e.scheduler.running), waiting=len(e.scheduler.waiting), active=len(self._active),
                    queued=self._incoming.qsize(), aborted=self.aborted)

    def _finish(self, rid: int) -> None:
        self._active.pop(rid, None)
        self.engine.seqs.pop(rid, None)

    def _run(self):
        while not self._stop.is_set():
            while True:
                try:
                    h = self._incoming.get_nowait()
                except queue.Empty:
                    break
                if h.cancelled:
                    continue
                try:
                    h.rid = self.engine.add_request(h.ids, h.params)
                except (ValueError, TypeError) as err:  # checked at the door already; a 400 all the same
                    h.put(("error", 400, str(err)))
                    continue
                self._active[h.rid] = h
            for rid, h in list(self._active.items()):
                if h.cancelled:
                    self.engine.abort(rid)
                    self.aborted += 1
                    self._finish(rid)
            self.stats = self._stats()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                results = self.engine.step()
            except Exception as err:  # noqa: BLE001 - a fault of the step: fail the requests that were in it
                for rid, h in list(self._active.items()):
                    if self.engine.seqs[rid].status == "running":
                        h.put(("error", 500, f"engine step failed: {type(err).__name__}: {err}"))
                        self.engine.abort(rid)
                        self._finish(rid)
                continue
            for rid, token, done in results:
                h = self._active.get(rid)
                if h is None:
                    continue
                seq = self.engine.seqs[rid]
                if token is None:  # this sequence alone failed (engine.step confined it)
                    h.put(("error", 500, f"sampling failed: {seq.error}"))
                    self._finish(rid)
                    continue
                prompt_lp = [seq.prompt_logprobs.get(p) for p in range(len(seq.prompt))] \
                    if seq.params.prompt_logprobs and len(seq.output) == 1 else None
                h.put(("token", token, seq.logprobs[-1] if seq.params.logprobs is not None else None, prompt_lp))
                if done:
                    h.put(("done", seq.finish_reason))
                    self._finish(rid)
            self.stats = self._stats()


class _Choice:
    """One choice of a completion: its tokens, its text (released as :class:`IncrementalDetokenizer` allows)
    and OpenAI's ``logprobs`` object."""

    def __init__(self, index: int, handle: _Handle, tokenizer, stop: list[str], echo: bool, logprobs: int | None,
                 strings: TokenStrings):
        self.index, self.handle, self.tok, self.strings = index, handle, tokenizer, strings
        self.detok = IncrementalDetokenizer(tokenizer, stop)
        self.echo, self.want_logprobs = echo, logprobs is not None
        self.prefix = tokenizer.decode(handle.ids, skip_special_tokens=True,
                                       clean_up_tokenization_spaces=False) if echo else ""
        self.token_ids: list[int] = []
        self.entries: list = []  # (token id, logprob, top) per generated token
        self.finish_reason: str | None = None
        self.prompt_logprobs = None

    def logprobs_object(self, prompt_too: bool, first: int = 0, last: int | None = None,
                        released: int | None = None) -> dict | None:
        """OpenAI's logprobs object for generated tokens ``first .. last - 1`` (with the prompt's before them
        when ``prompt_too`` and the choice echoes), by the rules of :mod:`labsrc.serving.logprobs`;
        ``text_offset`` counts characters from the start of the choice's text and stops at its end, or at
        ``released`` characters of it (what a stream has sent so far)."""
        if not self.want_logprobs:
            return None
        obj = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        strings, ids = self.strings, self.handle.ids
        end = len(self.text) if released is None else released
        if prompt_too and self.echo:
            prompt_lp = self.prompt_logprobs or [None] * len(ids)
            for p, (t, offset) in enumerate(zip(ids, text_offsets(self.tok, ids, limit=end))):
                entry = prompt_lp[p]
                obj["tokens"].append(strings[t])
                obj["token_logprobs"].append(None if entry is None else entry[0])
                obj["top_logprobs"].append(None if entry is None else top_entries(strings, t, *entry))
                obj["text_offset"].append(offset)
        kept = self.entries[:self.detok.num_tokens_kept]
        last = len(kept) if last is None else min(last, len(kept))
        offsets = text_offsets(self.tok, self.token_ids, first, last, base=len(self.prefix), limit=end)
        for i, offset in zip(range(first, last), offsets):
            t, lp, top = kept[i]
            obj["tokens"].append(strings[t])
            obj["token_logprobs"].append(lp)
            obj["top_logprobs"].append(top_entries(strings, t, lp, top))
            obj["text_offset"].append(offset)
        return obj

    def take(self, item) -> str:
        """Apply one item from the engine; return the text it releases. Raises ``_RequestFailed`` for an error."""
        kind = item[0]
        if kind == "error":
            raise _RequestFailed(item[1], item[2])
        if kind == "token":
            _, token, entry, prompt_lp = item
            if prompt_lp is not None:
                self.prompt_logprobs = prompt_lp
            if self.detok.stopped:
                return ""
            self.token_ids.append(token)
            if entry is not None:
                self.entries.append((token, *entry))
            text = self.detok.add(token)
            if self.detok.stopped:
                self.finish_reason = "stop"
            return text
        reason = item[1]  # "done"
        text = self.detok.flush()  # the final text may still hold a stop string (one with a U+FFFD in it)
        if self.finish_reason is None:
            self.finish_reason = "stop" if self.detok.stopped else _FINISH.get(reason, reason)
        return text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.prefix + self.detok.text


def create_app(engine, model_name: str, max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI application serving ``engine`` under the name ``model_name``."""
    runner = EngineLoop(engine)
    created = int(time.time())
    tok = engine.tokenizer
    strings = TokenStrings(tok)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        runner.start()
        yield
        runner.stop()

    app = FastAPI(title="labsrc.serving", lifespan=lifespan)
    app.state.runner = runner

    app.add_middleware(BodyLimit, limit=max_request_bytes)

    @app.exception_handler(RequestValidationError)
    async def _bad_fields(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        where = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors)
        param = next((str(e["loc"][1]) for e in errors if len(e["loc"]) > 1), None)
        return _error(400, f"invalid request: {where}", param=param)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        """The engine's books as of its last iteration: blocks free, sequences running and waiting."""
        return dict(runner.stats)

    def model_card():
        return {"id": model_name, "object": "model", "created": created, "owned_by": "labsrc",
                "max_model_len": engine.max_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_name:
            return _error(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                          param="model", code="model_not_found")
        return model_card()

    def prepare(req: CompletionRequest) -> list[list[int]]:
        """Token ids of every prompt, checked; runs in a worker thread."""
        prompts = req.prompts()
        if len(prompts) * req.n > MAX_CHOICES:
            raise _RequestFailed(400, f"prompts x n = {len(prompts) * req.n} completions; at most {MAX_CHOICES} "
                                   "per request", "n")
        out = []
        for p in prompts:
            try:
                ids = tokenize_bounded(tok, p, engine.max_len) if isinstance(p, str) else engine.encode(p)
                engine.check_request(ids, SamplingParams(max_tokens=req.max_tokens))
            except (ValueError, TypeError) as err:
                raise _RequestFailed(400, str(err), "prompt") from None
            out.append(ids)
        if req.logprobs is not None:
            strings.table()  # the first request with logprobs builds the token table here, off the event loop
        return out

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        if req.model != model_name:
            return _error(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                          param="model", code="model_not_found")
        try:
            prompt_ids = await asyncio.to_thread(prepare, req)  # never on the engine thread nor the event loop
        except _RequestFailed as err:
            return _error(err.status, str(err), param=err.param)
        loop = asyncio.get_running_loop()
        choices = []
        for ids in prompt_ids:
            for j in range(req.n):
                params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                        seed=req.choice_seed(j),
                                        ignore_eos=req.ignore_eos, logprobs=req.logprobs,
                                        prompt_logprobs=req.echo and req.logprobs is not None)
                choices.append(_Choice(len(choices), _Handle(ids, params, loop), tok, req.stops(), req.echo,
                                       req.logprobs, strings))
        for c in choices:
            runner.submit(c.handle)
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"

        def cancel_all():  # harmless for a finished choice: the engine thread no longer holds it
            for c in choices:
                runner.cancel(c.handle)

        def usage():
            prompt_tokens = sum(len(ids) for ids in prompt_ids)
            completion = sum(len(c.token_ids[:c.detok.num_tokens_kept]) for c in choices)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion}

        async def next_item(c: _Choice):
            item = await c.handle.out.get()
            text = c.take(item)
            if c.detok.stopped:  # the stop string is found (take() set finish_reason): the engine need not go on
                runner.cancel(c.handle)
            return text

        if req.stream:
            return StreamingResponse(_stream(choices, next_item, cancel_all, cid, created, model_name, req.echo),
                                     media_type="text/event-stream")

        async def collect():
            for c in choices:
                while not c.finished:
                    await next_item(c)

        async def client_gone():  # polled on a clock: tokens may arrive faster than any timeout would fire
            while not await request.is_disconnected():
                await asyncio.sleep(0.2)

        work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client went away: abort, and answer nobody
                work.cancel()
                return _error(499, "the client closed the request")
            work.result()
        except _RequestFailed as err:
            cancel_all()
            kind = "server_error" if err.status >= 500 else "invalid_request_error"
            return _error(err.status, str(err), kind=kind)
        finally:
            watch.cancel()
            cancel_all()
        return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                             "logprobs": c.logprobs_object(prompt_too=True),
                             "token_ids": c.token_ids[:c.detok.num_tokens_kept]} for c in choices],
                "usage": usage()}

    return app


async def _stream(choices, next_item, cancel_all, cid, created, model_name, echo):
    """Server-sent events: one chunk per release of text by any choice, then ``[DONE]``. The choices run side by
    side; when the client goes away the response is cancelled here, and every unfinished choice is aborted."""
    def chunk(c, text, logprobs, reason):  # the finish reason as of the release (the choice may be further on)
        return "data: " + json.dumps({"id": cid, "object": "text_completion", "created": created,
                                      "model": model_name,
                                      "choices": [{"index": c.index, "text": text, "logprobs": logprobs,
                                                   "finish_reason": reason}]}) + "\n\n"

    events: asyncio.Queue = asyncio.Queue()

    async def pump(c):
        try:
            sent_tokens, sent_chars, first = 0, 0, True
            while not c.finished:
                text = await next_item(c)
                kept = c.detok.num_tokens_kept
                if text or c.finished or (echo and first):  # the echoed prompt goes with the first token
                    sent_chars += len(text) + (len(c.prefix) if echo and first else 0)
                    # the logprobs object now: the choice's text may grow before the event is sent
                    lp = c.logprobs_object(prompt_too=echo and first, first=sent_tokens, last=kept,
                                           released=sent_chars) if c.want_logprobs else None
                    await events.put((c, text, (lp, echo and first, c.finish_reason)))
                    sent_tokens, first = kept, False
        except _RequestFailed as err:
            await events.put((c, err, None))
        await events.put((c, None, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        open_choices = len(choices)
        while open_choices:
            c, text, span = await events.get()
            if text is None:
                open_choices -= 1
            elif isinstance(text, _RequestFailed):
                kind = "server_error" if text.status >= 500 else "invalid_request_error"
                yield "data: " + json.dumps({"error": {"message": str(text), "type": kind, "param": None,
                                                       "code": None}}) + "\n\n"
            else:
                lp, with_prompt, reason = span
                yield chunk(c, (c.prefix if with_prompt else "") + text, lp, reason)
        yield "data: [DONE]\n\n"
    finally:  # normal end, client gone (cancelled), or an error: abort what still runs
        cancel_all()
        for t in tasks:
            t.cancel()
