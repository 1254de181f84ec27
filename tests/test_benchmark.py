"""`vaeopt benchmark` on CPU: JSON schema, fidelity on every row, skipped stages carry reasons, broken stages show."""

import json

import pytest
import torch
from typer.testing import CliRunner

from vaeopt.cli import app

runner = CliRunner()
ROW_KEYS = {"name", "kind", "status", "reason", "median_ms", "min_ms", "max_ms", "peak_alloc_gib", "throughput",
            "throughput_unit", "tflops", "psnr_db", "max_abs", "stages", "speedup_vs_baseline", "speedup_vs_diffusers_bf16"}


def _bench(tmp_path, samples_dir, *extra):
    out = tmp_path / "r.json"
    r = runner.invoke(app, ["benchmark", str(samples_dir / "tiny_kl_image.safetensors"), "--shape", "1,4,16,16",
                            "--repeats", "2", "--warmup", "0", "--peers", "tiling", "--json", str(out),
                            "--plot", str(tmp_path / "r.png"), "--device", "cpu", "-v", *extra],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text()), r.output


@pytest.fixture(scope="module")
def result(tmp_path_factory, samples_dir):
    return _bench(tmp_path_factory.mktemp("b"), samples_dir)


def test_schema_and_fidelity(result):
    data, output = result
    for k in ("workload", "family", "latent_shape", "dtype", "device", "flops", "versions", "date", "command", "rows"):
        assert k in data
    assert data["cpu_numbers"] is True and "CPU numbers" in output
    assert data["flops"] > 1e9 and data["latent_shape"] == [1, 4, 16, 16]
    names = [r["name"] for r in data["rows"]]
    assert names[0] == "diffusers fp32 (reference)" and "vaeopt plain" in names and "+ CUDA graphs" in names
    for r in data["rows"]:
        assert ROW_KEYS <= set(r)
        if r["status"] == "ok":
            assert r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
            assert r["psnr_db"] is not None and r["max_abs"] is not None  # every measured row has fidelity
            assert r["throughput_unit"] == "MP/s" and r["tflops"] > 0
        else:
            assert r["status"] == "skipped" and r["reason"]  # skipped rows say why
    plain = next(r for r in data["rows"] if r["name"] == "vaeopt plain")
    assert plain["psnr_db"] > 100  # fp32 plain path == diffusers fp32
    # an fp32 CPU run has no bf16 peer: speedups are against the reference, and named so
    assert data["speedup_baseline"] == "diffusers fp32 (reference)" and plain["speedup_vs_diffusers_bf16"] is None
    assert plain["speedup_vs_baseline"] > 0 and "speedup vs 'diffusers fp32 (reference)'" in output


def test_the_tiling_peer_says_when_diffusers_does_not_tile(result, tmp_path, samples_dir):
    """A 16x16 latent is below diffusers' tile size: enable_tiling() decodes it untiled, so the row is not shown as
    a tiling measurement (it used to read 200 dB, 'tiled'); a latent above the tile size is tiled and measured."""
    data, _ = result
    row = next(r for r in data["rows"] if r["name"] == "diffusers fp32 + tiling")
    assert row["status"] == "skipped" and "does not tile a 16x16 latent" in row["reason"]
    assert row["median_ms"] is None and not row["times_ms"]  # known from diffusers' tile size: not run at all
    out = tmp_path / "big.json"
    out.write_text(json.dumps(data))  # a re-run replaces its own earlier results file, and says so
    r = runner.invoke(app, ["benchmark", str(samples_dir / "tiny_kl_image.safetensors"), "--shape", "1,4,80,8",
                            "--repeats", "1", "--warmup", "0", "--peers", "tiling", "--json", str(out),
                            "--device", "cpu"],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "(replaced the file that was there)" in r.output and "replaced" not in result[1]
    row = next(r for r in json.loads(out.read_text())["rows"] if r["name"] == "diffusers fp32 + tiling")
    assert row["status"] == "ok" and row["psnr_db"] < 100  # tiles blended: not bit-identical to the reference


def test_skipped_stages_carry_reason(result):
    data, _ = result
    rows = {r["name"]: r for r in data["rows"]}
    assert rows["+ fp8"]["status"] == "skipped" and "--fp8" in rows["+ fp8"]["reason"]
    assert rows["+ CUDA graphs"]["status"] == "skipped" and "GPU" in rows["+ CUDA graphs"]["reason"]
    # an image VAE has no causal Conv3d: the row is not shown as a measured step (it has no stage line at all)
    assert rows["+ stacked Conv3d"]["status"] == "skipped" and "no stacked_conv3d stage" in rows["+ stacked Conv3d"]["reason"]


def test_fp8_levels_are_each_reported(tmp_path, samples_dir):
    """--fp8: each of FP8's three levels gets its own report, measured against the row it adds to, or why it did not
    run: on the CPU level 1 (e4m3 weight storage, no tensor cores needed) is a row of its own on top of 'vaeopt
    plain', with the decoder's weight memory before and after; levels 2 and 3 say why they are skipped."""
    data, out = _bench(tmp_path, samples_dir, "--fp8")
    levels = {s["level"]: s for s in data["fp8_levels"]}
    assert sorted(levels) == [1, 2, 3]
    rows = {r["name"]: r for r in data["rows"]}
    l1 = levels[1]
    assert l1["status"] == "ok" and l1["row"] == "fp8 level 1: e4m3 weights" and l1["vs_row"] == "vaeopt plain"
    row = rows[l1["row"]]
    assert row["kind"] == "fp8" and row["status"] == "ok" and row["median_ms"] > 0
    assert l1["ms"] == row["median_ms"] and l1["vs_ms"] == rows["vaeopt plain"]["median_ms"]
    assert 30 < l1["psnr_db"] < 100 and l1["psnr_db"] == row["psnr_db"]  # lossy: not the plain decode's bits
    assert l1["layers"] > 20 and l1["weights_mib"] < 0.5 * l1["vs_weights_mib"]  # fp32 -> e4m3 but conv_in/out
    fp8_line = next(s for s in row["stages"] if s["name"] == "fp8")
    assert fp8_line["status"] == "applied" and fp8_line["data"]["gemm"] == 0
    assert levels[2]["status"] == "skipped" and "tensor cores" in levels[2]["reason"]
    assert rows["fp8 level 2: + fp8 GEMMs"]["status"] == "skipped"
    assert levels[3]["status"] == "skipped" and "GPU" in levels[3]["reason"]
    assert "FP8 level 1 (e4m3 weight storage):" in out and "MiB" in out
    assert "FP8 level 2 (fp8 GEMMs): skipped" in out and "FP8 level 3 (8-bit convs): skipped" in out


def test_plot_written(result, tmp_path_factory, monkeypatch):
    """The chart (matplotlib): one bar per measured row, a row of numbers beside each, the rows not timed listed
    below, tagged as ours so that a re-run may replace it; without matplotlib a one-line error before measuring."""
    import numpy as np
    from PIL import Image

    from vaeopt import benchmark as bm

    data, _ = result
    d = tmp_path_factory.mktemp("p")
    p = d / "plot.png"
    bm.plot(data, p)
    im = Image.open(p)
    assert im.format == "PNG" and im.info.get("Software") == bm.CHART_SOFTWARE and bm.is_own_output(p)
    ok = [r for r in data["rows"] if r["status"] == "ok"]
    skipped = [r for r in data["rows"] if r["status"] != "ok"]
    assert len(ok) >= 3 and len(skipped) >= 5
    w, h = im.size
    assert w >= 1000 and h > 100 + 30 * len(ok)  # room for every bar and the list of skipped rows
    px = np.asarray(im.convert("RGB")).astype(int)
    orange = (abs(px - np.array([0xE8, 0x78, 0x2A])).sum(-1) < 30).sum()  # the vaeopt rows' bars are drawn
    assert orange > 1000, orange
    more = dict(data, rows=data["rows"] + [dict(skipped[0], name="+ an extra skipped row")])
    bm.plot(more, d / "more.png")
    assert Image.open(d / "more.png").size[1] > h  # each skipped row gets a line
    assert "CPU" in bm.hardware_line(data) and "torch" in bm.hardware_line(data)
    monkeypatch.setattr(bm, "plot_available", lambda: False)
    r = runner.invoke(app, ["benchmark", "--family", "sd15", "--shape", "1,4,8,8", "--plot", str(d / "x.png")])
    assert r.exit_code == 2 and "pip install 'vaeopt[plot]'" in r.output and len(r.output.splitlines()) == 1
    assert not (d / "x.png").exists()


def test_default_quiet_and_verbose_output(tmp_path, samples_dir):
    """Default: a header, one line per measured row, the table, the skipped rows in short; -q: nothing but the
    files; -v: each row as it starts and every reason in full."""
    base = ["benchmark", str(samples_dir / "tiny_kl_image.safetensors"), "--shape", "1,4,8,8", "--repeats", "1",
            "--warmup", "0", "--peers", "", "--device", "cpu"]
    r = runner.invoke(app, base + ["--json", str(tmp_path / "a.json")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "vaeopt plain ...\n" not in r.output and "vaeopt plain:" in r.output and "skipped + CUDA graphs" in r.output
    foot = [ln for ln in r.output.splitlines() if ln.startswith("  skipped ")]
    assert foot and all(len(ln) <= 110 for ln in foot), foot
    r = runner.invoke(app, base + ["-q", "--json", str(tmp_path / "q.json")], catch_exceptions=False)
    assert r.exit_code == 0 and r.output == "" and json.loads((tmp_path / "q.json").read_text())["rows"]
    r = runner.invoke(app, base + ["-v"], catch_exceptions=False)
    assert r.exit_code == 0 and "vaeopt plain ...\n" in r.output
    assert any(len(ln) > 110 for ln in r.output.splitlines() if ln.startswith("  skipped "))  # reasons in full
    r = runner.invoke(app, base + ["-v", "-q"])
    assert r.exit_code == 2 and "contradict" in r.output


def test_broken_stage_is_reported_not_hidden(tmp_path, samples_dir, monkeypatch):
    from vaeopt.stages import channels_last

    real = channels_last.apply

    def broken(model, **kw):
        r = real(model, **kw)
        with torch.no_grad():
            model.decoder.conv_out.weight.mul_(0.5)  # a bug that halves the output
        return r

    monkeypatch.setattr(channels_last, "apply", broken)
    data, _ = _bench(tmp_path, samples_dir)
    rows = {r["name"]: r for r in data["rows"]}
    assert rows["vaeopt plain"]["psnr_db"] > 100
    assert rows["+ channels_last"]["status"] == "ok"
    assert rows["+ channels_last"]["psnr_db"] < 30, rows["+ channels_last"]["psnr_db"]


def test_bad_arguments():
    r = runner.invoke(app, ["benchmark", "--family", "sdxl", "--shape", "1,16,8,8"])
    assert r.exit_code == 2 and "does not fit" in r.output
    r = runner.invoke(app, ["benchmark", "--workload", "nope"])
    assert r.exit_code == 2 and "unknown workload" in r.output
    r = runner.invoke(app, ["benchmark", "--family", "sdxl", "--shape", "1,4,8,8", "--peers", "magic"])
    assert r.exit_code == 2 and "unknown magic" in r.output
    if not torch.cuda.is_available():
        r = runner.invoke(app, ["benchmark", "--family", "sdxl", "--shape", "1,4,8,8", "--peers", "bf16",
                                "--cudnn-autotune"])
        assert r.exit_code == 2 and "--cudnn-autotune: no CUDA device" in r.output and "Traceback" not in r.output


def test_model_alone_gets_a_default_shape(samples_dir):
    """`vaeopt benchmark model.safetensors` (the README's form) used to fail with "name a --workload or a --shape".
    Now: the family's standard workload on a GPU, a small latent on the CPU, said in the log."""
    from types import SimpleNamespace

    import torch

    from vaeopt import benchmark as bm
    from vaeopt.cli.benchmark import bench_inputs
    from vaeopt.families import get_family

    spec, _, shp, wl, notes = bench_inputs(samples_dir / "tiny_kl_image.safetensors", None, None, None,
                                            torch.device("cpu"))
    assert shp == (1, 4, 32, 32) and wl is None
    assert any("no --workload/--shape: latent (1, 4, 32, 32), a small CPU default" in n for n in notes)
    gpu = SimpleNamespace(type="cuda")
    assert bm.default_shape(get_family("sdxl"), gpu)[:2] == ((1, 4, 128, 128), "sdxl-1024")
    assert bm.default_shape(get_family("wan22"), gpu)[:2] == ((1, 48, 31, 44, 80), "wan22-720p")
    assert bm.default_shape(get_family("sd3"), gpu) == ((1, 16, 128, 128), None, "the GPU default")
    assert bm.default_shape(get_family("wan21"), torch.device("cpu"))[0] == (1, 16, 3, 16, 16)
    r = runner.invoke(app, ["benchmark"])
    assert r.exit_code != 0 and "give a checkpoint, --family or --workload" in r.output
    # a workload's shape with another family's model, or --shape with --workload: not labelled as that workload
    _, _, shp, wl, notes = bench_inputs(samples_dir / "tiny_kl_image.safetensors", None, "sdxl-1024", None,
                                         torch.device("cpu"))
    assert shp == (1, 4, 128, 128) and wl is None and any("not the sdxl-1024 workload: the model is" in n
                                                         for n in notes)
    _, _, shp, wl, _ = bench_inputs(None, None, "sdxl-1024", "1,4,16,16", torch.device("cpu"))
    assert shp == (1, 4, 16, 16) and wl is None


def test_bad_values_and_outputs_refused_before_measuring(tmp_path, samples_dir):
    """Regression: --repeats 0 crashed after the ladder ('no median for empty data'), a zero dimension reached
    torch, --plot could overwrite the model checkpoint, and a --json folder failed only after the whole benchmark."""
    model = samples_dir / "tiny_kl_image.safetensors"
    base = ["benchmark", "--family", "sd15", "--shape", "1,4,8,8"]
    for extra, msg in ((["--repeats", "0"], "--repeats must be at least 1"),
                       (["--warmup", "-1"], "--warmup must be 0 or more")):
        r = runner.invoke(app, base + extra)
        assert r.exit_code == 2 and msg in r.output, r.output
    r = runner.invoke(app, ["benchmark", "--family", "sd15", "--shape", "1,4,0,8"])
    assert r.exit_code == 2 and "every dimension must be at least 1" in r.output, r.output
    for shape in ("1,4,100000,100000", "99999999999999999999,4,8,8"):  # (host OOM advice; an overflow in randn)
        r = runner.invoke(app, ["benchmark", "--family", "sd15", "--shape", shape])
        assert r.exit_code == 2 and "beyond what the benchmark runs" in r.output, r.output
    copy = tmp_path / "vae.safetensors"
    copy.write_bytes(model.read_bytes())
    r = runner.invoke(app, ["benchmark", str(copy), "--shape", "1,4,8,8", "--json", str(copy)])
    assert r.exit_code == 2 and "would overwrite the model" in r.output, r.output
    assert copy.read_bytes() == model.read_bytes()
    r = runner.invoke(app, base + ["--json", str(tmp_path)])
    assert r.exit_code == 2 and "is a folder" in r.output, r.output
    r = runner.invoke(app, base + ["--json", str(tmp_path / "x.json"), "--plot", str(tmp_path / "x.png.json")])
    assert r.exit_code == 2 and "the chart is a PNG" in r.output, r.output
    r = runner.invoke(app, base + ["--json", str(tmp_path / "x.png"), "--plot", str(tmp_path / "x.png")])
    assert r.exit_code == 2 and "name the same file" in r.output, r.output
    r = runner.invoke(app, base + ["--json", str(tmp_path / "x.png")])
    assert r.exit_code == 2 and "give a .json file name" in r.output, r.output


def test_log_does_not_time_skipped_rows(result):
    """The live log printed timings for ladder rows that the table then marked skipped (e.g. CUDA graphs on CPU)."""
    data, out = result
    skipped = [r["name"] for r in data["rows"] if r["kind"] == "ladder" and r["status"] == "skipped"]
    logged = 0
    for name in skipped:  # (rows skipped without running, e.g. "+ fp8" when not requested, have no log line)
        lines = [ln for ln in out.splitlines() if ln.strip().startswith(name + ":")]
        assert all("skipped" in ln and " ms" not in ln for ln in lines), (name, lines)
        logged += bool(lines)
    assert logged >= 3  # fused norms, epilogues, CUDA graphs ... on CPU


def test_json_and_plot_replace_only_their_own_files(tmp_path, samples_dir):
    """Regression: --json replaced any .json, e.g. a diffusers folder's config.json (the next decode
    then fell back to default settings: 12.9 dB off, without a word) or a vaeopt.json manifest. Only an earlier
    benchmark result (or chart) is replaced; anything else is refused before measuring and kept."""
    from PIL import Image

    model = samples_dir / "tiny_kl_image.safetensors"
    base = ["benchmark", str(model), "--shape", "1,4,8,8", "--repeats", "1", "--warmup", "0", "--peers", "",
            "--device", "cpu"]
    cfg = tmp_path / "config.json"
    cfg.write_text('{"_class_name": "AutoencoderKL", "norm_num_groups": 8}')
    pic = tmp_path / "photo.png"
    Image.new("RGB", (4, 4), "red").save(pic)
    r = runner.invoke(app, base + ["--json", str(cfg)])
    assert r.exit_code == 2 and "exists and is not a vaeopt benchmark result; it is kept" in r.output, r.output
    r = runner.invoke(app, base + ["--plot", str(pic)])
    assert r.exit_code == 2 and "exists and is not a vaeopt benchmark chart; it is kept" in r.output, r.output
    assert cfg.read_text() == '{"_class_name": "AutoencoderKL", "norm_num_groups": 8}'
    assert Image.open(pic).getpixel((0, 0)) == (255, 0, 0)
    out, chart = tmp_path / "r.json", tmp_path / "r.png"
    for _ in range(2):  # the second run replaces what the first wrote
        r = runner.invoke(app, base + ["--json", str(out), "--plot", str(chart)])
        assert r.exit_code == 0, r.output
    assert r.output.count("(replaced the file that was there)") == 2


def test_hunyuan_video_benchmarks_against_diffusers_own_decode(tmp_path):
    """HunyuanVideo's reference is diffusers' own fp32 decode (vaeopt's chunk decoder is Wan's), every ladder row
    matches it, and the planner row says it changed nothing for frames that fit."""
    from vaeopt.families import build_model, get_family

    torch.manual_seed(0)
    m = build_model(get_family("hunyuanvideo"), block_out_channels=[16, 16, 32, 32], norm_num_groups=8,
                    layers_per_block=1)
    m.save_pretrained(tmp_path / "hy")
    out = tmp_path / "r.json"
    r = runner.invoke(app, ["benchmark", str(tmp_path / "hy"), "--shape", "1,16,2,6,6", "--repeats", "1",
                            "--warmup", "0", "--peers", "tiling", "--json", str(out), "--device", "cpu"],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["diffusers fp32 (reference)"]["status"] == "ok"
    ok = [row for row in rows.values() if row["kind"] == "ladder" and row["status"] == "ok"]
    assert ok and all(row["psnr_db"] > 90 for row in ok), [(row["name"], row["psnr_db"]) for row in ok]
    assert rows["+ planner (tile/chunk)"]["status"] == "skipped"
    assert "whole frames through diffusers' HunyuanVideo decode" in rows["+ planner (tile/chunk)"]["reason"]
    assert rows["+ attention backend"]["status"] == "ok"
    # the ladder follows the decode's own choice: channels_last_3d measured slower for HunyuanVideo
    assert rows["+ channels_last"]["status"] == "skipped" and "NCDHW" in rows["+ channels_last"]["reason"]
    assert all(s["status"] != "applied" for row in ok for s in row["stages"] if s["name"] == "channels_last")


def test_rows_whose_stage_does_nothing_are_not_timed(result):
    """A row whose stage reported skipped (known once the pipeline is built) costs no decodes: no times in the JSON,
    where they used to sit beside the identical row above (a CPU run spent most of its time on them)."""
    data, _ = result
    rows = {r["name"]: r for r in data["rows"]}
    for name in ("+ fused norms (Triton)", "+ fused epilogues", "+ stacked Conv3d", "+ CUDA graphs"):
        assert rows[name]["status"] == "skipped" and rows[name]["median_ms"] is None, rows[name]
    assert rows["+ channels_last"]["status"] == "ok" and rows["+ channels_last"]["median_ms"] > 0


def test_table_fits_a_narrow_terminal(result, monkeypatch):
    """80 columns: the numbers stay whole (columns are dropped and named, not every cell cut to '…')."""
    from rich.console import Console

    from vaeopt.cli import benchmark as command, printing

    data, _ = result
    for width in (200, 80):
        con = Console(width=width, record=True, highlight=False)
        monkeypatch.setattr(printing, "out_console", con)
        command.print_bench(data)
        text = con.export_text()
        assert "…" not in text and max(len(ln) for ln in text.splitlines()) <= width
        ch = next(r for r in data["rows"] if r["name"] == "+ channels_last")
        assert f"{ch['median_ms']:.1f}" in text
        header = next(ln for ln in text.splitlines() if " row " in ln)
        assert ("min-max" in header) == (width == 200)  # dropped at 80, and said so below the table
        assert width == 200 or "min-max" in text.split("└")[-1]


def test_workload_names_in_help_are_the_benchmarks():
    from vaeopt import benchmark
    from vaeopt.cli.benchmark import PEER_NAMES, WORKLOAD_NAMES

    assert tuple(benchmark.WORKLOADS) == WORKLOAD_NAMES
    assert benchmark.PEERS == PEER_NAMES  # (--peers is checked with these before torch loads)


def test_the_cuda_graphs_row_is_timed_when_graphs_are_armed(monkeypatch):
    """Armed graphs say "nothing captured yet" until the timed decodes capture: the row must still be timed (the
    precheck of stage lines as built read that as skipped, so on a GPU the row was never measured). A stand-in for
    GraphedDecode captures on its first call, as the real one does."""
    from vaeopt import benchmark as B
    from vaeopt.families import build_model, get_family
    from vaeopt.stages import graphs as G

    class Captures:
        def __init__(self, fn, device):
            self.fn, self.captures, self.replays = fn, 0, 0

        def __call__(self, z):
            self.captures, self.replays = 1, self.replays + 1
            return self.fn(z)

        def reset(self):
            pass

        def report(self):
            return f"{self.captures} shape(s) captured, {self.replays} replays"

    monkeypatch.setattr(G, "available", lambda device: (True, ""))
    monkeypatch.setattr(G, "GraphedDecode", Captures)
    spec = get_family("sdxl")
    over = dict(block_out_channels=[32, 32], norm_num_groups=8, layers_per_block=1,
                down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2)
    res = B.run_benchmark(spec, build_model(spec, **over).state_dict(), (1, 4, 8, 8), device=torch.device("cpu"),
                          dtype=torch.float32, peers=(), repeats=1, warmup=0, fp8=False, log=lambda s: None,
                          workload=None, command="x", model_overrides=over)
    row = next(r for r in res["rows"] if r["name"] == "+ CUDA graphs")
    assert row["status"] == "ok" and row["median_ms"] > 0, row["reason"]
    assert next(s for s in row["stages"] if s["name"] == "graphs")["status"] == "applied"


def _tiny_bench(repeats: int, warmup: int):
    from vaeopt import benchmark as B
    from vaeopt.families import build_model, get_family

    spec = get_family("sdxl")
    over = dict(block_out_channels=[32, 32], norm_num_groups=8, layers_per_block=1,
                down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2)
    return B.Bench(spec, build_model(spec, **over).state_dict(), (1, 4, 8, 8), torch.device("cpu"), torch.float32,
                   repeats, warmup, lambda s: None, over)


def _first_call_slow(calls: list):
    """A decode whose first call pays a one-time cost (a compile, kernel selection) of 300 ms; later calls ~1 ms."""
    import time

    def make():
        def fn():
            calls.append(1)
            time.sleep(0.3 if len(calls) == 1 else 0.001)
            return torch.zeros(1)
        return fn
    return make


def test_warmup_0_reports_the_first_call_as_cold_not_in_the_median():
    """--warmup 0: the first timed call carries first-call costs; it is reported as cold_ms and kept out of the
    median/min/max when there are 2 or more repeats (one repeat: its time is the median, flagged cold)."""
    calls: list = []
    row = _tiny_bench(3, 0).run("slow first", "peer", _first_call_slow(calls))
    assert len(calls) == 3 and len(row.times_ms) == 3  # every call made is in times_ms, the cold one first
    assert row.cold_ms >= 300 and row.times_ms[0] == pytest.approx(row.cold_ms, abs=1e-3)
    assert row.median_ms < 100 and row.max_ms < 100 and not row.median_is_cold  # steady: the 2 warm calls
    calls.clear()
    row = _tiny_bench(1, 0).run("slow first", "peer", _first_call_slow(calls))
    assert row.median_ms >= 300 and row.cold_ms == pytest.approx(row.median_ms) and row.median_is_cold
    calls.clear()
    row = _tiny_bench(3, 1).run("slow first", "peer", _first_call_slow(calls))
    assert len(calls) == 4 and row.cold_ms is None and row.median_ms < 100 and not row.median_is_cold


def test_warmup_0_is_said_in_the_table(tmp_path, samples_dir):
    for repeats, said in (("2", "first call of each row (cold"), ("1", "one cold call")):
        out = tmp_path / f"r{repeats}.json"
        r = runner.invoke(app, ["benchmark", str(samples_dir / "tiny_kl_image.safetensors"), "--shape", "1,4,8,8",
                                "--repeats", repeats, "--warmup", "0", "--peers", "", "--json", str(out),
                                "--device", "cpu"], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert said in " ".join(r.output.split()), r.output
        ref = json.loads(out.read_text())["rows"][0]
        assert ref["cold_ms"] > 0 and ref["median_is_cold"] == (repeats == "1")


def test_rows_collect_garbage_without_walking_the_imports(monkeypatch):
    """Each row collects the rows before it (their models gone before its peak is read). A full collection walks every
    object Python tracks: after torch and diffusers are imported, half a second per row on a CPU, seconds per run.
    What exists before the first row is frozen out of those walks, and let go again after the run."""
    import gc

    from vaeopt import benchmark as B
    from vaeopt.families import build_model, get_family

    seen = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: seen.append(gc.get_freeze_count()) or real(*a))
    spec = get_family("sdxl")
    over = dict(block_out_channels=[32, 32], norm_num_groups=8, layers_per_block=1,
                down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2)
    gc.unfreeze()  # (as in a fresh `vaeopt benchmark` process: a decode test before may have frozen its imports)
    B.run_benchmark(spec, build_model(spec, **over).state_dict(), (1, 4, 8, 8), device=torch.device("cpu"),
                    dtype=torch.float32, peers=(), repeats=1, warmup=0, fp8=False, log=lambda s: None,
                    workload=None, command="x", model_overrides=over)
    # one collection before the freeze, then the rows': torch alone is hundreds of thousands of objects
    assert len(seen) >= 4 and seen[0] == 0 and min(seen[1:]) > 1000
    assert gc.get_freeze_count() == 0


def test_an_interrupt_before_the_first_row_leaves_no_global_state(monkeypatch):
    """Ctrl-C during the collection before the first row (half a second on a CPU), e.g. in a notebook that goes on
    afterwards: cuDNN's autotuning (--cudnn-autotune, process-wide) is switched back and nothing stays frozen."""
    import gc

    from vaeopt import benchmark as B
    from vaeopt.families import get_family
    from vaeopt.stages import cudnn_autotune

    monkeypatch.setattr(cudnn_autotune, "available", lambda device: (True, ""))  # (no GPU needed to reach the point)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)

    def interrupted(*a):
        raise KeyboardInterrupt

    gc.unfreeze()
    monkeypatch.setattr(gc, "collect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        B.run_benchmark(get_family("sdxl"), {}, (1, 4, 8, 8), device=torch.device("cpu"), dtype=torch.float32,
                        peers=(), repeats=1, warmup=0, fp8=False, log=lambda s: None, workload=None, command="x",
                        autotune=True)
    assert torch.backends.cudnn.benchmark is False and gc.get_freeze_count() == 0


def test_the_readme_cpu_example_runs_and_is_small(tmp_path, samples_dir):
    """The README's CPU benchmark line runs as written (flags still spelled so) on a latent small enough for a quick
    answer on a CPU: every row decodes a 128x128 image, the run is mostly imports."""
    import re
    import shlex

    readme = (samples_dir.parent / "README.md").read_text()
    line = next(m.group(1) for m in re.finditer(r"^\s+vaeopt (benchmark samples/[^#\n]*?)\s*#", readme, re.M))
    args = shlex.split(line)
    args[1] = str(samples_dir.parent / args[1])
    out = tmp_path / "r.json"
    r = runner.invoke(app, [*args, "--device", "cpu", "--json", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["latent_shape"][-2] * data["latent_shape"][-1] <= 16 * 16 and data["cpu_numbers"]
    assert all(row["status"] in ("ok", "skipped") for row in data["rows"])
