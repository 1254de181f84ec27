"""The optimization pipeline: applies the stages in a fixed order to a loaded VAE, plans memory, decodes.

Order (each stage logs one line: what it did with numbers, or why it was skipped):
    precision -> fp8 -> channels_last -> fused_norms -> fused_epilogues -> upsample_conv -> stacked_conv3d (Wan)
    -> triton_conv -> fp8 convs -> attention
    -> plan (tile/chunk) -> graphs, cudnn_autotune (these two decided per job: they depend on how often a shape
    repeats)
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from vaeopt import planner
from vaeopt import outputs, tiling, video
from vaeopt.errors import DecodeError, VaeoptError
from vaeopt.fidelity import count_nonfinite
from vaeopt.hw import resolve_device, resolve_dtype
from vaeopt.kernels import interpreter_hint
from vaeopt.loading import LoadedVAE, quiet_diffusers
from vaeopt.stages import StageResult, unhooked, watch_loads, weights_epoch

SWITCHES = ("auto", "on", "off")
# --fp8 also takes one level alone: "weights" (level 1: e4m3 weight storage, any device) and "gemm" (levels 1-2: plus
# the 1x1 convs and linears as fp8 GEMMs, sm_89+); "on"/"auto" take level 3 where it runs (stages/triton_conv)
FP8_MODES = SWITCHES + ("weights", "gemm")
# CUDA graphs in auto mode: where the measured table says replay repays the capture (planner.graphs_pay,
# configs/graphs_rule.json)


# measured: benchmarks/results/h100_hunyuan-stages_2026-11-22.json (docs/experiments.md E39: about 2x slower with it)
HUNYUAN_CL_SKIP = ("HunyuanVideo's causal convs pad with F.pad(mode='replicate'), which returns NCDHW, so with "
                   "channels_last_3d weights every conv would convert its input and output (--channels-last on to "
                   "force)")


def channels_last_veto(family) -> str | None:
    """Why channels_last stays off in auto mode for this family whatever the other stages (None: no such reason):
    what the pipeline logs, and what the benchmark ladder's channels_last row follows instead of forcing it on."""
    return HUNYUAN_CL_SKIP if family.cls_name == "AutoencoderKLHunyuanVideo" else None


# The stages' lines name `vaeopt decode`'s flags ("--triton on forces it"). The other entry points spell them their
# own way (Pipeline.entry): `vaeopt benchmark` has only a few of them, vaeopt.optimize() takes keyword arguments,
# vaeopt.decode() an Options(...). spell_flags rewrites each run of flags ("--triton on --upsample-conv on") so.
_DECODE_FLAGS = ("channels-last", "triton", "epilogues", "upsample-conv", "stack-conv3d", "conv-kernel", "graphs",
                 "cudnn-autotune", "fp8-gate", "fp8", "tiling", "tile", "chunk", "vram-budget", "dtype", "device")
_FLAG = (rf"--(?:{'|'.join(_DECODE_FLAGS)})(?![\w-])"
         r"(?: (?:auto|on|off|weights|gemm|fp32|bf16|fp16|\d+(?:\.\d+)?(?: GB)?)(?!\w|\.\d))?")
_FLAG_RUN = re.compile(rf"{_FLAG}(?: {_FLAG})*")
_BENCH_FLAGS = ("dtype", "device", "fp8-gate")  # benchmark's own, spelled as decode's
_BENCH_SWITCHES = ("fp8", "cudnn-autotune")  # benchmark's on/off flags, which take no value
_OPTIMIZE_KWARGS = ("device", "dtype", "channels_last", "triton", "attention")  # vaeopt.optimize(vae, ...)
_OPTIONS_FIELD = {"fp8-gate": "gate_db", "vram-budget": "vram_budget_gb"}
ENTRY_POINTS = ("decode", "benchmark", "optimize", "api")


def spell_flags(text: str, entry: str) -> str:
    """`text` with the decode flags it names spelled for `entry`: "decode" (the CLI's `vaeopt decode`: as written),
    "benchmark" (its own flags; the others as `vaeopt decode ...`, and a switch set off as the ladder row's
    setting, which is what an "off" there is), "optimize" (keyword arguments, where optimize() takes them all;
    else vaeopt.decode with Options) or "api" (vaeopt.decode's Options fields)."""
    if entry == "decode":
        return text
    return _FLAG_RUN.sub(lambda m: _respelled(m.group(0), entry), text)


def _respelled(run: str, entry: str) -> str:
    flags: list[list[str]] = []
    for tok in run.split(" "):
        if tok.startswith("--"):
            flags.append([tok[2:], ""])
        elif tok != "GB":
            flags[-1][1] = tok
    if entry == "benchmark":
        # (benchmark's switches take no value: a level of --fp8 alone is decode's setting)
        if all(n in _BENCH_FLAGS or (n in _BENCH_SWITCHES and v in ("", "on", "auto")) for n, v in flags):
            return " ".join(f"--{n}" + (f" {v}" if v and n not in _BENCH_SWITCHES else "") for n, v in flags)
        if all(v == "off" for _, v in flags):  # the ladder's rows switch the stages off: not the user's doing
            return ", ".join(f"{n} off" for n, _ in flags) + " in this ladder row"
        return f"`vaeopt decode {run}`"
    kw = ", ".join(_OPTIONS_FIELD.get(n, n.replace("-", "_")) + (
        "" if not v else f"={v}" if v[0].isdigit() else f"='{v}'") for n, v in flags)
    if entry == "optimize" and all(_OPTIONS_FIELD.get(n, n.replace("-", "_")) in _OPTIMIZE_KWARGS for n, _ in flags):
        return kw
    return f"vaeopt.Options({kw})" if entry == "api" else f"vaeopt.decode(..., options=vaeopt.Options({kw}))"


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
class Options:
    device: str | None = None
    dtype: str = "auto"
    channels_last: str = "auto"
    triton: str = "auto"
    epilogues: str = "auto"  # conv bias folded into norms, fused residual(+upsample) epilogues, chunked attention
    attention: str = "auto"
    upsample_conv: str = "auto"  # upsample + 3x3 conv as four 2x2 phase convs on the low-resolution input
    stack_conv3d: str = "auto"  # Wan's causal Conv3d as a Conv2d over time-stacked channels
    conv_kernel: str = "auto"  # Triton implicit-GEMM conv for the layers where it measured faster than cuDNN
    fp8: str = "off"
    graphs: str = "auto"
    cudnn_autotune: str = "auto"  # cuDNN times engine configs per new conv shape (pays for many same-shape decodes)
    tiling: str = "auto"
    tile: int | None = None  # latent px per tile side
    chunk: int | None = None  # latent frames per decoder call (video)
    vram_budget_gb: float | None = None
    gate_db: float = 40.0  # fidelity gate for lossy stages (PSNR vs fp32 reference)
    # the latent shape (N, C, H, W) the decodes will have, where the caller knows it (vaeopt decode: the largest
    # input; vaeopt benchmark: the workload): the int8 convs' gate measures at that size (stages/triton_conv)
    decode_shape: tuple | None = None

    def validate(self) -> None:
        for name in ("channels_last", "triton", "epilogues", "attention", "upsample_conv", "stack_conv3d",
                     "conv_kernel", "fp8", "graphs", "cudnn_autotune", "tiling"):
            v = getattr(self, name)
            allowed = FP8_MODES if name == "fp8" else SWITCHES
            if v not in allowed:
                where = "Options.attention: no CLI flag" if name == "attention" else f"--{name.replace('_', '-')}"
                raise VaeoptError(f"{name} ({where}) must be one of {', '.join(allowed)}, got {v!r}")
        for name, flag in (("tile", "--tile"), ("chunk", "--chunk")):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise VaeoptError(f"{name} ({flag}) must be a whole number of latent "
                                  f"{'pixels' if name == 'tile' else 'frames'}, got {v!r}")
        for name, flag in (("vram_budget_gb", "--vram-budget"), ("gate_db", "--fp8-gate")):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise VaeoptError(f"{name} ({flag}) must be a number, got {v!r}")
        if self.tile is not None and self.tile < 8:
            raise VaeoptError(f"--tile {self.tile}: tiles must be at least 8 latent pixels")
        if self.chunk is not None and self.chunk < 1:
            raise VaeoptError(f"--chunk {self.chunk}: must be at least 1 latent frame")
        if self.vram_budget_gb is not None and not (0 < self.vram_budget_gb < float("inf")):
            raise VaeoptError(f"--vram-budget must be a positive number of GB, got {self.vram_budget_gb}")
        if not 0 <= self.gate_db < float("inf"):  # NaN fails this too
            raise VaeoptError(f"--fp8-gate must be a PSNR in dB, 0 or more, got {self.gate_db}")
        ds = self.decode_shape
        if ds is not None and (not isinstance(ds, (tuple, list)) or len(ds) < 3
                               or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in ds)):
            raise VaeoptError(f"decode_shape must be a latent shape such as (1, 4, 128, 128), got {ds!r}")
        if self.tile is not None and self.tiling == "off":
            raise VaeoptError("--tile conflicts with --tiling off")


@dataclass
class DecodeStats:
    seconds: float = 0.0
    peak_bytes: int | None = None
    retries: list[str] = field(default_factory=list)
    tiling: dict | None = None


class Pipeline:
    def __init__(self, loaded: LoadedVAE, options: Options | None = None, log: Callable[[str], None] | None = None,
                 entry: str = "decode"):
        """entry: where the lines are shown, which spells the flags that their hints name (spell_flags)."""
        if entry not in ENTRY_POINTS:
            raise ValueError(f"entry must be one of {ENTRY_POINTS}, got {entry!r}")
        self.loaded = loaded
        self.family = loaded.family
        self.opts = options or Options()
        self.opts.validate()
        ds, cfg = self.opts.decode_shape, getattr(loaded.model, "config", None)
        ch = getattr(cfg, "latent_channels", None) or getattr(cfg, "z_dim", None)
        if ds is not None and isinstance(ch, int) and ds[1] != ch:
            raise VaeoptError(f"decode_shape {tuple(ds)}: this VAE's latents have {ch} channels, not {ds[1]}")
        self.entry = entry
        self.log = log
        self.device = resolve_device(self.opts.device)
        self.dtype = resolve_dtype(self.opts.dtype, self.device)
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
        """Every line goes out with its flags spelled for the entry point."""
        if fn is None:
            self._log = lambda s: None
        else:
            self._log = fn if self.entry == "decode" else (lambda s: fn(self.spell(s)))

    def spell(self, text: str) -> str:
        """A stage line's text with its flags spelled for where it is shown (a stage's detail keeps decode's)."""
        return spell_flags(text, self.entry)

    def _record(self, r: StageResult) -> StageResult:
        self.stages.append(r)
        self.log(r.line())
        return r

    # ---- stages -------------------------------------------------------------------------------------------
    def _prepare(self) -> None:
        o = self.opts
        fam = self.family
        if self.dtype == torch.float16 and fam.name == "sdxl" and self.loaded.layout != "in-memory":
            # (not for optimize(pipe.vae): its family is a guess, and a diffusers pipeline upcasts the VAE itself
            # where its config says force_upcast)
            self.dtype = torch.float32
            self.log("! fp16 overflows in the SDXL VAE (NaN outputs): using fp32 (or pick --dtype bf16)")
        watch_loads(self.model)
        t0 = time.perf_counter()
        with quiet_diffusers():  # diffusers warns about `.to(dtype)` on every model; we cast deliberately
            kept = move_weights(self.model, self.device, self.dtype)
        self._record(StageResult("precision", "applied",
                                 f"{str(self.dtype).replace('torch.', '')} on {self._device_name()} "
                                 f"({time.perf_counter() - t0:.2f} s to move weights)" + (
                                     f"; {kept} weights kept in their float8 storage (the hooks on their layers "
                                     "cast them per call, as diffusers' layerwise casting does)" if kept else "")))
        if self.device.type == "cpu" and self.dtype in (torch.float16, torch.bfloat16):
            self.log("! half precision on the CPU: torch's CPU convs are much slower in fp16/bf16 than in fp32 "
                     "(--dtype fp32, the CPU default)")

        # fp8: level 3 (8-bit implicit-GEMM convs fed by the fused norms) where it can run, else levels 1-2; "weights"
        # and "gemm" ask for level 1 alone or levels 1-2 (vaeopt benchmark --fp8 measures each level so)
        conv8 = o.fp8 in ("on", "auto") and self._level3_family()
        if conv8:
            self._record(StageResult.skipped("fp8", "FP8 compute runs as 8-bit implicit-GEMM convs ('fp8 convs', "
                                                    "after the fused path is set up); weight-storage hooks would "
                                                    "disable that path (--fp8 weights or --fp8 gemm: levels 1-2 "
                                                    "instead)"))
        elif o.fp8 == "off":
            self._record(StageResult.skipped("fp8", "off (enable with --fp8 on; gated at "
                                                    f"{o.gate_db:g} dB vs the fp32 decode)"))
        else:
            self._apply_fp8()

        # fused norms decide whether channels_last pays
        fused_ok, fused_why = self._fused_available()
        want_fused = o.triton == "on" or (o.triton == "auto" and fused_ok)
        cl_mod = self._stage("channels_last")
        if o.channels_last == "off":
            self._record(StageResult.skipped("channels_last", "off"))
        elif o.channels_last == "auto" and (veto := channels_last_veto(fam)):
            self._record(StageResult.skipped("channels_last", veto))
        elif o.channels_last == "auto" and cl_mod.alone_pays(self.device) and not want_fused:
            r = cl_mod.apply(self.model)
            r.detail += " (on the CPU it pays without the fused kernels)"
            self._record(r)
        elif o.channels_last == "on" or (want_fused and fam.cls_name != "AutoencoderTiny"):
            self._record(cl_mod.apply(self.model))
        elif fam.cls_name == "AutoencoderTiny":
            self._record(StageResult.skipped("channels_last", "TAESD is too small to gain from NHWC"))
        else:
            self._record(StageResult.skipped("channels_last", f"fused NHWC norm kernels unavailable ({fused_why}); "
                                             "aten GroupNorm relayouts NHWC inputs, which is slower"))
        if o.triton == "off":
            fused = self._record(StageResult.skipped("fused_norms", "off"))
        elif not fused_ok and o.triton == "auto":
            fused = self._record(StageResult.skipped("fused_norms", fused_why))
        else:
            fused = self._record(self._stage("fused_norms").apply(self.model))
        if o.epilogues == "off":
            self._record(StageResult.skipped("fused_epilogues", "off"))
        elif fused.status != "applied":
            self._record(StageResult.skipped("fused_epilogues", "needs the fused norms (they carry the folded biases)"))
        else:
            self._record(self._stage("fused_epilogues").apply(self.model, device=self.device))

        self._apply_upsample_conv()
        self._apply_stacked_conv3d()
        self._apply_triton_conv()
        if conv8 and o.conv_kernel == "off":
            self._record(StageResult.skipped("fp8 convs", "--conv-kernel off (the e4m3 convs are Triton kernels)"))
        elif conv8:  # the gate decodes Wan with the chunk decoder the decodes will use
            decode = video.decode_video if self.family.cls_name == "AutoencoderKLWan" else None
            self._record(self._stage("triton_conv").apply_fp8(self.model, self.device, self.dtype, o.gate_db,
                                                              decode_shape=o.decode_shape, decode=decode,
                                                              log=self.log))

        if o.attention == "off":
            self._record(StageResult.skipped("attention", "off"))
        else:
            self._record(self._stage("attention").apply(self.model, device=self.device, dtype=self.dtype))

    def _device_name(self) -> str:
        if self.device.type == "cuda":
            return f"{torch.cuda.get_device_name(self.device)} ({self.device})"
        return "CPU"

    @staticmethod
    def _stage(name: str):
        import importlib

        return importlib.import_module(f"vaeopt.stages.{name}")

    def _fused_available(self) -> tuple[bool, str]:
        if self.device.type != "cuda" and self.opts.triton == "auto":
            return False, ("CPU decode: Triton kernels would run only through the interpreter "
                           f"({interpreter_hint('--triton on')})")
        try:
            mod = self._stage("fused_norms")
        except ImportError as e:
            return False, f"fused norm kernels not importable ({e})"
        return mod.available(self.device)

    def _level3_family(self) -> bool:
        """Whether --fp8 means level 3 (e4m3 implicit-GEMM convs written by the fused norms) rather than levels 1-2:
        Wan always (its fused chunk decoder has no room for storage hooks), AutoencoderKL for 16-bit decodes on a
        GPU with FP8 tensor cores. Decided from the family and hardware, not the other switches, so that a ladder
        row with the Triton path still off says why fp8 waits instead of running levels 1-2 there."""
        name = self.family.cls_name
        if name == "AutoencoderKLWan":
            return True
        return (name == "AutoencoderKL" and self.dtype in (torch.bfloat16, torch.float16)
                and self._stage("triton_conv").fp8_available(self.device)[0])

    def _apply_upsample_conv(self) -> None:
        o, name = self.opts, "upsample_conv"
        if o.upsample_conv == "off":
            self._record(StageResult.skipped(name, "off"))
        else:
            self._record(self._stage(name).apply(self.model, device=self.device, dtype=self.dtype,
                                                 force=o.upsample_conv == "on"))

    def _apply_stacked_conv3d(self) -> None:
        o, name = self.opts, "stacked_conv3d"
        cl = any(s.name == "channels_last" and s.status == "applied" for s in self.stages)
        if self.family.cls_name != "AutoencoderKLWan":
            if o.stack_conv3d == "on":  # asked for by name: say why nothing happened (else no line for images)
                self._record(StageResult.skipped(name, f"--stack-conv3d on has nothing to stack: it is for Wan's "
                                                       f"causal Conv3d, and {self.family.title} has none"))
            return
        if o.stack_conv3d == "off":
            self._record(StageResult.skipped(name, "off"))
        elif not cl:
            self._record(StageResult.skipped(name, "needs channels_last_3d activations (the stack is NHWC)"))
        else:
            # the 96-ch convs go to triton_conv's TMA kernel only if that stage will run (it comes next)
            self._record(self._stage(name).apply(self.model, device=self.device, dtype=self.dtype,
                                                 force=o.stack_conv3d == "on",
                                                 triton_conv_runs=self._triton_conv_skip() is None))

    def _triton_conv_skip(self) -> str | None:
        """Why the triton_conv stage would be skipped here, or None when it runs (its own checks follow)."""
        o = self.opts
        if o.conv_kernel == "off":
            return "off"
        if self.device.type != "cuda" and o.conv_kernel == "auto":
            return ("CPU decode: the Triton conv would run only through the interpreter "
                    f"({interpreter_hint('--triton on --conv-kernel on')})")
        if not any(s.name == "channels_last" and s.status == "applied" for s in self.stages):
            return "needs channels_last activations (the kernel reads NDHWC)"
        if self.dtype == torch.float32 and self.device.type == "cuda":
            return "fp32 decode: cuDNN kept (the kernel's fp32 dot would use TF32)"
        return None

    def _apply_triton_conv(self) -> None:
        name = "triton_conv"
        why = self._triton_conv_skip()
        if why is not None:
            self._record(StageResult.skipped(name, why))
        else:
            self._record(self._stage(name).apply(self.model, device=self.device, dtype=self.dtype,
                                                 force=self.opts.conv_kernel == "on"))

    def _apply_fp8(self) -> None:
        try:
            mod = self._stage("fp8")
        except ImportError:
            self._record(StageResult.skipped("fp8", "not built into this version of vaeopt"))
            return
        compute = self.opts.fp8 != "weights"  # level 2's GEMMs too, where the GPU has FP8 tensor cores
        ok, why = mod.available(self.device, compute=compute)
        if not ok:
            self._record(StageResult.skipped("fp8", why + (" (--fp8 weights, level 1 alone, runs without them)"
                                                           if "tensor cores" in why or "GPU" in why else "")))
            return
        self._record(mod.apply(self.model, family=self.family, gate_db=self.opts.gate_db, device=self.device,
                               dtype=self.dtype, compute=compute, log=self.log))

    # ---- planning -----------------------------------------------------------------------------------------
    def plan(self, latent_shape: tuple) -> planner.Plan:
        o = self.opts
        p = planner.plan_decode(self.family, self.model, tuple(latent_shape), self.dtype, self.device,
                                vram_budget_gb=o.vram_budget_gb, tile=o.tile, chunk=o.chunk, tiling=o.tiling)
        return p

    def graphs_decision(self, repeats: int, plan: planner.Plan, latent_shape: tuple | None = None
                        ) -> tuple[bool, str]:
        o = self.opts
        ok, why = self._stage("graphs").available(self.device)
        if o.graphs == "off":
            return False, "off"
        if not ok:
            return False, why
        if plan.mode != "whole":
            return False, f"{plan.mode} decode: graphs are captured for whole decodes only"
        if self.family.is_video:
            if self.family.cls_name == "AutoencoderKLWan":
                return False, ("Wan: the whole-clip graph does not apply; per-chunk graphs are decided per clip by "
                               "vaeopt.video_graphs")
            return False, "video decodes loop over chunks in Python; per-chunk graphs exist for Wan only"
        if o.graphs == "on":
            return True, "forced on"
        shape = latent_shape or o.decode_shape
        if shape is None:
            return False, "the latent shape is not known here (--graphs on to force)"
        eight = any(s.name == "fp8 convs" and s.status == "applied" for s in self.stages)
        return planner.graphs_pay(self.family, tuple(shape), repeats, "8bit" if eight else "bf16")

    def autotune(self, repeats: int, plan: planner.Plan | None = None) -> StageResult:
        """Decide and apply (or log why not) cuDNN autotuning for `repeats` same-shape decodes of `plan`; once per
        pipeline."""
        done = next((s for s in self.stages if s.name == "cudnn_autotune"), None)
        if done is not None:
            return done
        mod = self._stage("cudnn_autotune")
        use, why = mod.decide(self.opts.cudnn_autotune, self.device, repeats,
                              plan.est_bytes if plan else None, plan.budget_bytes if plan else None)
        return self._record(mod.apply(why) if use else StageResult.skipped("cudnn_autotune", why))

    def count_decode(self, latent_shape: tuple, plan: planner.Plan) -> None:
        """Decodes that arrive one call at a time (vaeopt.decode per image, as a diffusers pipeline calls its VAE):
        count them per shape, and capture a shape once the measured rule (planner.graphs_pay) says its decodes so far
        would have repaid the capture. Waiting for that many costs at most as much again as knowing the count up
        front (the break-even rule of renting before buying); shapes that never repeat enough stay eager."""
        if self.opts.graphs == "off" or self.family.is_video or plan.mode != "whole":
            return
        if self.opts.graphs == "auto" and plan.budget_bytes is not None and 2 * plan.est_bytes > plan.budget_bytes:
            return  # a captured shape keeps its decode's transients in the graph's pool: only with room for them
        shape = tuple(latent_shape)
        seen = self.__dict__.setdefault("_calls", {})
        seen[shape] = seen.get(shape, 0) + 1
        allowed = self.__dict__.setdefault("_graph_shapes", set())
        if shape in allowed:
            return
        use, why = self.graphs_decision(seen[shape], plan, shape)
        if use:
            allowed.add(shape)
            if self.graphed is None:
                self.enable_graphs(f"{why}, counted over calls")

    def enable_graphs(self, reason: str) -> None:
        mod = self._stage("graphs")
        self.graphed, r = mod.apply(self._decode_whole_raw, self.device)
        self._graphs_epoch = weights_epoch(self.model)
        r.detail += f" ({reason})"
        self._record(r)

    # ---- decoding -----------------------------------------------------------------------------------------
    def _decode_whole_raw(self, z: torch.Tensor) -> torch.Tensor:
        return self.model.decode(z).sample

    def decode(self, z_raw: torch.Tensor, plan: planner.Plan | None = None,
               progress: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor, DecodeStats]:
        """Raw latents -> decoded tensor in [-1, 1] (float32 on CPU). Video: (N,3,T,H,W)."""
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
        return out.float().cpu(), stats

    def _decode_image(self, z, plan, stats: DecodeStats, progress) -> torch.Tensor:
        if plan.mode == "tiled":
            out, info = tiling.tiled_decode(self.model, z, tile=plan.tile, progress=progress,
                                            vram_budget=plan.budget_bytes, return_info=True)
            self._tiling_report(info, stats)
            return out
        try:
            if self.graphed is not None and (now := weights_epoch(self.model)) != self._graphs_epoch:
                self.graphed.reset()  # the weights changed (in place, vaeopt.refresh, load_state_dict): capture again
                self._graphs_epoch = now
            only = self.__dict__.get("_graph_shapes")  # per-call counting: only the shapes that have paid
            use = self.graphed is not None and (only is None or tuple(z.shape) in only)
            return (self.graphed if use else self._decode_whole_raw)(z)
        except torch.cuda.OutOfMemoryError:
            # OOM: free what the failed attempt held, shrink to a tiled plan at half the estimate, and go on.
            torch.cuda.empty_cache()
            budget = int(plan.est_bytes * 0.5)
            tile = planner.largest_tile(self.family, self.model, tuple(z.shape), self.dtype, budget)
            stats.retries.append(f"out of memory in whole decode (est. {planner.gib(plan.est_bytes)}): "
                                 f"retrying tiled with {tile * self.family.spatial_factor}px tiles")
            self.log("↩ " + stats.retries[-1])
            out, info = tiling.tiled_decode(self.model, z, tile=tile, progress=progress, vram_budget=budget,
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
        # oom_retry: a CUDA out-of-memory error restarts the clip with a smaller plan (vaeopt.video_tiling: tile,
        # then chunk, then host caches; never the same plan twice); frames already handed out are not repeated.
        return {"chunk": plan.chunk or 1, "oom_retry": True, "info": info, **Pipeline.video_tiling_kwargs(plan)}

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
        if self.family.cls_name != "AutoencoderKLWan":
            # vaeopt.video's exact chunk decoder covers Wan; HunyuanVideo runs diffusers' decode (planner._plan_hunyuan)
            return self._decode_hunyuan(z, plan, stats)
        info: dict = {}
        out = video.decode_video(self.model, z, progress=progress, **self._video_kwargs(plan, info))
        self._video_report(info, stats)
        return out

    def _decode_hunyuan(self, z, plan: planner.Plan, stats: DecodeStats | None) -> torch.Tensor:
        """diffusers' HunyuanVideo decode, in its spatial tiles where the plan says so; an untiled decode that runs
        out of memory is decoded again in tiles (the largest whose estimate is half the failed one), where the frames
        are larger than a tile (else the error stands)."""
        if plan.mode == "tiled":
            return self._hunyuan_tiled(z, plan.tile)
        try:
            return self.model.decode(z).sample.clamp(-1, 1)
        except torch.cuda.OutOfMemoryError:
            tiles = planner.hunyuan_tile(self.family, self.model, tuple(z.shape), self.dtype, plan.est_bytes // 2)
            if tiles is None:
                raise
        # retried outside the except block: its traceback would keep the failed attempt's tensors alive
        torch.cuda.empty_cache()
        side = tiles[0]
        msg = (f"out of memory in the untiled decode (est. {planner.gib(plan.est_bytes)}): decoding again in "
               f"diffusers' spatial tiles of {side}px (approximate)")
        if stats is not None:
            stats.retries.append(msg)
        self.log("↩ " + msg)
        return self._hunyuan_tiled(z, side // self.family.spatial_factor)

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
