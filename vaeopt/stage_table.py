"""The stages in one table: each stage's name, the option that switches it, what it needs, what it conflicts with
and its auto rule. `apply_stages` walks the table in its order once per pipeline; `decide_graphs` and
`decide_autotune` make the two decisions that depend on how often a shape repeats, per job, and
`decide_chunk_graphs` Wan's per-chunk graphs, per clip. Every automatic decision about a stage is made here (the
planner decides whole, tiled or chunked, and the smaller plan after an out-of-memory error), including where a
stage pays (the GPUs it was measured on). A stage module does the work and keeps only its per-layer checks (which layers it
takes) and whether its kernels can run at all.

A rule reads the device through `DeviceInfo`, so that the decisions can be computed without the device itself
(`decide_stages`: what a pipeline would do, for tests and for `vaeopt info`'s outlook alike).

Each check of a row gives a skip reason (or None); the first reason wins, in this order: the option is "off",
the row's gate (where the hardware or the family rules it out), its needs (stages that must have applied), its
conflicts, its auto rule. A reason that suggests a setting is a `Said` with Hint groups, which each entry point
spells its own way.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from vaeopt import planner, video, video_graphs
from vaeopt.kernels import interpreter_hint
from vaeopt.stages import Hint, Said, StageResult, join, unmeasured_gpu

# CUDA graphs in auto mode: where the measured table says replay repays the capture (planner.graphs_pay reads
# configs/graphs_rule.json).

# measured: benchmarks/results/h100_hunyuan-stages_2026-11-22.json (docs/experiments.md E39: about 2x slower with it)
HUNYUAN_CL_SKIP = Said("HunyuanVideo's causal convs pad with F.pad(mode='replicate'), which returns NCDHW, so with "
                       "channels_last_3d weights every conv would convert its input and output ({0} to force)",
                       Hint("channels_last", "on"))


def stage(name: str):
    """The stage module `name` (vaeopt.stages.<name>), imported when a pipeline first needs it."""
    return importlib.import_module(f"vaeopt.stages.{name}")


@dataclass(frozen=True)
class DeviceInfo:
    """What the rules know of the device: a real one (`DeviceInfo.of`) or one written out (tests: a GPU they do not
    have). Each pair is (available, why not)."""
    type: str  # "cpu" or "cuda"
    name: str = "CPU"
    capability: tuple[int, int] | None = None  # CUDA compute capability, (9, 0) on an H100 / H200
    triton: tuple[bool, str] = (False, "")  # our Triton kernels run here (the fused norms' check)
    fp8_compute: tuple[bool, str] = (False, "")  # FP8 tensor cores (levels 2 and 3)
    fp8_storage: tuple[bool, str] = (True, "")  # e4m3 weight storage (level 1): torch's float8_e4m3fn
    graphs: tuple[bool, str] = (False, "no CUDA device: CUDA graphs need a GPU")
    cudnn: tuple[bool, str] = (False, "no CUDA device: cuDNN runs on the GPU only")

    @property
    def gpu(self) -> str:
        """The device's name as torch reports it, without the "(cuda:N)" that `of` adds: what measured tables
        (configs/graphs_rule.json) name their GPU by."""
        return self.name.split(" (cuda")[0]

    @classmethod
    def of(cls, device: torch.device) -> "DeviceInfo":
        name = f"{torch.cuda.get_device_name(device)} ({device})" if device.type == "cuda" else "CPU"
        try:
            triton = stage("fused_norms").available(device)
        except ImportError as e:
            triton = (False, f"fused norm kernels not importable ({e})")
        fp8 = stage("fp8")
        cap = tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
        return cls(device.type, name, cap, triton, fp8.available(device, compute=True),
                   fp8.available(device, compute=False), stage("graphs").available(device),
                   stage("cudnn_autotune").available(device))


@dataclass
class Context:
    """One pipeline's inputs to the rules, and the results so far."""
    opts: object  # vaeopt.Options
    family: object  # FamilySpec
    dtype: torch.dtype
    info: DeviceInfo
    device: torch.device | None = None  # None: deciding only (decide_stages), nothing is applied
    model: torch.nn.Module | None = None
    layout: str = ""  # LoadedVAE.layout ("in-memory" for optimize(pipe.vae): its family is a guess)
    done: dict[str, StageResult] = field(default_factory=dict)
    upcast: Said | None = None  # why the dtype was raised to fp32 (precision_dtype)
    log: object = None  # where stages that measure (the FP8 gates) say what they measured or reused

    def applied(self, name: str) -> bool:
        r = self.done.get(name)
        return r is not None and r.status == "applied"

    @property
    def cls(self) -> str:
        return self.family.cls_name

    def kw(self, **extra) -> dict:
        return {"device": self.device, "dtype": self.dtype, **extra}


def precision_dtype(family, dtype: torch.dtype, layout: str) -> tuple[torch.dtype, Said | None]:
    """The dtype the decode runs in, and why it differs from the one asked for: fp16 overflows in the SDXL VAE (not
    for optimize(pipe.vae): its family is a guess, and a diffusers pipeline upcasts the VAE itself where its config
    says force_upcast)."""
    if dtype == torch.float16 and family.name == "sdxl" and layout != "in-memory":
        return torch.float32, Said("! fp16 overflows in the SDXL VAE (NaN outputs): using fp32 (or pick {0})",
                                   Hint("dtype", "bf16"))
    return dtype, None


def channels_last_veto(family) -> Said | None:
    """Why channels_last stays off in auto mode for this family whatever the device and the other stages (None:
    no such reason): what the pipeline logs, and what the benchmark ladder's channels_last row follows instead of
    forcing it on."""
    if family.cls_name == "AutoencoderKLHunyuanVideo":
        return HUNYUAN_CL_SKIP
    return None


def level3(ctx: Context) -> bool:
    """Whether the fp8 option means level 3 (e4m3 implicit-GEMM convs written by the fused norms) rather than levels
    1-2: Wan always (its fused chunk decoder has no room for storage hooks), AutoencoderKL for 16-bit decodes on a
    GPU with FP8 tensor cores. Decided from the family and hardware, not the other switches, so that a ladder row
    with the Triton path still off says why fp8 waits instead of running levels 1-2 there."""
    if ctx.cls == "AutoencoderKLWan":
        return True
    return ctx.cls == "AutoencoderKL" and ctx.dtype in (torch.bfloat16, torch.float16) and ctx.info.fp8_compute[0]


def _conv8(ctx: Context) -> bool:
    return ctx.opts.fp8 in ("on", "auto") and level3(ctx)


def _fused(ctx: Context) -> tuple[bool, str]:
    """Whether the fused norm kernels run here in auto mode, and why not: on the CPU only through the interpreter
    (tests), so auto leaves them off there."""
    if ctx.info.type != "cuda" and ctx.opts.triton == "auto":
        return False, Said("CPU decode: Triton kernels would run only through the interpreter (" + interpreter_hint()
                           + ")", Hint("triton", "on"))
    return ctx.info.triton


def _want_fused(ctx: Context) -> bool:
    return ctx.opts.triton == "on" or (ctx.opts.triton == "auto" and _fused(ctx)[0])


# ---- the rows' rules: each returns a skip reason, or None ------------------------------------------------------


def _fp8_gate(ctx: Context):
    if ctx.opts.fp8 == "off":
        return Said("off (enable with {0}; gated at " + f"{ctx.opts.gate_db:g} dB vs the fp32 decode)",
                    Hint("fp8", "on"))
    if _conv8(ctx):
        return Said("FP8 compute runs as 8-bit implicit-GEMM convs ('fp8 convs', after the fused path is set up); "
                    "weight-storage hooks would disable that path ({0} or {1}: levels 1-2 instead)",
                    Hint("fp8", "weights"), Hint("fp8", "gemm"))
    ok, why = ctx.info.fp8_storage if ctx.opts.fp8 == "weights" else ctx.info.fp8_compute
    if not ok:
        if "tensor cores" in why or "GPU" in why:
            return join(why, Said(" ({0}, level 1 alone, runs without them)", Hint("fp8", "weights")))
        return why
    return None


def _fp8_apply(ctx: Context) -> StageResult:
    return stage("fp8").apply(ctx.model, family=ctx.family, gate_db=ctx.opts.gate_db, device=ctx.device,
                              dtype=ctx.dtype, compute=ctx.opts.fp8 != "weights", log=ctx.log)


def _channels_last_auto(ctx: Context):
    o, cls = ctx.opts, ctx.cls
    if o.channels_last == "auto" and (veto := channels_last_veto(ctx.family)):
        return veto
    if o.channels_last == "auto" and _cl_alone(ctx):
        return None
    if o.channels_last == "on" or (_want_fused(ctx) and cls != "AutoencoderTiny"):
        return None
    if cls == "AutoencoderTiny":
        return "TAESD is too small to gain from NHWC"
    return join("fused NHWC norm kernels unavailable (", _fused(ctx)[1], "); aten GroupNorm relayouts NHWC inputs, "
                "which is slower")


def _cl_alone(ctx: Context) -> bool:
    """channels_last without the fused norms: it pays on the CPU (aten's NHWC convs and norms), not on CUDA."""
    return stage("channels_last").alone_pays(ctx.info) and not _want_fused(ctx)


def _channels_last_apply(ctx: Context) -> StageResult:
    r = stage("channels_last").apply(ctx.model)
    if ctx.opts.channels_last == "auto" and _cl_alone(ctx):
        r.detail += " (on the CPU it pays without the fused kernels)"
    return r


def _fused_norms_gate(ctx: Context):
    ok, why = _fused(ctx)
    return why if not ok and ctx.opts.triton == "auto" else None


def _upsample_conv_auto(ctx: Context):
    """On the CPU the stock upsample + conv stays (bitwise diffusers'); on any GPU the phase convs pay."""
    if ctx.opts.upsample_conv == "auto" and ctx.info.type != "cuda":
        return stage("upsample_conv").cpu_reason(ctx.cls)
    return None


def _upsample_conv_apply(ctx: Context) -> StageResult:
    return stage("upsample_conv").apply(ctx.model, **ctx.kw())


def _stacked_absent(ctx: Context):
    """Image VAEs have no causal Conv3d: a line only where the stage was asked for by name."""
    if ctx.opts.stack_conv3d == "on":
        return Said("{0} has nothing to stack: it is for Wan's causal Conv3d, and " + f"{ctx.family.title} has none",
                    Hint("stack_conv3d", "on"))
    return None


def _stacked_auto(ctx: Context):
    """auto: on a CUDA GPU it was measured on (the stack is written by the fused kernels)."""
    if ctx.opts.stack_conv3d == "on":
        return None
    mod = stage("stacked_conv3d")
    ok, why = mod.available(ctx.info)
    return why if not ok else unmeasured_gpu(ctx.info, mod.MEASURED_SM, "the Conv3d", "stack_conv3d")


def _stacked_apply(ctx: Context) -> StageResult:
    # the 96-ch convs go to triton_conv's TMA kernel only if that stage will run (it comes next)
    runs = _skip_reason(ROWS_BY_NAME["triton_conv"], ctx) is None
    return stage("stacked_conv3d").apply(ctx.model, **ctx.kw(force=ctx.opts.stack_conv3d == "on",
                                                             triton_conv_runs=runs))


def _triton_conv_gate(ctx: Context):
    if ctx.info.type != "cuda" and ctx.opts.conv_kernel == "auto":
        return Said("CPU decode: the Triton conv would run only through the interpreter (" + interpreter_hint() + ")",
                    (Hint("triton", "on"), Hint("conv_kernel", "on")))
    return None


def _triton_conv_conflict(ctx: Context):
    if ctx.dtype == torch.float32 and ctx.info.type == "cuda":
        return "fp32 decode: cuDNN kept (the kernel's fp32 dot would use TF32)"
    return None


def _triton_conv_auto(ctx: Context):
    """Where Triton runs (the CPU only forced, through the interpreter: tests); auto: GPUs it was measured on."""
    mod = stage("triton_conv")
    if ctx.info.type != "cuda" and not (ctx.opts.conv_kernel == "on" and ctx.info.triton[0]):
        return mod.available(ctx.info)[1]
    if ctx.info.type == "cuda" and not ctx.info.triton[0]:
        return ctx.info.triton[1]
    return None if ctx.opts.conv_kernel == "on" else unmeasured_gpu(ctx.info, mod.MEASURED_SM, "cuDNN", "conv_kernel")


def _fp8_convs_gate(ctx: Context):
    if ctx.opts.conv_kernel == "off":
        return Said("{0} (the e4m3 convs are Triton kernels)", Hint("conv_kernel", "off"))
    return None if ctx.info.fp8_compute[0] else ctx.info.fp8_compute[1]


def _fp8_convs_apply(ctx: Context) -> StageResult:
    # the gate decodes Wan with the chunk decoder the decodes will use
    decode = video.decode_video if ctx.cls == "AutoencoderKLWan" else None
    return stage("triton_conv").apply_fp8(ctx.model, ctx.device, ctx.dtype, ctx.opts.gate_db,
                                          decode_shape=ctx.opts.decode_shape, decode=decode, log=ctx.log)


@dataclass(frozen=True)
class Row:
    """One stage. `present`: whether the family has anything for it (else `absent` gives the line, or None for
    none); `option`: the Options field that switches it; `needs`: (stage, why) pairs that must have applied;
    `gate`, `conflict`, `auto`: rules giving a skip reason or None; `apply`: the work, on the model."""
    name: str
    option: str | None
    apply: Callable[[Context], StageResult]
    needs: tuple[tuple[str, str], ...] = ()
    gate: Callable[[Context], object] | None = None
    conflict: Callable[[Context], object] | None = None
    auto: Callable[[Context], object] | None = None
    present: Callable[[Context], bool] | None = None
    absent: Callable[[Context], object] | None = None
    off: Callable[[Context], object] | None = None  # the reason when the option is "off" (default "off")


# The order is fixed: precision first (weights on the device, in the decode's dtype); channels_last before the
# kernels that read NHWC; the fused norms before the epilogues that fold biases into them; upsample_conv after the
# epilogues (it runs inside their Upsample2D forward); stacked_conv3d before triton_conv (it decides which convs it
# leaves to it); the fp8 convs after every conv has its place; attention last.
ROWS: tuple[Row, ...] = (
    Row("precision", None, lambda c: None),  # applied by the pipeline (it moves the weights): apply_stages(precision=)
    Row("fp8", "fp8", _fp8_apply, gate=_fp8_gate, off=_fp8_gate),
    Row("channels_last", "channels_last", _channels_last_apply, auto=_channels_last_auto),
    Row("fused_norms", "triton", lambda c: stage("fused_norms").apply(c.model), gate=_fused_norms_gate),
    Row("fused_epilogues", "epilogues", lambda c: stage("fused_epilogues").apply(c.model, device=c.device),
        needs=(("fused_norms", "needs the fused norms (they carry the folded biases)"),)),
    Row("upsample_conv", "upsample_conv", _upsample_conv_apply, auto=_upsample_conv_auto),
    Row("stacked_conv3d", "stack_conv3d", _stacked_apply,
        needs=(("channels_last", "needs channels_last_3d activations (the stack is NHWC)"),),
        present=lambda c: c.cls == "AutoencoderKLWan", absent=_stacked_absent, auto=_stacked_auto),
    Row("triton_conv", "conv_kernel", lambda c: stage("triton_conv").apply(c.model, **c.kw()),
        needs=(("channels_last", "needs channels_last activations (the kernel reads NDHWC)"),),
        gate=_triton_conv_gate, conflict=_triton_conv_conflict, auto=_triton_conv_auto),
    Row("fp8 convs", None, _fp8_convs_apply, gate=_fp8_convs_gate, present=_conv8),
    Row("attention", "attention", lambda c: stage("attention").apply(c.model, **c.kw())),
)
ROWS_BY_NAME = {r.name: r for r in ROWS}


def _skip_reason(row: Row, ctx: Context):
    """The first reason `row` does not run in ctx, or None (it runs)."""
    if row.option is not None and getattr(ctx.opts, row.option) == "off":
        return row.off(ctx) if row.off else "off"
    if row.gate is not None and (why := row.gate(ctx)) is not None:
        return why
    for need, why in row.needs:
        if not ctx.applied(need):
            return why
    for check in (row.conflict, row.auto):
        if check is not None and (why := check(ctx)) is not None:
            return why
    return None


def apply_stages(ctx: Context, record: Callable[[StageResult], StageResult],
                 precision: Callable[[Context], StageResult]) -> None:
    """Walk the table in order: each row's line goes to `record` (and into ctx.done). `precision` does the first
    row's work (the pipeline moves the weights). With ctx.model None nothing is applied: a row that would run is
    recorded as applied with "would run" (decide_stages)."""
    dry = ctx.model is None
    for row in ROWS:
        if row.present is not None and not row.present(ctx):
            line = row.absent(ctx) if row.absent else None
            if line is not None:
                ctx.done[row.name] = record(StageResult.skipped(row.name, line))
            continue
        why = _skip_reason(row, ctx)
        if why is not None:
            r = StageResult.skipped(row.name, why)
        elif dry:
            r = StageResult(row.name, "applied", "would run")
        elif row.name == "precision":  # records its own line, and the notes that follow it
            ctx.done[row.name] = precision(ctx)
            continue
        else:
            r = row.apply(ctx)
        ctx.done[row.name] = record(r)


def decide_stages(opts, family, dtype: torch.dtype, info: DeviceInfo, layout: str = "") -> list[StageResult]:
    """What a pipeline with these options would do on that device, stage by stage, without a model: rows that would
    run say "would run" (a stage's own per-layer checks may still skip it there)."""
    opts.validate()
    dtype, upcast = precision_dtype(family, dtype, layout)
    ctx = Context(opts, family, dtype, info, layout=layout, upcast=upcast)
    out: list[StageResult] = []
    apply_stages(ctx, lambda r: out.append(r) or r, precision=None)
    return out


# ---- per job: CUDA graphs and cuDNN autotuning -------------------------------------------------------------------


def _graphs_auto(family, latent_shape: tuple | None, repeats: int, variant: str, gpu: str | None) -> "GraphsDecision":
    """The graphs auto rule for a whole image decode on the GPU named `gpu` (the measured table, planner.graphs_pay):
    captured whole with the table's reason, or not with why not (and the hint that forces them)."""
    if latent_shape is None:
        return GraphsDecision(None, Said("the latent shape is not known here ({0} to force)", Hint("graphs", "on")))
    pay, why = planner.graphs_pay(family, tuple(latent_shape), repeats, variant, gpu)
    if pay:
        return GraphsDecision("whole", why)
    return GraphsDecision(None, Said(why.replace("{", "{{").replace("}", "}}") + " ({0} to force)",
                                     Hint("graphs", "on")))


def one_chunk_clip(family, plan, latent_shape: tuple | None) -> bool:
    """A Wan clip that decodes in one untiled decoder call (a Qwen-Image picture: one latent frame): the chunk
    decoder's causal caches start from zeros on every decode, so the decode is a pure function of its latents and is
    captured whole, like an image decode (per-chunk graphs need two steady chunks after the first, which it has not)."""
    return (family.cls_name == "AutoencoderKLWan" and plan is not None and plan.mode != "tiled"
            and latent_shape is not None and len(latent_shape) == 5 and (plan.chunk or 1) >= latent_shape[2])


@dataclass(frozen=True)
class GraphsDecision:
    """kind: "whole" (capture whole decodes: GraphedDecode), "chunks" (arm Wan's per-chunk graphs with the option's
    mode: chunk_graphs, decided per clip from its schedule by decide_chunk_graphs), or None (no graphs: `why`)."""
    kind: str | None
    why: str


def decide_graphs(opts, family, info: DeviceInfo, plan, latent_shape: tuple | None, repeats: int,
                  chunks: bool = True, variant: str = "bf16") -> GraphsDecision:
    """The graphs stage for a run whose first job has `plan` and `latent_shape`, decoded `repeats` times. chunks:
    the caller arms Wan's per-chunk graphs (vaeopt decode, vaeopt.decode); the benchmark's rows capture whole
    decodes only. A Wan clip decoded in one untiled chunk (one_chunk_clip: a Qwen-Image picture) is a whole decode
    either way: captured whole under the image rule."""
    if opts.graphs == "off":
        return GraphsDecision(None, "off")
    ok, why = info.graphs
    if not ok:
        return GraphsDecision(None, why)
    shape = latent_shape or opts.decode_shape
    one = one_chunk_clip(family, plan, shape)
    if family.cls_name == "AutoencoderKLWan" and chunks and not one:
        return GraphsDecision("chunks", opts.graphs)
    if plan.mode != "whole" and not one:
        if family.cls_name == "AutoencoderKLWan" and plan.mode == "chunked":
            return GraphsDecision(None, "chunked decode of several chunks: a Wan clip is captured whole only where it "
                                        "decodes in one untiled chunk")
        return GraphsDecision(None, f"{plan.mode} decode: graphs are captured for whole decodes only")
    if family.is_video and not one:
        if family.cls_name == "AutoencoderKLWan":
            return GraphsDecision(None, "Wan: the whole-clip graph does not apply; per-chunk graphs are decided per "
                                        "clip")
        return GraphsDecision(None, "video decodes loop over chunks in Python; per-chunk graphs exist for Wan only")
    if opts.graphs == "on":
        return GraphsDecision("whole", "forced on")
    return _graphs_auto(family, shape, repeats, variant, info.gpu)


def decide_call_graphs(mode: str, family, latent_shape: tuple, calls: int, est_bytes: int, room_bytes: int | None,
                       variant: str = "bf16", gpu: str | None = None, plan=None) -> GraphsDecision:
    """The graphs stage for decodes that arrive one call at a time (vaeopt.decode per image, or a pipeline calling an
    optimized vae.decode): after `calls` decodes of `latent_shape` so far, capture it now? Whole image decodes and
    one-chunk Wan clips (`plan`: the clip's plan, one_chunk_clip) only; in auto mode, where the measured rule says
    the calls so far would have repaid a capture (waiting for that many costs at most as much again as knowing the
    count up front) and where `room_bytes` (the budget, or the device's free memory) holds the graph's pool next to a
    decode (twice the decode's estimate `est_bytes`). gpu: the device's name (DeviceInfo.gpu), which the measured
    rows are matched by."""
    if mode == "off":
        return GraphsDecision(None, "off")
    if family.is_video and not one_chunk_clip(family, plan, latent_shape):
        return GraphsDecision(None, "video decodes: per-chunk graphs are decided per clip")
    if mode == "auto" and room_bytes is not None and 2 * est_bytes > room_bytes:
        return GraphsDecision(None, "a captured shape keeps a decode's transients in the graph's pool, and there is no "
                                    "room for them next to the decode")
    if mode == "on":
        return GraphsDecision("whole", "forced on")
    return _graphs_auto(family, latent_shape, calls, variant, gpu)


# ---- per clip: Wan's per-chunk graphs (vaeopt.video_graphs captures and replays) ---------------------------------

# auto: graphs for clips with at least AUTO_MIN_STEADY steady chunks (after the first) whose output is at most
# AUTO_MAX_CHUNK_PIXELS per call (E14): large chunks are GPU-bound, so a replay gains nothing and the capture costs
# ~10 ms per clip; at 128x128 a replay saves ~1.5 ms, so the capture is repaid after ~6 chunks.
AUTO_MIN_STEADY = 8
AUTO_MAX_CHUNK_PIXELS = 512 * 512 * 2
MIN_STEADY = 2  # one warm-up chunk, then one to capture and replay


def decide_chunk_graphs(mode: str, info: DeviceInfo, sched, tiles: int = 1, chunk_pixels: int | None = None,
                        capturing: bool = False) -> tuple[bool, object]:
    """(capture this clip, why) for Wan's per-chunk graphs in `mode` (auto | on | off) on the device `info`
    describes, for a clip decoded with the chunk schedule `sched` in `tiles` spatial tiles; chunk_pixels: output
    pixels (frames x H x W x batch) of one steady call, for auto's size bound; capturing: the decode already runs
    inside a CUDA graph capture."""
    if mode == "off":
        return False, "off"
    if not info.graphs[0]:
        return False, f"{info.type.upper()} decode: CUDA graphs need a GPU" if info.type != "cuda" else info.graphs[1]
    if tiles > 1:
        return False, (f"spatially tiled plan ({tiles} tiles): per-tile decoders (and host-cache copies between "
                       "them) are not captured; chunks run eagerly")
    if capturing:
        return False, "already inside a CUDA graph capture"
    steady = sum(1 for k in sched[1:] if k == sched[1]) if len(sched) > 1 else 0  # calls of the second's shape
    k = sched[1] if len(sched) > 1 else sched[0]
    least = AUTO_MIN_STEADY if mode == "auto" else MIN_STEADY
    if steady < MIN_STEADY:
        return False, (f"{steady} chunk(s) of one shape after the first: a graph needs one warm-up chunk and "
                       "one more to replay")
    if steady < least:
        return False, Said(f"{steady} chunks of {k} latent frame(s) after the first: {mode} captures from {least} "
                           "({0} forces it)", Hint("graphs", "on"))
    if mode == "auto" and chunk_pixels is not None and chunk_pixels > AUTO_MAX_CHUNK_PIXELS:
        return False, Said(f"{chunk_pixels / 1e6:.1f} MP per chunk: GPU-bound, a replay would not beat the "
                           f"eager chunk; auto captures up to {AUTO_MAX_CHUNK_PIXELS / 1e6:.1f} MP per chunk "
                           "({0} forces it)", Hint("graphs", "on"))
    return True, f"{steady} chunks of {k} latent frame(s) after the first"


def chunk_graphs(mode: str, info: DeviceInfo, budget_bytes: int | None = None) -> video_graphs.ChunkGraphs:
    """Wan's per-chunk graph policy in `mode` on the device `info` describes: decide_chunk_graphs decides per clip,
    vaeopt.video_graphs captures and replays within the VRAM budget `budget_bytes` (None: the device's)."""
    return video_graphs.ChunkGraphs(mode, functools.partial(decide_chunk_graphs, mode, info), budget_bytes)


def chunk_graphs_armed(mode: str) -> StageResult:
    """The graphs stage line once the table armed per-chunk graphs (Pipeline.setup_graphs); video_graphs.report_to
    replaces it by what was captured after the decodes."""
    when = "clips with >= 2 chunks of one shape after the first" if mode == "on" else \
        (f"clips with >= {AUTO_MIN_STEADY} chunks of one shape after the first and <= "
         f"{AUTO_MAX_CHUNK_PIXELS / 1e6:.1f} MP per chunk, untiled plans")
    return StageResult("graphs", "skipped",
                       f"per-chunk graphs armed ({mode}: {when}); what was captured is logged after the decodes")


def decide_autotune(mode: str, info: DeviceInfo, repeats: int, est_bytes: int | None = None,
                    budget_bytes: int | None = None) -> tuple[bool, str]:
    """(tune?, why) for `repeats` same-shape decodes under cudnn_autotune `mode` (auto | on | off), for a plan
    estimated at `est_bytes` under a VRAM budget of `budget_bytes` (constants: stages/cudnn_autotune)."""
    ct = stage("cudnn_autotune")
    ok, why = info.cudnn
    if mode == "off":
        return False, "off"
    if not ok:
        return False, why
    if mode == "on":
        return True, "forced on"
    if torch.backends.cudnn.benchmark:
        return True, "torch.backends.cudnn.benchmark was already on in this process"
    if est_bytes and budget_bytes and est_bytes * ct.PEAK_GROWTH > budget_bytes:
        return False, (f"the plan needs {est_bytes / 2**30:.1f} of {budget_bytes / 2**30:.1f} GiB; tuning "
                       f"needs ~{ct.PEAK_GROWTH - 1:.0%} more peak memory on its first decode (the trial configs' "
                       "workspaces)")
    if repeats < ct.MIN_REPEATS:
        return False, Said(f"{repeats} decode(s) of this shape: tuning costs seconds on the first decode and pays "
                           f"from ~{ct.MIN_REPEATS} same-shape decodes ({{0}} for a long-running job)",
                           Hint("cudnn_autotune", "on"))
    return True, f"{repeats} decodes of the same shape"
