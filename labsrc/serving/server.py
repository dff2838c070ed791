"""An OpenAI-compatible ``/v1/completions`` endpoint on the engine (FastAPI + uvicorn).

One background thread owns the :class:`~labsrc.serving.engine.Engine`: it takes new requests from a queue,
runs :meth:`Engine.step` while anything is unfinished, and hands each sampled token to the request's
``asyncio`` queue on the server's event loop. HTTP handlers never touch the engine, so no lock is needed
around it; a request's handler only waits on its own queue (tokens as server-sent events with
``"stream": true``, or the whole completion).

Errors follow OpenAI's shape, ``{"error": {"message", "type", "code"}}``: an unknown model is 404, a bad
field (negative ``max_tokens``, a prompt longer than the context, a ``temperature`` below 0) is 400, and the
server keeps serving.
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
from pydantic import BaseModel, Field

from labsrc.serving.scheduler import SamplingParams

__all__ = ["CompletionRequest", "EngineLoop", "create_app"]


class CompletionRequest(BaseModel):
    """The fields of OpenAI's completions request that the engine uses (plus vLLM's ``ignore_eos``)."""
    model: str
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    ignore_eos: bool = False


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": code}})


class EngineLoop:
    """The thread that drives the engine (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self._incoming: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(self, prompt, params: SamplingParams, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        """Queue a request; tokens arrive on the returned queue as ``(token, finish_reason)``, or an exception."""
        out: asyncio.Queue = asyncio.Queue()
        self._incoming.put((prompt, params, loop, out))
        self._wake.set()
        return out

    def _run(self):
        sinks: dict[int, tuple] = {}
        while not self._stop.is_set():
            while True:
                try:
                    prompt, params, loop, out = self._incoming.get_nowait()
                except queue.Empty:
                    break
                try:
                    rid = self.engine.add_request(prompt, params)
                except ValueError as err:
                    loop.call_soon_threadsafe(out.put_nowait, err)
                    continue
                sinks[rid] = (loop, out)
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                results = self.engine.step()
            except Exception as err:  # noqa: BLE001 - fail the requests in flight, keep serving
                for loop, out in sinks.values():
                    loop.call_soon_threadsafe(out.put_nowait, RuntimeError(f"engine step failed: {err}"))
                sinks.clear()
                self.engine.reset()
                continue
            for rid, token, done in results:
                loop, out = sinks[rid]
                reason = self.engine.seqs[rid].finish_reason if done else None
                loop.call_soon_threadsafe(out.put_nowait, (token, reason))
                if done:
                    del sinks[rid]
                    self.engine.seqs.pop(rid, None)


def create_app(engine, model_name: str) -> FastAPI:
    """The FastAPI application serving ``engine`` under the name ``model_name``."""
    runner = EngineLoop(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        runner.start()
        yield
        runner.stop()

    app = FastAPI(title="labsrc.serving", lifespan=lifespan)
    app.state.runner = runner

    @app.exception_handler(RequestValidationError)
    async def _bad_fields(request: Request, exc: RequestValidationError):
        where = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:])}: {e['msg']}" for e in exc.errors())
        return _error(400, f"invalid request: {where}")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "labsrc"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        if req.model != model_name:
            return _error(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                          code="model_not_found")
        params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                seed=req.seed, ignore_eos=req.ignore_eos)
        loop = asyncio.get_running_loop()
        out = runner.submit(req.prompt, params, loop)
        first = await out.get()
        if isinstance(first, Exception):
            return _error(400 if isinstance(first, ValueError) else 500, str(first))
        cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        tok = engine.tokenizer

        def chunk(text, reason):
            return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

        if req.stream:
            async def events():
                ids, sent, item = [], "", first
                while True:
                    if isinstance(item, Exception):
                        yield f"data: {json.dumps({'error': {'message': str(item), 'type': 'server_error'}})}\n\n"
                        break
                    token, reason = item
                    ids.append(token)
                    text = tok.decode(ids, skip_special_tokens=True)
                    yield f"data: {json.dumps(chunk(text[len(sent):], reason))}\n\n"
                    sent = text
                    if reason is not None:
                        break
                    item = await out.get()
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        ids, item = [], first
        while True:
            if isinstance(item, Exception):
                return _error(500, str(item), kind="server_error")
            token, reason = item
            ids.append(token)
            if reason is not None:
                break
            item = await out.get()
        body = chunk(tok.decode(ids, skip_special_tokens=True), reason)
        prompt_tokens = len(engine._encode(req.prompt))
        body["choices"][0]["token_ids"] = ids
        body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                         "total_tokens": prompt_tokens + len(ids)}
        return body

    return app
