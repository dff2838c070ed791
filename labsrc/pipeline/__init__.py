"""Pipeline speculative decoding on real processes: ``torch.distributed`` point-to-point, one rank per stage.

:func:`generate` launches ``stages`` processes (``torch.multiprocessing``, spawn), each holding a contiguous
slice of the target's layers (:func:`labsrc.pipeline.stages.split_layers`) and its own KV cache slice;
stage 0 also holds the embeddings and the draft, the last stage the head and the verification
(:mod:`labsrc.pipeline.schedule`). Activations go down the pipeline with send/recv, verdicts come back to
stage 0. The backend is gloo on CPU and NCCL when there is one GPU per stage.

The launcher waits on every rank: a rank that raises makes :func:`generate` raise :class:`PipelineError`
with that rank's traceback (the other ranks are killed), and a rank that hangs is caught by the process
group's timeout (and, failing that, by the launcher's own), so a broken pipeline fails instead of hanging.

``python -m labsrc.pipeline --stages 2 --k 4`` runs it from a shell (:mod:`labsrc.pipeline.__main__`).

**Who can reach the ranks.** All ranks run on this machine, so everything listens on the loopback interface
only: rank 0's rendezvous store (``torch.distributed.TCPStore``, which by default listens on *every* interface:
:func:`loopback_store` hands it a socket bound to 127.0.0.1) and, with gloo, the ranks' own connections
(``GLOO_SOCKET_IFNAME`` is set to the loopback interface unless the caller set it; NCCL's bootstrap likewise
through ``NCCL_SOCKET_IFNAME``). That keeps other machines out; it does not make the pipeline safe against
this machine's other users. torch.distributed's store has no authentication and no encryption: any local
process that connects to its port during a run can read and overwrite its keys, join or stall the rendezvous,
or feed a rank a forged peer address; the tensors sent between ranks are unauthenticated plain bytes too, and
torch.distributed unpickles some of what it exchanges (object collectives), which is code execution for
whoever can inject. Run it on a machine whose local users you trust (as on any shared machine with
torch.distributed).
"""
from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta

from labsrc.pipeline.stages import Stage, StageCache, split_layers

__all__ = ["generate", "sweep", "run_local", "corpus_prompts", "PipelineError", "split_layers", "Stage",
           "StageCache", "SCHEDULES", "loopback_store"]

SCHEDULES = ("plain", "overlapped")


class PipelineError(RuntimeError):
    """A rank of the pipeline failed (its traceback is in the message) or the pipeline timed out."""


def free_port() -> int:
    """A TCP port that was free a moment ago (the rendezvous of the process group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), or None if unknown."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def loopback_store(port: int, world: int, rank: int, timeout: timedelta):
    """The rendezvous store of a local run, listening on 127.0.0.1 only.

    ``TCPStore(..., is_master=True)`` binds its server to every interface whatever host name it is given;
    given ``master_listen_fd`` it serves on a socket we bound ourselves, to the loopback address. The other
    ranks connect to 127.0.0.1 as before. See the module docstring for what the store still does not protect.
    """
    import torch.distributed as dist

    fd = None
    if rank == 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(max(16, world))
        except OSError:
            sock.close()
            raise
        fd = sock.detach()   # the store owns the descriptor from here on (it closes it when it is destroyed)
    return dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout, master_listen_fd=fd)


def _ping(link, rank: int, width: int, hidden: int, reps: int = 20) -> float:
    """Median one-way time of a window's activations between ranks 0 and 1 (half a round trip)."""
    import torch
    import torch.distributed as dist

    x = torch.zeros(width, hidden, dtype=link.dtype, device=link.device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
        times.append((time.perf_counter() - t) / 2)
    times.sort()
    return times[len(times) // 2]


class _Faulty:
    """Wraps a stage to raise (or hang) at its ``after``-th window: the failure tests' injection."""

    def __init__(self, stage, mode: str, after: int):
        self.stage, self.mode, self.after, self.calls = stage, mode, after, 0
        self.caches = stage.caches

    def forward(self, *args):
        self.calls += 1
        if self.calls > self.after:
            if self.mode == "hang":
                time.sleep(3600)
            raise RuntimeError(f"injected failure in {self.mode!r} mode after {self.after} windows")
        return self.stage.forward(*args)


def _worker(rank: int, world: int, port: int, cfg: dict, results) -> None:
    # The rank's own output (library warnings at import, a crash in C code) goes to its log file, not into
    # the launcher's notebook or terminal; the launcher shows the log's tail when the rank dies silently.
    log = open(os.path.join(cfg["logdir"], f"rank{rank}.log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        import torch

        torch.set_num_threads(cfg["threads"])
        import torch.distributed as dist

        import labsrc  # noqa: F401
        from labsrc.models import load
        from labsrc.pipeline import schedule

        cuda = cfg["backend"] == "nccl"
        device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
        if world > 1:
            # The rendezvous waits as long as start-up may take (ranks import torch and load models at their
            # own pace on a busy machine); every send, receive and barrier after it gets cfg["timeout"].
            store = loopback_store(port, world, rank, timedelta(seconds=cfg["startup_timeout"]))
            lo = _loopback_interface()
            if lo is not None:   # the ranks' own connections stay on this machine too (see the module docstring)
                os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
                os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
            dist.init_process_group(cfg["backend"], store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=cfg["timeout"]))
        model, _ = load(cfg["target"], device=device)
        layers = split_layers(model.config.num_hidden_layers, world)[rank]
        stage = Stage(model, layers, first=rank == 0, last=rank == world - 1)
        param_bytes = stage.trim(model)   # this rank keeps only its slice of the target
        if cfg.get("fault") and cfg["fault"]["rank"] == rank:
            stage = _Faulty(stage, cfg["fault"]["mode"], cfg["fault"]["after"])
        draft_stage = None
        if rank == 0:
            draft, _ = load(cfg["draft"], device=device)
            draft_stage = Stage(draft, range(draft.config.num_hidden_layers), first=True, last=True)
        width = max(max(len(p) for job in cfg["jobs"] for p in job["prompts"]),
                    max(job["k"] + 1 for job in cfg["jobs"])) + schedule._HEADER
        hidden = model.config.hidden_size
        link = schedule._Link(rank, world, width, hidden, torch.float32, device) if world > 1 else None
        last = schedule.LastStage(cfg["verify"]) if rank == world - 1 else None
        comm = _ping(link, rank, max(j["k"] for j in cfg["jobs"]) + 1, hidden) if world > 1 else 0.0
        out = []
        for job in cfg["jobs"]:
            if world > 1:
                dist.barrier()
            timeline = schedule.Timeline(time.perf_counter())
            if rank == 0:
                res = schedule.run_stage0(job, stage, draft_stage, link, last, timeline)
                res["wall"] = time.perf_counter() - timeline.t0
            else:
                schedule.run_stage(stage, link, last, timeline)
                res = {}
            for st in (stage, draft_stage):
                if st is not None:
                    st.caches.clear()
            if last is not None:
                last.__init__(cfg["verify"])
            res.update(events=timeline.events, comm=comm, layers=[layers.start, layers.stop],
                       param_bytes=param_bytes)
            out.append(res)
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
        results.put(("done", rank, out))
    except BaseException:  # noqa: BLE001 - everything a rank raises goes to the launcher
        results.put(("error", rank, traceback.format_exc()))


def _launch(cfg: dict, stages: int, timeout: float, startup_timeout: float) -> list[list[dict]]:
    """Start ``stages`` ranks, collect their results; raise :class:`PipelineError` on any failure."""
    import torch.multiprocessing as mp

    import shutil
    import tempfile

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    cfg = dict(cfg, logdir=tempfile.mkdtemp(prefix="labsrc-pipeline-"))

    def log_tail(r: int) -> str:
        try:
            with open(os.path.join(cfg["logdir"], f"rank{r}.log")) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    procs = [ctx.Process(target=_worker, args=(r, stages, port, cfg, results), daemon=True)
             for r in range(stages)]
    for p in procs:
        p.start()
    got: dict[int, list] = {}
    started = time.monotonic()
    try:
        while len(got) < stages:
            try:
                kind, rank, payload = results.get(timeout=0.2)
            except queue_mod.Empty:
                kind = None
            if kind == "error":
                running = [r for r, p in enumerate(procs) if p.is_alive() and r != rank]
                raise PipelineError(f"rank {rank} of {stages} failed (ranks still running: {running}):\n{payload}")
            if kind == "done":
                got[rank] = payload
                continue
            for r, p in enumerate(procs):
                if r not in got and not p.is_alive() and p.exitcode not in (0, None):
                    time.sleep(0.5)   # its error message may still be in the queue
                    try:
                        kind, rank, payload = results.get(timeout=1.0)
                        if kind == "error":
                            raise PipelineError(f"rank {rank} of {stages} failed:\n{payload}")
                        got[rank] = payload
                    except queue_mod.Empty:
                        raise PipelineError(f"rank {r} of {stages} died with exit code {p.exitcode} "
                                            f"without a traceback; its output:\n{log_tail(r)}") from None
            if time.monotonic() - started > startup_timeout + timeout:
                waiting = [r for r in range(stages) if r not in got]
                raise PipelineError(f"the pipeline timed out after {startup_timeout + timeout:.0f} s; "
                                    f"ranks {waiting} never finished")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        shutil.rmtree(cfg["logdir"], ignore_errors=True)
    return [got[r] for r in range(stages)]


def _check_prompts(prompts) -> list[list[int]]:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        ids = p.tolist() if hasattr(p, "tolist") else p
        if (not isinstance(ids, (list, tuple)) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise ValueError(f"prompts[{i}] must be a non-empty list of non-negative token ids")
        out.append([int(t) for t in ids])
    return out


def _check_job(job: dict) -> dict:
    """A job with its defaults (``depth=2``, ``max_new_tokens=32``), checked: ``schedule`` one of
    :data:`SCHEDULES`, ``k`` (drafts per window), ``depth`` (windows in flight) and ``max_new_tokens`` positive
    ints. Shared by :func:`sweep` and :func:`run_local`, so both refuse the same jobs."""
    if not isinstance(job, dict):
        raise TypeError(f"a job must be a dict(k=, schedule=, max_new_tokens=, depth=), got {type(job).__name__}")
    job = dict(dict(depth=2, max_new_tokens=32), **job)
    if job.get("schedule") not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {job.get('schedule')!r}")
    for key in ("k", "max_new_tokens", "depth"):
        v = job.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key} must be a positive int, got {v!r}")
    return job


def _check_verify(verify) -> str:
    if verify not in ("kernel", "reference"):
        raise ValueError(f"verify must be 'kernel' or 'reference', got {verify!r}")
    return verify


def _backend(stages: int, backend: str | None) -> str:
    import torch

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= stages else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    return backend


def sweep(prompts, jobs: list[dict], *, target: str = "lab-target", draft: str = "lab-draft", stages: int = 2,
          verify: str = "kernel", timeout: float = 120.0, startup_timeout: float = 180.0,
          backend: str | None = None, fault: dict | None = None, threads: int = 1) -> list[dict]:
    """Run several jobs (``dict(k=, schedule=, max_new_tokens=, depth=)``) on one launch of ``stages``
    ranks, so that process start-up (seconds) is paid once. Returns one dict per job: ``outputs``,
    ``windows`` (per verified window: sequence, drafted, accepted, committed tokens, stale), ``discarded``,
    ``wall`` (seconds), ``comm`` (measured one-way activation transfer), ``timelines`` (per rank, a list of
    ``(what, start, end, seq, wid)``), ``layers`` (per rank, ``[start, stop)``) and ``param_bytes`` (per
    rank, the target's parameters it holds)."""
    prompts = _check_prompts(prompts)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive int, got {stages!r}")
    _check_verify(verify)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    full = [dict(_check_job(job), prompts=prompts) for job in jobs]
    cfg = dict(target=target, draft=draft, jobs=full, timeout=float(timeout), verify=verify,
               startup_timeout=float(startup_timeout),
               backend=_backend(stages, backend), fault=fault, threads=threads)
    per_rank = _launch(cfg, stages, float(timeout), float(startup_timeout))
    out = []
    for j in range(len(full)):
        res = dict(per_rank[0][j])
        res["timelines"] = [per_rank[r][j]["events"] for r in range(stages)]
        res["layers"] = [per_rank[r][j]["layers"] for r in range(stages)]
        res["param_bytes"] = [per_rank[r][j]["param_bytes"] for r in range(stages)]
        res.pop("events")
        res.update(k=full[j]["k"], schedule=full[j]["schedule"], stages=stages, depth=full[j]["depth"])
        out.append(res)
    return out


def generate(prompts, target: str = "lab-target", draft: str = "lab-draft", stages: int = 2, k: int = 4,
             schedule: str = "overlapped", max_new_tokens: int = 32, **options):
    """Greedy pipeline speculative decoding of ``prompts`` (token-id lists) on ``stages`` processes.

    Returns ``(outputs, timelines)``: the generated token ids per prompt (``max_new_tokens`` each, equal to
    the target's own greedy continuation) and, per rank, its ``(what, start, end, seq, wid)`` events.
    ``options`` go to :func:`sweep` (``verify``, ``timeout``, ``depth``...).
    """
    depth = options.pop("depth", 2)
    res = sweep(prompts, [dict(k=k, schedule=schedule, max_new_tokens=max_new_tokens, depth=depth)],
                target=target, draft=draft, stages=stages, **options)[0]
    return res["outputs"], res["timelines"]


def corpus_prompts(tokenizer, n: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens from the lab's validation text (evenly spaced windows)."""
    import random

    from labsrc.tasks import corpus_ids

    ids = corpus_ids(tokenizer, "validation")
    rng = random.Random(seed)
    span = (len(ids) - length) // max(n, 1)
    starts = [i * span + rng.randrange(span) for i in range(n)]
    return [ids[s:s + length].tolist() for s in starts]


def run_local(prompts, target_model, draft_model, *, k: int = 4, schedule: str = "plain",
              max_new_tokens: int = 32, verify: str = "kernel", depth: int = 2) -> dict:
    """The one-stage pipeline in this process (no ranks, no messages): the same stage-0 loop and verdicts
    as :func:`sweep` with ``stages=1``, on models already loaded. Returns the same per-job dict. ``k``,
    ``depth`` and ``max_new_tokens`` must be positive ints and ``schedule``/``verify`` known names, checked
    as :func:`sweep` checks them (``ValueError`` naming the argument)."""
    import time as _time

    from labsrc.pipeline import schedule as sch

    prompts = _check_prompts(prompts)
    job = dict(_check_job(dict(k=k, schedule=schedule, max_new_tokens=max_new_tokens, depth=depth)),
               prompts=prompts)
    _check_verify(verify)
    stage = Stage(target_model, range(target_model.config.num_hidden_layers), first=True, last=True)
    draft = Stage(draft_model, range(draft_model.config.num_hidden_layers), first=True, last=True)
    timeline = sch.Timeline(_time.perf_counter())
    res = sch.run_stage0(job, stage, draft, None, sch.LastStage(verify), timeline)
    res.update(wall=_time.perf_counter() - timeline.t0, timelines=[timeline.events], comm=0.0, stages=1,
               k=k, schedule=schedule, depth=depth, layers=[[0, target_model.config.num_hidden_layers]])
    return res
