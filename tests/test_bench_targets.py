"""The performance-target evaluation of issue 6 (bounds, and rows built from benchmark results)."""

import pytest

from ssogvit.bench.targets import evaluate_targets, format_targets, mixer_bound, model_bound, target_points


@pytest.mark.parametrize("res,bound", [(224, 2.10), (384, 2.45), (512, 2.86), (768, 4.00), (1024, 5.50)])
def test_mixer_bound_is_the_issues_multiply_add_ratio(res, bound):
    assert mixer_bound(res) == pytest.approx(bound, abs=0.006)


@pytest.mark.parametrize("res,bound", [(224, 1.23), (512, 1.42), (1024, 2.13)])
def test_whole_model_bound_adds_the_mlp(res, bound):
    assert model_bound(res) == pytest.approx(bound, abs=0.006)


def _op(label, res, batch, ms, mib, tokens):
    return dict(kind="operator", label=label, res=res, batch=batch, status="ok", time_ms_median=ms, peak_mib=mib,
                torch_peak_mib=0.8 * mib, tokens=tokens, mode="inference", achieved_gflops_per_s=10.0)


def test_rows_compare_against_the_targets():
    rows = [dict(kind="matmul", label="matmul-2048", res=0, batch=1, status="ok", achieved_gflops_per_s=100.0)]
    for res, tokens in [(512, 1025), (1024, 4097)]:
        rows += [
            _op("mha", res, 8, 100.0, 100.0 * tokens / 1025, tokens),
            _op("ssog", res, 8, 100.0 / (0.95 * mixer_bound(res)), 50.0 * tokens / 1025, tokens),
            _op("ssog-steered", res, 8, 250.0 / mixer_bound(res), 90.0 * tokens / 1025, tokens),
        ]
    out = evaluate_targets(rows)
    by = {(r["target"], r["point"]): r for r in out}
    assert by[("mixer speed-up >= 90% of bound", "res 512, batch 8")]["met"] is True
    assert by[("mixer peak memory <= 0.75x fused attention", "res 1024, batch 8")]["measured"] == pytest.approx(0.5)
    assert by[("memory exponent k (memory ~ N^k, resident)", "ssog, batch 8")]["measured"] == pytest.approx(1.0)
    torch_k = by[("memory exponent k (memory ~ N^k, PyTorch allocations)", "ssog, batch 8")]
    assert torch_k["measured"] == pytest.approx(1.0) and torch_k["met"] is True
    steered = by[("steered time / fixed time", "res 512, batch 8")]
    assert steered["measured"] == pytest.approx(2.5 * 0.95) and steered["met"] is False
    assert by[("fixed mixer rate at 1024 / matmul peak", "res 1024, batch 8")]["measured"] == pytest.approx(0.1)
    table = format_targets(out)
    assert "**no**" in table and "| yes |" in table


def test_a_failed_point_is_a_row_not_a_crash():
    rows = [_op("mha", 224, 1, 10.0, 10.0, 197), dict(kind="operator", label="ssog", res=224, batch=1, status="oom")]
    out = evaluate_targets(rows)
    assert out[0]["measured"] is None and out[0]["note"] == "a point failed"


def test_points_cover_every_target():
    points = target_points(resolutions=(224, 512), batches=(1,), train_resolutions=(384,), iters=1, warmup=0)
    kinds = {(p["kind"], p.get("label"), p.get("mode", "inference")) for p in points}
    assert ("matmul", "matmul-2048", "inference") in kinds
    assert {("operator", m, "inference") for m in ("mha", "ssog", "ssog-steered")} <= kinds
    assert ("model", "vit-base-ssog", "train") in kinds and ("model", "vit-base-mha", "inference") in kinds


def test_training_memory_is_judged_on_both_measures():
    def model(mixer, peak, torch_peak):
        return dict(kind="model", label=f"vit-base-{mixer}", res=384, batch=1, mode="train", status="ok",
                    time_ms_median=100.0, peak_mib=peak, torch_peak_mib=torch_peak)

    out = evaluate_targets([model("mha", 500.0, 345.0), model("ssog", 520.0, 316.0)])
    by = {r["target"]: r for r in out}
    assert by["training step peak memory (resident)"]["met"] is False
    assert by["training step peak memory (resident)"]["measured"] == pytest.approx(1.04)
    assert by["training step peak memory (PyTorch allocations)"]["met"] is True
    assert by["training step peak memory (PyTorch allocations)"]["measured"] == pytest.approx(316 / 345)


def test_targets_are_evaluated_again_from_a_saved_run(tmp_path):
    from ssogvit.bench.cli import main
    from ssogvit.bench.runner import write_results

    rows = [_op("mha", 512, 1, 90.0, 16.0, 1025), _op("ssog", 512, 1, 30.0, 6.0, 1025)]
    meta = dict(cpu="test cpu", torch="x", torch_threads=2, loadavg=[0.0], command="ssogvit bench targets ...")
    write_results(rows, meta, tmp_path, "saved")
    assert main(["targets", "--from-json", str(tmp_path / "saved.json"), "--out", str(tmp_path), "--name", "again",
                 "--repeats", "3"]) == 0
    table = (tmp_path / "again_table.md").read_text()
    assert "| mixer speed-up >= 90% of bound | res 512, batch 1 |" in table and "3.00" in table
    assert "each point ran in 3 fresh processes" in table
