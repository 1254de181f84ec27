"""What decode says as it works: what was read and loaded, the one-line optimizer summary, the plan in words, and
a progress bar for long decodes."""

from __future__ import annotations

import time
from pathlib import Path

from rich.markup import escape

from vaeopt.cli import printing
from vaeopt.cli.printing import detail, log, say
from vaeopt.options import hint_flags, spell_flags


_BENCH_FLAGS = ("dtype", "device", "fp8-gate")  # `vaeopt benchmark`'s own, spelled as decode's
_BENCH_SWITCHES = ("fp8", "cudnn-autotune")  # its on/off flags, which take no value


def spell_benchmark_flags(group) -> str:
    """A hint group as `vaeopt benchmark` can act on it: its own flags; a setting of "off" as what the ladder row
    set (an "off" there is the row's, not the user's doing); else as `vaeopt decode ...`."""
    flags = hint_flags(group)
    if all(n in _BENCH_FLAGS or (n in _BENCH_SWITCHES and v in ("", "on", "auto")) for n, v in flags):
        return " ".join(f"--{n}" + (f" {v}" if v and n not in _BENCH_SWITCHES else "") for n, v in flags)
    if all(v == "off" for _, v in flags):
        return ", ".join(f"{n} off" for n, _ in flags) + " in this ladder row"
    return f"`vaeopt decode {spell_flags(group)}`"


def shape_text(t) -> str:
    return "x".join(map(str, t.shape))


def report_read(files, latent_space, seconds: float) -> None:
    """What was read: one line (each file's tensors in -v)."""
    if printing.level >= 2:
        printing.console.print(f"[bold]read[/] {len(files)} latent file(s) in {seconds:.2f} s")
        names = [f.path.name for f in files]
        for f in files:
            space = f"{f.format}, {latent_space or f.default_space} latents"
            name = f.path if names.count(f.path.name) > 1 else f.path.name  # a/lat.pt, b/lat.pt: which is which
            shown = lambda e: f"{tuple(e.tensor.shape)} {str(e.tensor.dtype).replace('torch.', '')}"  # noqa: E731
            if len(f.entries) == 1:
                e = f.entries[0]
                entry = f"[{e.name}]" if e.name else ""
                printing.console.print(f"  {name}{entry}: {shown(e)} ({space})", markup=False)
            else:  # which of them are latents is known once the VAE is (the others are skipped with a reason then)
                printing.console.print(f"  {name}: {len(f.entries)} tensors ({space} where they fit the VAE)",
                                       markup=False)
                for e in f.entries:
                    printing.console.print(f"    [{e.name}]: {shown(e)}", markup=False)
    spaces = "/".join(sorted({latent_space or f.default_space for f in files}))
    if len(files) == 1:
        f = files[0]
        what = ", ".join(f"{e.name + ' ' if e.name else ''}{shape_text(e.tensor)}" for e in f.entries)
        if len(what) > 60:
            what = f"{len(f.entries)} tensors"
        line = f"read {f.path.name}: {what} ({spaces} latents)"
    else:
        n = sum(len(f.entries) for f in files)
        line = f"read {len(files)} latent files, {n} tensor(s) ({spaces} latents)"
    if printing.level == 1:
        printing.console.print(line, markup=False, highlight=False)
    for f in files:
        for n in f.notes:
            log(n)


def report_model(loaded, model_path, why: str, seconds: float, t_import: float) -> None:
    """The model: one line; the loading notes in -v (a guessed family in short without it)."""
    from vaeopt.loading import Notice

    fam = loaded.family
    if printing.level >= 2:
        printing.console.print(f"[bold]load[/] {escape(str(model_path))} ({escape(why)}) in {seconds:.2f} s "
                               f"(+{t_import:.1f} s importing diffusers): {fam.title} [{fam.cls_name}], layout {loaded.layout}",
                               highlight=False)
        for n in loaded.notes:
            detail(n)
        return
    say(f"model {Path(model_path).name}: {fam.title} ({fam.cls_name}), loaded in {seconds:.1f} s",
        markup=False, highlight=False)
    for n in loaded.notes:
        if isinstance(n, Notice):
            log(n.short)


# What the one-line optimizer summary calls each stage.
_STAGE_WORDS = {"fp8": "FP8", "fp8 convs": "FP8 convs", "channels_last": "channels_last", "fused_norms": "fused norms",
                "fused_epilogues": "fused epilogues", "upsample_conv": "upsample convs", "triton_conv": "Triton convs",
                "stacked_conv3d": "stacked Conv3d", "attention": "attention", "graphs": "CUDA graphs",
                "cudnn_autotune": "cuDNN autotuning"}


def optimizer_summary(stages, device, dtype) -> str:
    """One line for what the optimizer did in this run: the stages applied, or that the plain path ran and why."""
    from vaeopt.hw import DTYPE_NAMES  # (as --dtype spells them)

    where = f"{DTYPE_NAMES.get(dtype, str(dtype).replace('torch.', ''))}, {'CPU' if device.type == 'cpu' else device}"
    applied = [_STAGE_WORDS.get(s.name, s.name) for s in stages if s.status == "applied" and s.name != "precision"]
    fell = [_STAGE_WORDS.get(s.name, s.name) for s in stages if s.status == "fallback"]
    skipped = [s for s in stages if s.status == "skipped"]
    extra = f"; fell back: {', '.join(fell)}" if fell else ""
    if applied:
        if device.type != "cuda" and skipped:
            extra += "; the GPU kernels need CUDA"
        tail = f" ({where}{extra}; -v for details)"

        def fits(ns):
            return len("optimized: " + ", ".join(ns) + tail) <= 104  # (~100: a terminal's width with room)

        names = applied
        if not fits(names):  # one short line: the first stages, and how many more (-v lists them all)
            k = len(applied) - 1
            while k > 1 and not fits(applied[:k] + [f"+{len(applied) - k} more"]):
                k -= 1
            names = applied[:k] + [f"+{len(applied) - k} more"]
        return "optimized: " + ", ".join(names) + tail
    if skipped and all(s.detail == "off" for s in skipped):
        why = "every stage switched off"
    elif device.type != "cuda":
        why = "the GPU kernels need CUDA"
    else:
        why = "no stage applies to this model"
    return f"plain diffusers decode ({where}): {why}{extra} (-v for details)"


def plan_words(plan: dict) -> str:
    """A decode plan in a few words: whole, tiled, chunks."""
    if plan.get("mode") == "whole":
        return "whole decode"
    tile, chunk = plan.get("tile"), plan.get("chunk")
    if isinstance(tile, (list, tuple)):
        tile = "x".join(map(str, tile))
    parts = []
    if chunk:
        parts.append(f"chunks of {chunk} latent frame{'s' if chunk != 1 else ''}")
    if tile:
        parts.append(f"tiles of {tile} latent px" if not isinstance(tile, str) else f"{tile} tiles")
    return ", ".join(parts) or str(plan.get("mode"))


class DecodeProgress:
    """A rich progress bar for a decode that has run over SHOW_AFTER_S seconds (tiles, or frames and frames/s);
    only on a terminal and not with -q: a log or a pipe gets the summary lines alone."""

    SHOW_AFTER_S = 2.0

    def __init__(self):
        self.enabled = printing.level >= 1 and printing.console.is_terminal
        self.prog = None
        self.task = None
        self.job = None
        self.t0 = time.perf_counter()

    def restart(self) -> None:  # after each output: the next decode's time counts from here
        self._stop()
        self.t0 = time.perf_counter()
        self.job = None

    def __call__(self, job, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.prog is None:
            if now - self.t0 < self.SHOW_AFTER_S or done >= total:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.prog = Progress(TextColumn("  {task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=printing.console,
                                 transient=True)
            self.prog.start()
        if job is not self.job:
            self.job = job
            video = job.z_raw.dim() == 5
            unit = "frames" if video else "tiles"  # (tiles of every pass: the stats pass too)
            name = job.source.name + (f"[{job.entry}]" if job.entry else "")
            self.task = self.prog.add_task(f"{name} {unit}", total=total, rate="")
            self.job_t0 = self.t0
        rate = done / max(now - self.job_t0, 1e-9)
        self.prog.update(self.task, completed=done, total=total,
                         rate=f"{rate:.1f} frames/s" if job.z_raw.dim() == 5 else f"{rate:.1f} tiles/s")

    def _stop(self) -> None:
        if self.prog is not None:
            self.prog.stop()
            self.prog = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop()


def fps_unused(fps: float) -> None:
    log(f"--fps {fps:g} ignored: it sets the frame rate of MP4 output, and nothing here is written as MP4")
