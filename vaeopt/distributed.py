"""Multi-GPU decoding on torch.distributed (docs/multi-gpu.md): one large image / clip split into horizontal bands
over the ranks (vaeopt.bands), or many files spread over the ranks (:func:`decode_files_distributed`). NCCL on GPUs,
gloo on CPU; started by torchrun or by :func:`launch`, which spawns local ranks, joins them with a timeout and turns
any rank's failure into one :class:`DistributedError` (the other ranks are terminated, nothing hangs).
"""

from __future__ import annotations

import datetime
import heapq
import math
import os
import pickle
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from vaeopt import api
from vaeopt import latents as lat
from vaeopt.bands import band_parallel_decode, band_rows, supports_band
from vaeopt.errors import DistributedError, VaeoptError
from vaeopt.loading import load_vae
from vaeopt.pipeline import Options, Pipeline
from vaeopt.stages import join, spelled

__all__ = ["DistributedError", "ENV_RULES", "band_parallel_decode", "band_rows", "supports_band", "launch",
           "init_distributed", "rank_device", "under_torchrun", "decode_files_distributed", "assign_jobs"]

# NVLink SHARP / multicast off: the decode's collectives are small halos and all-gathers that gain nothing from
# it, and setting multicast up can take a shared host's GPUs out of service for other jobs (docs/multi-gpu.md).
ENV_RULES = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def _apply_env_rules() -> None:
    for k, v in ENV_RULES.items():
        os.environ[k] = v


# ================================================================================================================
# Process groups: launch, torchrun, devices
# ================================================================================================================


def under_torchrun() -> bool:
    """Started by torchrun / torch.distributed.elastic (or any launcher that sets the env:// variables)?"""
    e = os.environ
    return all(k in e for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")) and "_VAEOPT_SPAWNED" not in e


def _default_backend(n_procs: int) -> str:
    return "nccl" if torch.cuda.is_available() and n_procs <= torch.cuda.device_count() else "gloo"


def rank_device(backend: str | None = None) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK under NCCL, else CPU."""
    if backend is None:
        backend = dist.get_backend() if dist.is_initialized() else _default_backend(int(os.environ.get(
            "WORLD_SIZE", "1")))
    if "nccl" in str(backend):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int, torch.device]:
    """Initialise the default process group from the environment (torchrun's env://) if not done yet.
    -> (rank, world size, this rank's device). Sets the CUDA device of the rank under NCCL."""
    _apply_env_rules()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized():
        backend = backend or _default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                                if backend == "nccl" else None)
    dev = rank_device(dist.get_backend())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dist.get_rank(), dist.get_world_size(), dev


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(index: int, world: int, port: int, backend: str, fn: Callable, args: tuple, kwargs: dict,
           result_path: str, timeout_s: float) -> None:
    os.environ.update({"RANK": str(index), "LOCAL_RANK": str(index), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "_VAEOPT_SPAWNED": "1"})
    _apply_env_rules()
    if backend == "gloo" and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on the loopback interface, like MASTER_ADDR
    init_distributed(backend, timeout_s)
    out = fn(*args, **kwargs)  # an exception ends this process; the parent stops the other ranks and reports it
    if index == 0:
        torch.save(out, result_path)
    del out
    dist.destroy_process_group()
    # Leave without interpreter finalization. destroy_process_group drops only the group's registry entries; gloo's
    # C++ worker threads live until the last Python reference goes, and if that happens while the interpreter is being
    # torn down the rank dies with SIGABRT ("terminate called without an active exception"), after its work is done
    # (seen rarely, under load, in the 2-rank CPU tests). The result is saved and closed above; nothing else is pending.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _join(ctx, timeout: float) -> bool:
    try:  # a grace period lets the other ranks write their own error before they are terminated
        return ctx.join(timeout=timeout, grace_period=3.0)
    except TypeError:  # an older torch without grace_period
        return ctx.join(timeout=timeout)


_COMM_ERRORS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "distbackenderror",
                "timed out", "socket", "watchdog", "peer")


def _failure_report(ctx) -> str:
    """One message for all failed ranks, the root cause first: a rank's own exception (or death) rather than the
    communication errors it caused in its peers."""
    fails = []
    for i, p in enumerate(ctx.processes):
        p.join(0.2)
        ef = ctx.error_files[i]
        text = None
        if os.access(ef, os.R_OK) and os.path.getsize(ef) > 0:
            try:
                with open(ef, "rb") as fh:
                    text = pickle.load(fh)
            except Exception:  # noqa: BLE001
                text = None
        if text is not None:
            last = [ln for ln in str(text).strip().splitlines() if ln.strip()][-1]
            last = re.sub(r"^[\w.]+\.(\w+):", r"\1:", last)  # vaeopt.errors.OutputError: -> OutputError:
            fails.append((i, last, str(text).strip()))
        elif p.exitcode not in (0, None, -signal.SIGTERM, -signal.SIGINT):
            code = p.exitcode
            what = f"exit code {code}" if code > 0 else f"signal {signal.Signals(-code).name}"
            fails.append((i, f"died ({what})", ""))
    if not fails:
        return "a rank failed (no error was recorded)"
    fails.sort(key=lambda f: (any(k in f[1].lower() for k in _COMM_ERRORS), f[0]))
    r, last, text = fails[0]
    msg = f"rank {r} failed: {last}" + ("; the other ranks were stopped" if "died" in last else "")
    others = [f"rank {i}: {ln}" for i, ln, _ in fails[1:] if ln != last]  # (the same error everywhere: once)
    if others:
        msg += "\n(then " + "; ".join(others) + ")"
    if text:
        msg += "\n" + text
    return msg


def launch(n_procs: int | None, fn: Callable, *args, backend: str | None = None, timeout: float | None = 3600.0,
           kwargs: dict | None = None) -> Any:
    """Run ``fn(*args, **kwargs)`` on `n_procs` ranks of a fresh process group and return rank 0's result
    (docs/multi-gpu.md). Under torchrun: joins the job and runs fn on this rank (`n_procs`, if given, must equal
    WORLD_SIZE). Else spawns local processes (spawn start method: fn must be a module-level function) on 127.0.0.1,
    NCCL with one GPU per rank when CUDA has `n_procs` devices, else gloo. A rank raising or dying, or the
    `timeout`, ends all of them and raises one :class:`DistributedError` naming the rank that caused it."""
    _apply_env_rules()
    kwargs = kwargs or {}
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if n_procs is not None and n_procs != world:
            raise DistributedError(f"started by torchrun with {world} ranks, but {n_procs} were asked for")
        created = not dist.is_initialized()
        init_distributed(backend)
        try:
            return fn(*args, **kwargs)
        finally:
            if created and dist.is_initialized():
                dist.destroy_process_group()
    if n_procs is None:
        n_procs = torch.cuda.device_count() or 1
    if n_procs < 1:
        raise DistributedError("n_procs must be at least 1")
    backend = backend or _default_backend(n_procs)
    if backend == "nccl" and n_procs > torch.cuda.device_count():
        raise DistributedError(f"NCCL needs one GPU per rank: {n_procs} ranks, {torch.cuda.device_count()} GPUs")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="vaeopt-dist-") as tmp:
        result_path = os.path.join(tmp, "rank0.pt")
        port = _free_port()
        ctx = mp.start_processes(
            _child, args=(n_procs, port, backend, fn, args, kwargs, result_path, float(timeout or 3600.0)),
            nprocs=n_procs, join=False, start_method="spawn",
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not _join(ctx, 0.5):
                if deadline is not None and time.monotonic() > deadline:
                    raise DistributedError(f"{n_procs} ranks did not finish within {timeout:g} s; terminated")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            raise DistributedError(_failure_report(ctx)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        if not os.path.exists(result_path):
            return None
        return torch.load(result_path, weights_only=False)


# ================================================================================================================
# Many files: jobs spread over the ranks (or decoded together, band-parallel, when there are fewer jobs than ranks)
# ================================================================================================================


def assign_jobs(sizes: Sequence[int], world: int) -> list[list[int]]:
    """Job indices per rank: largest job first to the least loaded rank (ties: lower rank, lower index);
    deterministic, so every rank computes the same assignment. Each rank's list keeps the input order."""
    heap = [(0, r) for r in range(world)]
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + int(sizes[i]), r))
    return [sorted(x) for x in out]


def _result_dict(r, rank: int, mode: str) -> dict:
    return {"source": str(r.job.source), "entry": r.job.entry, "shape": list(r.job.z_raw.shape),
            "written": [str(p) for p in r.written], "seconds": r.seconds, "peak_bytes": r.peak_bytes,
            "plan": r.plan, "retries": list(r.retries), "rank": rank, "mode": mode}


def decode_files_distributed(latents: Sequence[str | Path], model: str | Path | None = None, *,
                             output: str | Path | None = None, family: str | None = None,
                             config: str | Path | None = None, key: str | None = None, latent_space: str | None = None,
                             overwrite: bool = False, options=None, fps: float = 16.0, mode: str = "auto", group=None,
                             log: Callable[[str], None] | None = None, limits: api.Limits | None = None,
                             spell: Callable | None = None) -> list[dict] | None:
    """Per-rank entry of ``vaeopt decode ... --gpus N`` (docs/multi-gpu.md), called on every rank of an
    initialised process group (``launch(N, decode_files_distributed, paths, model, kwargs={...})``). Every rank
    reads the latents within ``limits`` and plans the same jobs (vaeopt.api.plan_jobs) before anyone writes, and
    builds its own Pipeline on its own device from ``options``. mode "files": jobs spread over the ranks
    (:func:`assign_jobs`); "band": all ranks decode every job together, rank 0 writes; "auto": band when there are
    fewer jobs than ranks and the model allows it. Returns on rank 0 the summary of every job in job order (None
    elsewhere); a failure on any rank raises DistributedError on every rank."""
    if not dist.is_initialized():
        raise DistributedError("decode_files_distributed runs inside a process group (use vaeopt.distributed.launch)")
    if mode not in ("auto", "files", "band"):
        raise DistributedError(f"mode must be auto, files or band, not {mode!r}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = rank_device()
    say = log or (lambda s: None)

    # phase 1, every rank: read, load, plan (identical job lists and checks); nobody writes before all have checked
    jobs = pipe = None
    used_mode = mode
    err = None
    try:
        limits = limits or api.Limits()
        files = [lat.read_latents(Path(p), key, max_tensors=limits.max_outputs) for p in latents]
        model_path, _why = api.resolve_model(model, files)
        loaded = load_vae(model_path, family=family, config=config)
        jobs = api.plan_jobs(files, loaded, Path(output) if output is not None else None, latent_space, overwrite,
                             log=say if rank == 0 else None, limits=limits)
        opts = Options(**{**(options.__dict__ if options is not None else {}), "device": str(dev)})
        pipe = Pipeline(loaded, opts, log=(lambda s: say(f"[rank {rank}] {s}")), spell=spell)
        ok, why = supports_band(pipe.model)
        if mode == "auto":
            few = len(jobs) < world and world > 1  # fewer files than ranks: band mode where the model allows it
            used_mode = "band" if few and ok else "files"
            if few and not ok and rank == 0:
                say(spelled(join("band-parallel decoding not used (", why, f"): {len(jobs)} file(s) on {world} ranks, "
                                 "one rank each"), spell))
        elif mode == "band" and not ok:
            raise DistributedError("band mode: " + spelled(why, spell))
    except Exception as e:  # noqa: BLE001 - reported on every rank
        err = _describe_error(e)
    _raise_if_any(err, group, world)

    # phase 2: decode and write
    results: list[dict] = []
    err = None
    try:
        if used_mode == "files":
            mine = assign_jobs([int(j.z_raw.numel()) for j in jobs], world)[rank]
            say(f"[rank {rank}] {len(mine)} of {len(jobs)} job(s)")
            idx = {id(j): i for i, j in enumerate(jobs)}
            for r in api.run_jobs(pipe, [jobs[i] for i in mine], fps=fps):
                d = _result_dict(r, rank, "files")
                d["index"] = idx[id(r.job)]
                results.append(d)
        else:
            for i, job in enumerate(jobs):
                results.append(_band_job(pipe, job, group, rank, fps, i))
    except Exception as e:  # noqa: BLE001
        err = _describe_error(e)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (rank, err, results), group=group)
    _raise_gathered([(r, e) for r, e, _ in gathered])
    if rank != 0:
        return None
    allres = [d for _, _, res in gathered for d in res]
    if used_mode == "band":
        allres = [d for d in allres if d["rank"] == 0]
    return sorted(allres, key=lambda d: d["index"])


def _describe_error(e: BaseException) -> str:
    if isinstance(e, VaeoptError):  # user-facing: the message is the point (not our class names)
        return str(e)
    msg = "".join(traceback.format_exception_only(type(e), e)).strip()
    return msg + "\n" + "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-6)).strip()


def _raise_gathered(pairs: list[tuple[int, str | None]]) -> None:
    by_msg: dict[str, list[int]] = {}
    for r, e in pairs:
        if e:
            by_msg.setdefault(e, []).append(r)
    if by_msg:
        raise DistributedError("; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}"
                                         for m, rs in by_msg.items()))


def _raise_if_any(err: str | None, group, world: int) -> None:
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (dist.get_rank(group), err), group=group)
    _raise_gathered(gathered)


def _band_job(pipe, job, group, rank: int, fps: float, index: int) -> dict:
    z = job.z_raw.to(pipe.device, pipe.dtype)
    shape = list(z.shape)
    world = dist.get_world_size(group)
    band_shape = shape[:-2] + [max(1, math.ceil(shape[-2] / world)), shape[-1]]
    plan = pipe.plan(tuple(band_shape))
    if pipe.device.type == "cuda":
        torch.cuda.synchronize(pipe.device)
        torch.cuda.reset_peak_memory_stats(pipe.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = band_parallel_decode(pipe.model, z, group, chunk=plan.chunk or 1)
    if pipe.device.type == "cuda":
        torch.cuda.synchronize(pipe.device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(pipe.device) if pipe.device.type == "cuda" else None
    written: list[Path] = []
    if rank == 0:
        written = api.write_job(job, out.float().cpu(), fps)
    return {"source": str(job.source), "entry": job.entry, "shape": shape, "written": [str(p) for p in written],
            "seconds": seconds, "peak_bytes": peak, "plan": {**plan.to_dict(), "mode": "band", "world": world},
            "retries": [], "rank": rank, "mode": "band", "index": index}
