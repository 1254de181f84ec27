"""The optimization pipeline: applies the stages to a loaded VAE (the table in vaeopt.stage_table, in its fixed
order), plans memory, decodes.

Order (each stage logs one line: what it did with numbers, or why it was skipped):
    precision -> fp8 -> channels_last -> fused_norms -> fused_epilogues -> upsample_conv -> stacked_conv3d (Wan)
    -> triton_conv -> fp8 convs -> attention
    -> plan (tile/chunk) -> graphs, cudnn_autotune (these two decided per job: they depend on how often a shape
    repeats)
Lines that suggest a setting carry Hint groups (vaeopt.stages.Said): the Pipeline's `spell` writes them as its
caller's entry point names its options (the CLI's flags, the Python API's Options fields).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from vaeopt import planner
from vaeopt import outputs, stage_table, tiling, video, video_graphs, video_stream
from vaeopt.errors import DecodeError, VaeoptError
from vaeopt.fidelity import count_nonfinite
from vaeopt.hw import resolve_device, resolve_dtype
from vaeopt.loading import LoadedVAE, quiet_diffusers
from vaeopt.options import Options
from vaeopt.stages import Hint, Said, StageResult, join, spelled, unhooked, watch_loads, weights_epoch

STANDARD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def move_weights(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """model.to(device, dtype), except that float8 weights owned by modules with hooks keep that dtype: diffusers'
    layerwise casting stores them so and casts them per call, and casting them here would undo the memory it saves
    (and the next call would store them again). -> how many were kept."""
    keep = {id(t) for m in model.modules() if not unhooked(m)
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
            if t.is_floating_point() and t.element_size() == 1}
    if not keep:
        model.to(device, dtype)
        return 0
    model._apply(lambda t: t.to(device, dtype if t.is_floating_point() and id(t) not in keep else None))
    return len(keep)


def compute_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype a model computes in: its first fp32/bf16/fp16 parameter's (weights stored in fp8 by diffusers'
    layerwise casting are cast to the compute dtype per call, so they do not say it)."""
    return next((p.dtype for p in model.parameters() if p.dtype in STANDARD_DTYPES), None)


@dataclass
class DecodeStats:
    seconds: float = 0.0
    peak_bytes: int | None = None
    retries: list[str] = field(default_factory=list)
    tiling: dict | None = None


class Pipeline:
    def __init__(self, loaded: LoadedVAE, options: Options | None = None, log: Callable[[str], None] | None = None,
                 spell: Callable[[tuple[Hint, ...]], str] | None = None, info: stage_table.DeviceInfo | None = None):
        """spell: how the lines' hints are written where they are shown (vaeopt.stages.plain: Options fields, when
        None); each entry point passes its own (options.spell_flags, api.spell_options, ...). info: the device as the
        stage rules see it (DeviceInfo.of the device, when None)."""
        self.loaded = loaded
        self.family = loaded.family
        self.opts = options or Options()
        self.opts.validate()
        ds, cfg = self.opts.decode_shape, getattr(loaded.model, "config", None)
        ch = getattr(cfg, "latent_channels", None) or getattr(cfg, "z_dim", None)
        if ds is not None and isinstance(ch, int) and ds[1] != ch:
            raise VaeoptError(f"decode_shape {tuple(ds)}: this VAE's latents have {ch} channels, not {ds[1]}")
        self.spell = spell
        self.log = log
        self.device = resolve_device(self.opts.device)
        self.dtype = resolve_dtype(self.opts.dtype, self.device)
        self.info = info or stage_table.DeviceInfo.of(self.device)
        self.stages: list[StageResult] = []
        self.graphed = None
        self._prepare()

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def log(self) -> Callable[[str], None]:
        return self._log

    @log.setter
    def log(self, fn: Callable[[str], None] | None) -> None:
        """Every line goes out with its hints spelled for the entry point (self.spell)."""
        self._log = (lambda s: None) if fn is None else (lambda s: fn(spelled(s, self.spell)))

    def text(self, s: str) -> str:
        """A line's text (a stage's detail, a plan's reason) with its hints spelled for where it is shown."""
        return spelled(s, self.spell)

    def _record(self, r: StageResult) -> StageResult:
        self.stages.append(r)
        self.log(r.line(self.spell))
        return r

    # ---- stages: the table in vaeopt.stage_table ------------------------------------------------------------
    def _prepare(self) -> None:
        self.dtype, upcast = stage_table.precision_dtype(self.family, self.dtype, self.loaded.layout)
        watch_loads(self.model)
        ctx = stage_table.Context(self.opts, self.family, self.dtype, self.info, self.device, self.model,
                                  layout=self.loaded.layout, upcast=upcast, log=self.log)
        stage_table.apply_stages(ctx, self._record, precision=self._precision)

    def _precision(self, ctx: stage_table.Context) -> StageResult:
        """The precision row: the weights onto the device in the decode's dtype; records its line (before its notes)."""
        if ctx.upcast is not None:
            self.log(ctx.upcast)
        t0 = time.perf_counter()
        with quiet_diffusers():  # diffusers warns about `.to(dtype)` on every model; we cast deliberately
            kept = move_weights(self.model, self.device, self.dtype)
        r = self._record(StageResult("precision", "applied",
                                     f"{str(self.dtype).replace('torch.', '')} on {self.info.name} "
                                     f"({time.perf_counter() - t0:.2f} s to move weights)" + (
                                         f"; {kept} weights kept in their float8 storage (the hooks on their layers "
                                         "cast them per call, as diffusers' layerwise casting does)" if kept else "")))
        if self.device.type == "cpu" and self.dtype in (torch.float16, torch.bfloat16):
            self.log(Said("! half precision on the CPU: torch's CPU convs are much slower in fp16/bf16 than in fp32 "
                          "({0}, the CPU default)", Hint("dtype", "fp32")))
        return r

    # ---- planning -----------------------------------------------------------------------------------------
    def plan(self, latent_shape: tuple) -> planner.Plan:
        o = self.opts
        return planner.plan_decode(self.family, self.model, tuple(latent_shape), self.dtype, self.device,
                                   vram_budget_gb=o.vram_budget_gb, tile=o.tile, chunk=o.chunk, tiling=o.tiling)

    def setup_graphs(self, plan: planner.Plan, latent_shape: tuple | None = None, repeats: int = 1,
                     chunks: bool = True, reason: str | None = None):
        """The graphs stage, decided by the table (stage_table.decide_graphs) for `repeats` decodes of
        `latent_shape` under `plan`, applied and logged: whole decodes captured (GraphedDecode), Wan's per-chunk
        graphs armed (-> the policy, whose report_to gives the measured line after the decodes), or a skip line.
        reason: the line's reason for captured whole decodes instead of the table's."""
        d = stage_table.decide_graphs(self.opts, self.family, self.info, plan, latent_shape, repeats, chunks,
                                      self._variant())
        if d.kind == "chunks":
            pol = video_graphs.enable(self.model, stage_table.chunk_graphs(d.why, self.info, plan.budget_bytes))
            self._record(stage_table.chunk_graphs_armed(d.why))
            return pol
        if self.family.cls_name == "AutoencoderKLWan" and chunks:
            video_graphs.disable(self.model)
        if d.kind == "whole":
            self.enable_graphs(reason or d.why)
        else:
            self._record(StageResult.skipped("graphs", d.why))
        return None

    def _variant(self) -> str:
        """The graphs table's row variant: "8bit" once the fp8 convs applied."""
        return "8bit" if any(s.name == "fp8 convs" and s.status == "applied" for s in self.stages) else "bf16"

    def autotune(self, repeats: int, plan: planner.Plan | None = None) -> StageResult:
        """Decide (stage_table.decide_autotune) and apply (or log why not) cuDNN autotuning for `repeats` same-shape
        decodes of `plan`; once per pipeline."""
        done = next((s for s in self.stages if s.name == "cudnn_autotune"), None)
        if done is not None:
            return done
        mod = stage_table.stage("cudnn_autotune")
        use, why = stage_table.decide_autotune(self.opts.cudnn_autotune, self.info, repeats,
                                               plan.est_bytes if plan else None, plan.budget_bytes if plan else None)
        return self._record(mod.apply(why) if use else StageResult.skipped("cudnn_autotune", why))

    def count_decode(self, latent_shape: tuple, plan: planner.Plan) -> None:
        """Decodes that arrive one call at a time (vaeopt.decode per image, as a diffusers pipeline calls its VAE):
        count them per shape, and capture a shape once the measured rule (planner.graphs_pay) says its decodes so far
        would have repaid the capture. Waiting for that many costs at most as much again as knowing the count up
        front (the break-even rule of renting before buying); shapes that never repeat enough stay eager."""
        shape = tuple(latent_shape)
        whole = plan.mode == "whole" or stage_table.one_chunk_clip(self.family, plan, shape)  # (a Qwen-Image picture)
        if not whole or not self.info.graphs[0]:
            return
        seen = self.__dict__.setdefault("_calls", {})
        seen[shape] = seen.get(shape, 0) + 1
        allowed = self.__dict__.setdefault("_graph_shapes", set())
        if shape in allowed:
            return
        d = stage_table.decide_call_graphs(self.opts.graphs, self.family, shape, seen[shape], plan.est_bytes,
                                           plan.budget_bytes, self._variant(), gpu=self.info.gpu, plan=plan)
        if d.kind == "whole":
            allowed.add(shape)
            if self.graphed is None:
                self.enable_graphs(join(d.why, ", counted over calls"))

    def enable_graphs(self, reason: str) -> None:
        mod = stage_table.stage("graphs")
        wan = self.family.cls_name == "AutoencoderKLWan"  # (one-chunk clips: stage_table.one_chunk_clip)
        self.graphed, r = mod.apply(self._decode_clip_raw if wan else self._decode_whole_raw, self.device)
        self._graphs_epoch = weights_epoch(self.model)
        r.detail = join(r.detail, " (", reason, ")")
        self._record(r)

    def report_graphs(self) -> list[StageResult]:
        """The graphs stage lines brought up to date after the decodes (whole-decode CUDA graphs are captured during
        them): applied where something was captured, else skipped, with the counts. [] when graphs were not enabled."""
        if self.graphed is None:
            return []
        lines = [s for s in self.stages if s.name == "graphs"]
        for s in lines:
            s.status = "applied" if self.graphed.captures else "skipped"
            s.detail = self.graphed.report()
            s.data = {"replays": self.graphed.replays, "captures": self.graphed.captures}
        return lines

    # ---- decoding -----------------------------------------------------------------------------------------
    def _decode_whole_raw(self, z: torch.Tensor) -> torch.Tensor:
        return self.model.decode(z).sample

    def _decode_clip_raw(self, z: torch.Tensor) -> torch.Tensor:
        """A Wan clip in one decoder call, as a graph captures it: a fresh chunk decoder (its causal caches zeroed
        inside the call), no per-chunk graphs, no OOM retry (the caller retries eagerly)."""
        return video.decode_video(self.model, z, chunk=z.shape[2], graphs="off")

    def _graphed_for(self, z: torch.Tensor):
        """The captured-decode wrapper when this decode takes it (graphs enabled and not off, and for counted calls
        a shape that has paid), else None. Weights changed since the capture: captured again."""
        if self.graphed is None or self.opts.graphs == "off":
            return None
        if (now := weights_epoch(self.model)) != self._graphs_epoch:
            self.graphed.reset()  # the weights changed (in place, vaeopt.refresh, load_state_dict): capture again
            self._graphs_epoch = now
        only = self.__dict__.get("_graph_shapes")  # per-call counting: only the shapes that have paid
        return self.graphed if only is None or tuple(z.shape) in only else None

    def decode(self, z_raw: torch.Tensor, plan: planner.Plan | None = None,
               progress: Callable[[int, int], None] | None = None,
               to_host: bool = True) -> tuple[torch.Tensor, DecodeStats]:
        """Raw latents -> decoded tensor in [-1, 1] (float32 on CPU). Video: (N,3,T,H,W). to_host=False: float32
        where the decoder left it (the GPU for image decodes), for a caller that post-processes it there."""
        plan = plan or self.plan(tuple(z_raw.shape))
        stats = DecodeStats()
        z = z_raw.to(self.device, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            if self.family.is_video:
                out = self._decode_video(z, plan, progress, stats)
            else:
                out = self._decode_image(z, plan, stats, progress)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            stats.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        stats.seconds = time.perf_counter() - t0
        return (out.float().cpu() if to_host else out.float()), stats

    def _decode_image(self, z, plan, stats: DecodeStats, progress) -> torch.Tensor:
        if plan.mode == "tiled":
            out, info = tiling.tiled_decode(self.model, z, tile=plan.tile, progress=progress,
                                            vram_budget=plan.budget_bytes, return_info=True)
            self._tiling_report(info, stats)
            return out
        try:
            return (self._graphed_for(z) or self._decode_whole_raw)(z)
        except torch.cuda.OutOfMemoryError:
            # OOM: free what the failed attempt held, decode again with the planner's tiled plan, and go on.
            torch.cuda.empty_cache()
            p = planner.smaller_whole_plan(self.family, self.model, tuple(z.shape), self.dtype, plan)
            stats.retries.append(f"out of memory in whole decode (est. {planner.gib(plan.est_bytes)}): "
                                 f"retrying tiled with {p.tile * self.family.spatial_factor}px tiles")
            self.log("↩ " + stats.retries[-1])
            out, info = tiling.tiled_decode(self.model, z, tile=p.tile, progress=progress, vram_budget=p.budget_bytes,
                                            return_info=True)
            self._tiling_report(info, stats)
            return out

    def _tiling_report(self, info: dict, stats: DecodeStats) -> None:
        f = self.family.spatial_factor
        stats.tiling = {k: v for k, v in info.items() if k != "oom_events"}
        if info.get("shrinks"):
            stats.retries.append(f"tiled decode ran out of memory {info['shrinks']}x: tile shrank "
                                 f"{info['tile'][0] * f}px -> {info['final_tile'][0] * f}px; finished tiles kept")
            self.log("↩ " + stats.retries[-1])

    @staticmethod
    def video_tiling_kwargs(plan: planner.Plan) -> dict:
        """decode_video / iter_decode_video keywords for a tiled video plan: spatial tile, split, cache storage."""
        if plan.mode != "tiled":
            return {}
        return {"tile": plan.tile, "split": plan.split, "storage": plan.storage or "device"}

    @staticmethod
    def _video_kwargs(plan: planner.Plan, info: dict) -> dict:
        # replan: a CUDA out-of-memory error restarts the clip with the planner's smaller plan (tile, then chunk, then
        # host caches; never the same plan twice); frames already handed out are not repeated.
        return {"chunk": plan.chunk or 1, "replan": planner.smaller_video_plan, "info": info,
                **Pipeline.video_tiling_kwargs(plan)}

    def _video_report(self, info: dict, stats: DecodeStats | None) -> None:
        if not info or stats is None:
            return
        stats.tiling = {"plan": info["plan"].describe(self.model), "tiles": info.get("tiles"),
                        "halo": info.get("halo"), "shrinks": info.get("shrinks", 0),
                        **{k: info[k] for k in ("cache_bytes", "bytes_h2d", "bytes_d2h") if k in info}}
        for ev in info.get("oom_events", []):
            nxt = ev["next"].describe(self.model) if ev["next"] is not None else "nothing smaller"
            stats.retries.append(f"out of memory in the video decode ({ev['plan'].describe(self.model)}) after "
                                 f"{ev['frames_done']} frames: decoded again with {nxt}, frames already out kept")
            self.log("↩ " + stats.retries[-1])

    def _decode_video(self, z, plan, progress, stats: DecodeStats | None = None) -> torch.Tensor:
        if video_stream.applies(self.model):  # HunyuanVideo 1.5, LTX-2: exact chunks and tiles (planner._plan_stream)
            info: dict = {}
            out = video_stream.decode_clip(self.model, z, plan.chunk or 1, tile=plan.tile if plan.mode == "tiled"
                                           else None, split=plan.split, replan=planner.smaller_stream_plan,
                                           info=info, progress=progress)
            if stats is not None:
                stats.tiling = {k: info[k] for k in ("chunk", "tile", "split", "halo", "tiles") if k in info}
                for ev in info["oom_events"]:
                    stats.retries.append(f"out of memory in the video decode (chunk {ev['chunk']}, tile {ev['tile']}):"
                                         f" decoded again with chunk {ev['next'][0]}, tile {ev['next'][1]}")
                    self.log("↩ " + stats.retries[-1])
            return out
        if self.family.cls_name != "AutoencoderKLWan":
            # vaeopt.video's exact chunk decoder covers Wan; HunyuanVideo runs diffusers' decode (planner._plan_hunyuan)
            return self._decode_hunyuan(z, plan, stats)
        g = self._graphed_for(z) if stage_table.one_chunk_clip(self.family, plan, tuple(z.shape)) else None
        if g is not None:
            try:
                return g(z)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()  # the eager decode below retries with smaller plans
                if stats is not None:
                    stats.retries.append("out of memory in the captured one-chunk decode: decoded eagerly")
        info: dict = {}
        out = video.decode_video(self.model, z, progress=progress, **self._video_kwargs(plan, info))
        self._video_report(info, stats)
        return out

    def _decode_hunyuan(self, z, plan: planner.Plan, stats: DecodeStats | None) -> torch.Tensor:
        """diffusers' HunyuanVideo decode, in its spatial tiles where the plan says so; an untiled decode that runs
        out of memory is decoded again in the planner's tiles (planner.smaller_whole_plan), where the frames are
        larger than a tile (else the error stands)."""
        if plan.mode == "tiled":
            return self._hunyuan_tiled(z, plan.tile)
        try:
            return self.model.decode(z).sample.clamp(-1, 1)
        except torch.cuda.OutOfMemoryError:
            retry = planner.smaller_whole_plan(self.family, self.model, tuple(z.shape), self.dtype, plan)
            if retry is None:
                raise
        # retried outside the except block: its traceback would keep the failed attempt's tensors alive
        torch.cuda.empty_cache()
        side = retry.tile * self.family.spatial_factor
        msg = (f"out of memory in the untiled decode (est. {planner.gib(plan.est_bytes)}): decoding again in "
               f"diffusers' spatial tiles of {side}px (approximate)")
        if stats is not None:
            stats.retries.append(msg)
        self.log("↩ " + msg)
        return self._hunyuan_tiled(z, retry.tile)

    def _hunyuan_tiled(self, z, tile: int) -> torch.Tensor:
        """diffusers' tiled HunyuanVideo decode with tile sides of `tile` latent px, a quarter overlap
        (planner.hunyuan_stride), the model's own tiling settings restored afterwards."""
        m = self.model
        keys = ("use_tiling", "tile_sample_min_height", "tile_sample_min_width", "tile_sample_stride_height",
                "tile_sample_stride_width", "tile_latent_min_height", "tile_latent_min_width", "tile_overlap_factor")
        saved = {k: getattr(m, k) for k in keys if hasattr(m, k)}
        f = self.family.spatial_factor
        side, stride = tile * f, planner.hunyuan_stride(tile) * f
        if hasattr(m, "tile_overlap_factor"):  # HunyuanVideo 1.5: latent tile sides and an overlap fraction
            m.enable_tiling(tile_sample_min_height=side, tile_sample_min_width=side, tile_latent_min_height=tile,
                            tile_latent_min_width=tile, tile_overlap_factor=1 - stride / side)
        else:  # HunyuanVideo, LTX-2: sample tile sides and strides
            m.enable_tiling(tile_sample_min_height=side, tile_sample_min_width=side,
                            tile_sample_stride_height=stride, tile_sample_stride_width=stride)
        try:
            return m.decode(z).sample.clamp(-1, 1)
        finally:
            for k, v in saved.items():
                setattr(m, k, v)

    def iter_video(self, z_raw: torch.Tensor, plan: planner.Plan,
                   stats: DecodeStats | None = None) -> Iterator[torch.Tensor]:
        """Stream uint8 (T,H,W,3) frame groups of the first clip in the batch, for MP4 writing. A tiled plan hands
        out each chunk once all its tiles are done. `stats` gets the OOM retries and tiling info at the end."""
        z = z_raw.to(self.device, self.dtype)
        with torch.inference_mode():
            if self.family.cls_name != "AutoencoderKLWan":
                y = self._decode_video(z, plan, None, stats)
                if count_nonfinite(y):  # uint8 would turn NaN/Inf into black pixels
                    raise DecodeError("the decoder produced non-finite values (NaN/Inf)")
                yield outputs.to_uint8_images(y)[0]
                return
            info: dict = {}
            yield from video.iter_decode_video(self.model, z, **self._video_kwargs(plan, info))
            self._video_report(info, stats)
