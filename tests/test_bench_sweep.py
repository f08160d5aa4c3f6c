"""The benchmark as an instrument: per-point processes, out-of-memory points, memory measurement, fits, files."""

import csv
import json
import math
import time

import pytest
import torch

from ssogvit.bench import fit_power_law
from ssogvit.bench.cli import main
from ssogvit.bench.memory import cpu_peak_call


def test_power_law_fit_recovers_a_known_exponent():
    n = [197, 577, 1025, 1601, 2305, 4097]
    wobble = [1.03, 0.98, 1.01, 0.99, 1.02, 0.97]  # multiplicative noise, zero-mean-ish in log
    y = [3.5 * x**1.5 * w for x, w in zip(n, wobble)]
    fit = fit_power_law(n, y)
    assert fit.exponent == pytest.approx(1.5, abs=0.03)
    assert fit.r2 > 0.99
    exact = fit_power_law(n, [2.0 * x**0.75 for x in n])
    assert exact.exponent == pytest.approx(0.75, abs=1e-9)
    assert exact.coef == pytest.approx(2.0, rel=1e-9)
    assert exact(1000) == pytest.approx(2.0 * 1000**0.75, rel=1e-9)
    with pytest.raises(ValueError):
        fit_power_law([100, 200], [5.0, None])


def test_cpu_peak_memory_sees_an_allocation_of_known_size():
    mib = 64
    peak = cpu_peak_call(lambda: torch.ones(mib * 2**20 // 4))
    if not peak["memory_method"].startswith("clear_refs"):
        pytest.skip(f"clear_refs unavailable: {peak['memory_method']}")
    assert mib <= peak["peak_mib"] < mib + 8


def test_torch_peak_memory_sees_transient_allocations():
    from ssogvit.bench.memory import torch_peak_call

    def fn():
        a = torch.ones(4 * 2**20 // 4)  # 4 MiB, freed before the 8 MiB below
        del a
        b = torch.ones(8 * 2**20 // 4)
        c = b + 1  # 16 MiB live together
        return c

    peak = torch_peak_call(fn)["torch_peak_mib"]
    assert peak == pytest.approx(16.0, rel=0.02)


def test_tiny_model_sweep_end_to_end(tmp_path, capfd):
    t0 = time.perf_counter()
    argv = ["models", "--families", "vit", "--sizes", "tiny", "--mixers", "mha", "ssog", "--set", "depth=2",
            "--res", "32", "64", "--batch", "2", "--warmup", "1", "--iters", "2", "--threads", "1",
            "--out", str(tmp_path), "--name", "tiny"]
    assert main(argv) == 0
    elapsed = time.perf_counter() - t0
    data = json.loads((tmp_path / "tiny.json").read_text())
    rows = data["rows"]
    assert data["meta"]["command"].startswith("ssogvit bench models")
    assert sorted((r["mixer"], r["res"]) for r in rows) == [("mha", 32), ("mha", 64), ("ssog", 32), ("ssog", 64)]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["images_per_s"] > 0 and math.isfinite(r["images_per_s"])
        assert r["peak_mib"] is not None and r["peak_mib"] >= 0
        assert r["gflops_per_image"] > 0
    with (tmp_path / "tiny.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4
    assert (tmp_path / "tiny_relative.png").stat().st_size > 0
    assert (tmp_path / "tiny_absolute.png").stat().st_size > 0
    assert "| vit-tiny-ssog | mha (fused SDPA) | 32 |" in (tmp_path / "tiny.md").read_text()
    # the memory pass's profiler logged "ERROR: ... gpuGetDeviceCount failed" per point on a CUDA build without a GPU
    assert "gpuGetDeviceCount" not in capfd.readouterr().err
    print(f"tiny sweep took {elapsed:.1f} s")  # the issue asks for under a minute; not asserted (shared machine)


def test_a_time_only_sweep_plots_without_empty_legends_or_torchs_cuda_home_line(tmp_path, capfd, recwarn):
    """``--no-memory`` draws no memory lines: the plots are written without matplotlib's "No artists with labels"
    warning. The points' timer imports ``torch.utils.cpp_extension``, which logs "No CUDA runtime is found" on a
    machine with a CUDA toolkit and no GPU (this project's, say): that line is kept out of each point's output."""
    argv = ["models", "--families", "vit", "--sizes", "tiny", "--mixers", "mha", "ssog", "--set", "depth=1",
            "--res", "32", "--batch", "1", "--warmup", "1", "--iters", "1", "--blocks", "1", "--threads", "1",
            "--no-memory", "--out", str(tmp_path), "--name", "t"]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r.get("peak_mib") is None for r in rows)
    assert (tmp_path / "t_relative.png").stat().st_size > 0 and (tmp_path / "t_absolute.png").stat().st_size > 0
    assert not [str(w.message) for w in recwarn if "legend" in str(w.message)]
    from matplotlib.image import imread

    from ssogvit.bench.sweeps import plot_models, plot_relative  # no empty memory panels beside the times
    with_memory = [dict(r, peak_mib=1.0 + i) for i, r in enumerate(rows)]
    assert (imread(plot_relative(rows, tmp_path / "r.png")).shape[1]
            < imread(plot_relative(with_memory, tmp_path / "rm.png")).shape[1])
    assert (imread(plot_models(rows, tmp_path / "a.png")).shape[0]
            < imread(plot_models(with_memory, tmp_path / "am.png")).shape[0])
    assert "No CUDA runtime" not in capfd.readouterr().err
    # a second run of the same name replaces nothing unless asked, and says so before measuring anything
    from ssogvit.outputs import OutputExistsError

    before = (tmp_path / "t.json").read_bytes()
    with pytest.raises(OutputExistsError, match=r"--out: .*t\.json exists; pass --overwrite"):
        main(argv)
    assert (tmp_path / "t.json").read_bytes() == before
    assert main(argv + ["--overwrite"]) == 0 and (tmp_path / "t.json").read_bytes() != before


def test_ode_family_is_measured_against_the_papers_explicit_attention_first(tmp_path):
    argv = ["models", "--families", "ode", "--sizes", "tiny", "--set", "depth=2", "--res", "32", "--batch", "2",
            "--warmup", "1", "--iters", "2", "--threads", "1", "--out", str(tmp_path), "--name", "ode"]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "ode.json").read_text())["rows"]
    assert [r["mixer"] for r in rows] == ["mha-unfused", "mha", "ssog"] and all(r["status"] == "ok" for r in rows)
    table = [ln for ln in (tmp_path / "ode.md").read_text().splitlines() if ln.startswith("| ode-")]
    compared = [(ln.split("|")[1].strip(), ln.split("|")[2].strip()) for ln in table]
    assert compared == [
        ("ode-tiny-mha-unfused", "(baseline)"),
        ("ode-tiny-ssog", "mha-unfused (explicit attention, as the paper's ODE-ViT)"),
        ("ode-tiny-mha", "(baseline)"),
        ("ode-tiny-ssog", "mha (fused SDPA)"),
    ]
    assert (tmp_path / "ode_relative.png").stat().st_size > 0


def test_model_ratios_name_their_baseline_and_put_the_papers_first():
    from ssogvit.bench.sweeps import default_mixers, model_table

    def row(family, mixer, ips, mib):
        return dict(family=family, size="base", mixer=mixer, label=f"{family}-base-{mixer}", res=224, batch=8,
                    status="ok", images_per_s=ips, peak_mib=mib, gflops_per_image=1.0)

    assert default_mixers("ode") == ["mha-unfused", "mha", "ssog"] and default_mixers("vit") == ["mha", "ssog"]
    rows = [row("vit", "mha", 100.0, 50.0), row("vit", "ssog", 80.0, 40.0), row("ode", "mha-unfused", 10.0, 200.0),
            row("ode", "mha", 20.0, 100.0), row("ode", "ssog", 30.0, 80.0)]
    table = [(r["family"], r["mixer"], r["baseline"], r.get("speedup"), r.get("memory_saved"))
             for r in model_table(rows)]
    assert table == [
        ("vit", "mha", "mha", None, None), ("vit", "ssog", "mha", pytest.approx(0.8), pytest.approx(0.2)),
        ("ode", "mha-unfused", "mha-unfused", None, None),
        ("ode", "ssog", "mha-unfused", pytest.approx(3.0), pytest.approx(0.6)),
        ("ode", "mha", "mha", None, None), ("ode", "ssog", "mha", pytest.approx(1.5), pytest.approx(0.2)),
    ]


def test_forced_out_of_memory_point_is_recorded_and_the_sweep_goes_on(tmp_path):
    # 1024 px, batch 8 at D = 768: the input alone is 100 MiB and the QKV tensor 300 MiB, over a 256 MiB cap
    argv = ["operator", "--mixers", "torch-mha", "--res", "64", "1024", "128", "--batch", "8",
            "--warmup", "0", "--iters", "1", "--threads", "1", "--mem-cap-mib", "256", "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "operator.json").read_text())["rows"]
    status = {(r["label"], r["res"]): r["status"] for r in rows}
    assert len(rows) == 3
    assert status[("torch-mha", 1024)] == "oom"
    assert "memory" in next(r["error"] for r in rows if (r["label"], r["res"]) == ("torch-mha", 1024)).lower()
    assert status[("torch-mha", 64)] == status[("torch-mha", 128)] == "ok"
    table = (tmp_path / "operator.md").read_text()
    assert "| 1024 | 4097 | 8 | torch-mha | oom |" in table
    assert "memory ~ N^k" in table
    assert (tmp_path / "operator_fit.png").stat().st_size > 0
    # the tables can be made again from the saved results, without running anything
    assert main(["report", str(tmp_path / "operator.json"), "--name", "again", "--no-plots"]) == 0
    assert (tmp_path / "again.md").read_text() == table


def test_operator_output_is_at_least_counted_in_peak_memory(tmp_path):
    # the output of batch 8 x 257 tokens x 768 fp32 is 6 MiB and is alive when the peak is read
    argv = ["operator", "--mixers", "mha", "--res", "256", "--batch", "8", "--warmup", "1", "--iters", "1",
            "--threads", "1", "--out", str(tmp_path), "--no-plots", "--matmul-peak"]
    assert main(argv) == 0
    peak, row = json.loads((tmp_path / "operator.json").read_text())["rows"]
    assert peak["kind"] == "matmul" and peak["achieved_gflops_per_s"] > 0
    assert "of matmul peak" in (tmp_path / "operator.md").read_text()
    assert row["memory_method"].startswith("torch allocator")
    output_mib = 8 * 257 * 768 * 4 / 2**20
    assert output_mib <= row["peak_mib"] < 20 * output_mib


def test_mixer_specs_parse_and_expand_per_implementation():
    from ssogvit.bench.sweeps import expand_impls, parse_mixer

    assert parse_mixer("ssog:impl=loop,num_atoms=8") == ("ssog", {"impl": "loop", "num_atoms": 8},
                                                        "ssog[impl=loop,num_atoms=8]")
    assert parse_mixer("torch-mha") == ("torch-mha", {}, "torch-mha")
    with pytest.raises(ValueError):
        parse_mixer("ssog:impl")
    assert expand_impls(["torch-mha", "ssog", "ssog-steered:radius=2", "ssog:impl=einsum"], ["loop", "stacked"]) == [
        "torch-mha", "ssog:impl=loop", "ssog:impl=stacked", "ssog-steered:radius=2,impl=loop",
        "ssog-steered:radius=2,impl=stacked", "ssog:impl=einsum",
    ]


def test_operator_ratios_are_taken_against_the_baseline_at_the_same_resolution_and_batch():
    from ssogvit.bench.sweeps import operator_fits, operator_table

    def row(label, res, ms, mib, gflops, batch=8):
        return dict(label=label, res=res, tokens=1 + (res // 16) ** 2, batch=batch, status="ok", time_ms=ms,
                    peak_mib=mib, gflops_per_image=gflops)

    rows = [row("mha", 224, 10.0, 40.0, 1.0), row("ssog", 224, 4.0, 30.0, 0.5),
            row("mha", 512, 80.0, 160.0, 8.0), row("ssog", 512, 20.0, 60.0, 2.0),
            dict(label="ssog", res=1024, tokens=4097, batch=8, status="oom")]
    table = {(r["label"], r["res"]): r for r in operator_table(rows, "mha")}
    assert table[("ssog", 224)]["speedup"] == pytest.approx(2.5)
    assert table[("ssog", 224)]["memory_ratio"] == pytest.approx(0.75)
    assert table[("ssog", 224)]["flop_bound"] == pytest.approx(2.0)
    assert table[("ssog", 224)]["of_bound"] == pytest.approx(1.25)
    assert table[("ssog", 512)]["speedup"] == pytest.approx(4.0)
    assert "speedup" not in table[("ssog", 1024)]
    fits = operator_fits(rows)
    assert fits[("ssog", 8)].points == 2
    assert fits[("mha", 8)].exponent == pytest.approx(math.log(4) / math.log(1025 / 197))


def test_a_training_step_point_measures_more_memory_than_inference():
    from ssogvit.bench import run_point

    point = dict(kind="model", label="vit-tiny-ssog", model="vit-tiny-ssog", model_kwargs={"depth": 2}, res=64,
                 batch=4, warmup=1, iters=1, threads=1)
    infer = run_point(point)
    train = run_point(dict(point, mode="train"))
    assert infer["status"] == train["status"] == "ok", (infer, train)
    # the step keeps every block's activations for backward and allocates a gradient per parameter (fp32)
    assert train["peak_mib"] > infer["peak_mib"] + train["params"] * 4 / 2**20
    assert train["grads_mib"] == pytest.approx(train["params"] * 4 / 2**20)
    assert train["peak_mib"] >= max(train["saved_mib"], train["grads_mib"])  # the lower bound holds
    # parameters and AdamW's two moments live across the step
    assert train["state_mib"] >= 3 * train["params"] * 4 / 2**20
    # timed with torch.utils.benchmark.Timer: one time per block, the best kept
    assert len(train["time_ms_blocks"]) == 3 and train["time_ms"] == min(train["time_ms_blocks"])


def test_repeats_keep_each_points_fastest_time_and_lowest_peak(monkeypatch, tmp_path):
    """Rounds re-run only the cheap points; a point keeps its best repeat and lists all of them."""
    from ssogvit.bench import runner

    times = {"a": iter([10.0, 8.0, 12.0]), "b": iter([500.0]), "c": iter([5.0, 7.0, 6.0])}
    peaks = {"a": iter([3.0, 4.0, 2.5]), "b": iter([9.0]), "c": iter([1.0, 1.0, 1.0])}
    calls = []

    def fake_run_point(point, *, timeout=None, launcher="forkserver"):
        calls.append(point["label"])
        t = next(times[point["label"]])
        return dict(point, status="ok", time_ms=t, time_ms_median=t + 1, images_per_s=1e3 / t,
                    peak_mib=next(peaks[point["label"]]))

    monkeypatch.setattr(runner, "run_point", fake_run_point)
    points = [dict(label=k, batch=1) for k in "abc"]
    rows = runner.run_sweep(points, out_dir=tmp_path, name="r", repeats=3, repeat_below_ms=100.0, log=lambda s: None)
    assert calls == ["a", "b", "c", "a", "c", "a", "c"]  # rounds, and "b" (500 ms) is not repeated
    a, b, c = rows
    assert a["time_ms"] == 8.0 and a["time_ms_median"] == 9.0 and a["peak_mib"] == 2.5
    assert a["repeat_times_ms"] == [10.0, 8.0, 12.0] and a["repeats"] == 3
    assert a["repeat_peaks_mib"] == [3.0, 4.0, 2.5]
    assert b["time_ms"] == 500.0 and "repeats" not in b
    assert c["time_ms"] == 5.0 and c["repeat_times_ms"] == [5.0, 7.0, 6.0]
    saved = runner.read_results(tmp_path / "r.json")[1]
    assert saved[0]["time_ms"] == 8.0  # the files hold the merged rows


def test_a_failed_repeat_keeps_the_earlier_result():
    from ssogvit.bench.runner import merge_repeat

    best = dict(status="ok", time_ms=4.0, peak_mib=2.0)
    out = merge_repeat(best, dict(status="error", error="boom"))
    assert out["time_ms"] == 4.0 and out["status"] == "ok" and out["repeat_times_ms"] == [4.0, None]
    assert out["repeat_peaks_mib"] == [2.0, None]


def test_a_point_runs_in_a_new_interpreter_too_and_a_slow_one_is_killed_at_its_timeout():
    from ssogvit.bench import run_point

    point = dict(kind="operator", label="ssog", mixer="ssog", mixer_options={}, dim=64, heads=4, res=64, grid=[4, 4],
                 prefix=1, tokens=17, batch=2, warmup=1, iters=2, blocks=3, threads=1)
    spawned = run_point(point, launcher="spawn")
    assert spawned["status"] == "ok", spawned
    assert len(spawned["time_ms_blocks"]) == 3 and spawned["time_ms"] == min(spawned["time_ms_blocks"])
    slow = run_point(dict(point, iters=10**9), timeout=10)
    assert slow["status"] == "timeout" and slow["error"] == "no result after 10 s"
    with pytest.raises(ValueError, match="unknown launcher 'fork'"):
        run_point(point, launcher="fork")


def test_results_saved_before_block_timing_are_read_with_their_mean_time(tmp_path):
    from ssogvit.bench.runner import read_results, write_results

    write_results([dict(label="mha", status="ok", time_ms_mean=12.5, time_ms_median=12.0), dict(label="x", time_ms=3.0,
                   time_ms_mean=9.0)], {}, tmp_path, "old")
    old, new = read_results(tmp_path / "old.json")[1]
    assert old["time_ms"] == 12.5 and new["time_ms"] == 3.0


def _die(point, conn):
    """Stands in for a point's process: killed as the kernel's OOM killer kills, or gone without a word."""
    import os
    import signal

    if point["how"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def test_a_point_whose_process_dies_is_recorded_as_such(monkeypatch):
    from ssogvit.bench import runner

    monkeypatch.setattr(runner, "_child", _die)
    killed = runner.run_point(dict(how="kill", batch=1), timeout=300)
    assert killed["status"] == "oom" and "SIGKILL" in killed["error"]
    gone = runner.run_point(dict(how="exit", batch=1), timeout=300)
    assert gone["status"] == "error" and gone["error"] == "child exited with 3 without a result"


def test_a_run_of_both_modes_compares_each_mixer_within_its_mode():
    from ssogvit.bench.sweeps import format_model_table, model_table

    def row(mixer, mode, ips):
        return dict(family="vit", size="small", mixer=mixer, label=f"vit-small-{mixer}", res=1024, batch=1,
                    mode=mode, status="ok", images_per_s=ips, peak_mib=10.0, gflops_per_image=1.0)

    rows = [row("mha", "inference", 2.0), row("window", "inference", 6.0), row("mha", "train", 1.0),
            row("window", "train", 1.5)]
    ratios = {(r["mixer"], r["mode"]): r.get("speedup") for r in model_table(rows)}
    assert ratios == {("mha", "inference"): None, ("window", "inference"): pytest.approx(3.0),
                      ("mha", "train"): None, ("window", "train"): pytest.approx(1.5)}
    table = format_model_table(rows)
    assert "| vit-small-window | mha (fused SDPA) | train | 1024 | 1 |" in table and "| mode |" in table
    assert "| mode |" not in format_model_table(rows[:2])  # one mode: the table of before
