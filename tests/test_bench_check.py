"""``ssogvit bench check``: bounds, rows judged against the thresholds the user gives, the command line."""

import json
import os
import subprocess
import sys

import pytest

from ssogvit.bench.check import Thresholds, check_points, evaluate, format_check, mixer_bound, model_bound


# the ratio of the mixers' FLOP counts (ssogvit.bench.flops: SSoG's values on the patches only, plus the prefix means)
@pytest.mark.parametrize("res,bound", [(224, 2.11), (384, 2.45), (512, 2.86), (768, 4.00), (1024, 5.50)])
def test_mixer_bound_is_the_multiply_add_ratio(res, bound):
    assert mixer_bound(res) == pytest.approx(bound, abs=0.006)


@pytest.mark.parametrize("res,bound", [(224, 1.23), (512, 1.42), (1024, 2.13)])
def test_whole_model_bound_adds_the_mlp(res, bound):
    assert model_bound(res) == pytest.approx(bound, abs=0.006)


def _op(label, res, batch, ms, mib, tokens):
    return dict(kind="operator", label=label, res=res, batch=batch, status="ok", time_ms=ms, peak_mib=mib,
                tokens=tokens, mode="inference", achieved_gflops_per_s=10.0)


def _rows():
    rows = [dict(kind="matmul", label="matmul-2048", res=0, batch=1, status="ok", achieved_gflops_per_s=100.0)]
    for res, tokens in [(512, 1025), (1024, 4097)]:
        rows += [
            _op("mha", res, 8, 100.0, 100.0 * tokens / 1025, tokens),
            _op("ssog", res, 8, 100.0 / (0.95 * mixer_bound(res)), 50.0 * tokens / 1025, tokens),
            _op("ssog-steered", res, 8, 250.0 / mixer_bound(res), 90.0 * tokens / 1025, tokens),
        ]
    return rows


def test_rows_are_judged_against_the_thresholds_given_and_only_those():
    limits = Thresholds(min_bound_fraction=0.9, max_memory_ratio=0.75, max_steered_time_ratio=2.0,
                        max_memory_exponent=1.05)
    by = {(r["check"], r["point"]): r for r in evaluate(_rows(), limits)}
    speed = by[("mixer speed-up, fraction of FLOP bound", "res 512, batch 8")]
    assert speed["measured"] == pytest.approx(0.95) and speed["met"] is True and speed["goal"] == ">= 0.90"
    memory = by[("mixer peak memory / fused attention", "res 1024, batch 8")]
    assert memory["measured"] == pytest.approx(0.5) and memory["met"] is True
    assert by[("memory exponent k (memory ~ N^k)", "ssog, batch 8")]["measured"] == pytest.approx(1.0)
    steered = by[("steered time / fixed time (mixer)", "res 512, batch 8")]
    assert steered["measured"] == pytest.approx(2.5 * 0.95) and steered["met"] is False
    # no threshold given: reported, not judged
    steered_mem = by[("steered peak memory / fixed (mixer)", "res 512, batch 8")]
    assert steered_mem["measured"] == pytest.approx(1.8) and steered_mem["met"] is None
    assert steered_mem["goal"] == "(reported)"
    assert by[("fixed mixer rate at 1024 / matmul peak", "res 1024, batch 8")]["measured"] == pytest.approx(0.1)
    table = format_check(list(by.values()))
    assert "**no**" in table and "| yes |" in table and "| - |" in table
    # the same rows with a stricter memory threshold fail it
    strict = evaluate(_rows(), Thresholds(max_memory_ratio=0.4))
    assert {r["met"] for r in strict if r["check"] == "mixer peak memory / fused attention"} == {False}


def test_training_steps_are_compared_with_their_mha_twin():
    def model(mixer, peak, ms):
        return dict(kind="model", label=f"vit-base-{mixer}", mixer=mixer, res=384, batch=1, mode="train",
                    status="ok", time_ms=ms, peak_mib=peak)

    rows = [model("mha", 350.0, 100.0), model("ssog", 315.0, 80.0), model("ssog-steered", 320.0, 125.0)]
    by = {(r["check"], r["point"]): r for r in evaluate(rows, Thresholds(max_train_memory_ratio=0.9,
                                                                          min_model_speedup=1.0))}
    mem = by[("training step peak memory / MHA twin", "vit-base-ssog, res 384, batch 1")]
    assert mem["measured"] == pytest.approx(0.9) and mem["met"] is True
    steered = by[("training step peak memory / MHA twin", "vit-base-ssog-steered, res 384, batch 1")]
    assert steered["measured"] == pytest.approx(320 / 350) and steered["met"] is False
    assert by[("training step speed-up vs MHA", "vit-base-ssog, res 384, batch 1")]["measured"] == 1.25
    assert by[("training step speed-up vs MHA", "vit-base-ssog-steered, res 384, batch 1")]["met"] is False


def test_a_failed_point_is_a_row_not_a_crash():
    rows = [_op("mha", 224, 1, 10.0, 10.0, 197), dict(kind="operator", label="ssog", res=224, batch=1, status="oom")]
    out = evaluate(rows, Thresholds(min_bound_fraction=0.9))
    assert out[0]["measured"] is None and out[0]["note"] == "a point failed" and out[0]["met"] is None


def test_points_cover_every_check():
    points = check_points(resolutions=(224, 512), batches=(1,), models=("vit-base", "ode-base"),
                          train_resolutions=(384,), train_batches=(1, 4), iters=1, warmup=0, mode="inference")
    kinds = {(p["kind"], p.get("label"), p.get("mode", "inference"), p["batch"]) for p in points}
    assert ("matmul", "matmul-2048", "inference", 1) in kinds
    assert {("operator", m, "inference", 1) for m in ("mha", "ssog", "ssog-steered")} <= kinds
    for stem in ("vit-base", "ode-base"):
        trains = {("model", f"{stem}-{m}", "train", b) for m in ("mha", "ssog", "ssog-steered") for b in (1, 4)}
        assert trains <= kinds
        assert ("model", f"{stem}-mha", "inference", 1) in kinds


def _cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ssogvit", "bench", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_check_command_judges_a_saved_run_and_fails_on_a_missed_threshold(tmp_path):
    from ssogvit.bench.runner import write_results

    rows = [_op("mha", 512, 1, 90.0, 16.0, 1025), _op("ssog", 512, 1, 30.0, 6.0, 1025)]
    meta = dict(cpu="test cpu", torch="x", torch_threads=2, loadavg=[0.0], command="ssogvit bench check ...",
                repeats=3)
    write_results(rows, meta, tmp_path, "saved")
    saved = str(tmp_path / "saved.json")
    ok = _cli("check", "--from-json", saved, "--out", str(tmp_path), "--name", "again", "--max-memory-ratio", "0.75")
    assert ok.returncode == 0, ok.stderr[-2000:]
    table = (tmp_path / "again_table.md").read_text()
    assert "| mixer peak memory / fused attention | res 512, batch 1 | <= 0.75x | 0.38 | yes |" in table
    assert "| mixer speed-up, fraction of FLOP bound | res 512, batch 1 | (reported) |" in table
    assert "each point ran in 3 fresh processes" in table
    assert json.loads((tmp_path / "again_checks.json").read_text())[0]["check"].startswith("mixer")
    missed = _cli("check", "--from-json", saved, "--out", str(tmp_path), "--name", "strict",
                  "--max-memory-ratio", "0.3")
    assert missed.returncode == 1 and "0 checks passed, 1 failed" in missed.stdout
    bad = tmp_path / "not-results.json"
    bad.write_text("[1, 2]")
    refused = _cli("check", "--from-json", str(bad), "--out", str(tmp_path))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"{bad} is not a results file of `ssogvit bench check`" in refused.stderr
