"""Training-step memory as the benchmark measures it: counted by hand on a small model, the same in fresh processes,
and what a step saves for backward."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from ssogvit.bench import memory
from ssogvit.bench.flops import find_mixers
from ssogvit.bench.point import make_step

MIB = 2**20


class _Block(nn.Module):
    def __init__(self, dim=256, hidden=512):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_what_a_forward_saves_for_backward_is_counted_by_hand():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(64, 256)
    out = memory.saved_for_backward(net, lambda: net(x), exclude=[x])
    act = 64 * 512 * 4 / MIB  # one hidden activation, fp32
    # GELU saves its input (fc1's output), fc2 saves its input (GELU's output), in each block; fc1 saves its input,
    # which for the first block is the excluded x and for the second the first block's output (64 x 256)
    assert out["saved_by_module"] == {"blocks.*.act": [2 * act, 2], "blocks.*.fc2": [2 * act, 2],
                                      "blocks.*.fc1": [64 * 256 * 4 / MIB, 2]}
    assert out["saved_mib"] == pytest.approx(4 * act + 64 * 256 * 4 / MIB)
    assert out["grads_mib"] == sum(p.numel() for p in net.parameters()) * 4 / MIB
    assert all(p.grad is None for p in net.parameters())  # the count leaves no gradients behind


def test_a_training_step_is_measured_by_the_allocator_with_what_lives_across_it():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(64, 256)
    step, opt = make_step(net, lambda: net(x), device=torch.device("cpu"), precision="fp32", train=True)
    step()  # AdamW creates its state in the first step
    first = memory.torch_peak_call(step, kept=[net, opt, x])
    again = memory.torch_peak_call(step, kept=[net, opt, x])
    params = sum(p.numel() for p in net.parameters()) * 4 / MIB
    # parameters and AdamW's two moments per parameter, the input, and a scalar step count per parameter
    assert first["state_mib"] == pytest.approx(3 * params + 64 * 256 * 4 / MIB, abs=4 * 8 / MIB)
    saved = memory.saved_for_backward(net, lambda: net(x), exclude=[x])
    # every gradient is alive at once when backward ends, every saved tensor when forward ends
    assert first["torch_peak_mib"] >= max(params, saved["saved_mib"])
    # ... and nothing near a second copy of parameters, moments and activations on top
    assert first["torch_peak_mib"] <= params + 2 * 0.5 + saved["saved_mib"]
    assert again == first  # the allocator's bytes, not pages: the same every time


@pytest.mark.slow
def test_the_step_peak_is_the_same_in_fresh_processes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ["models", "--families", "vit", "--sizes", "tiny", "--mixers", "ssog", "--set", "depth=2", "--res", "64",
            "--batch", "2", "--mode", "train", "--warmup", "1", "--iters", "0", "--threads", "1", "--repeats", "2",
            "--out", str(tmp_path), "--name", "mem", "--no-plots"]
    res = subprocess.run([sys.executable, "-m", "ssogvit", "bench", *args], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = json.loads((tmp_path / "mem.json").read_text())["rows"]
    peaks = row["repeat_peaks_mib"]
    assert len(peaks) == 2 and min(peaks) > 0
    assert (max(peaks) - min(peaks)) / min(peaks) < 0.03, peaks
    assert row["memory_method"].startswith("torch allocator") and row.get("time_ms") is None  # --iters 0: untimed
    table = (tmp_path / "mem.md").read_text()
    assert "Where the bytes go" in table and "| vit-tiny-ssog | 64 | 2 | blocks.*.attn |" in table


def test_ssog_mixers_are_recognised_by_type_not_by_parameter_names():
    from ssogvit.layers import SSoGAttention, create_mixer

    class LooksLikeSSoG(nn.Module):  # the parameter names of SSoG, but not an SSoG mixer
        def __init__(self):
            super().__init__()
            self.mu, self.v = nn.Parameter(torch.zeros(4)), nn.Linear(8, 8)

    ssog = create_mixer("ssog", 64, 4)
    assert isinstance(ssog, SSoGAttention) and find_mixers(nn.Sequential(ssog)) == [ssog]
    assert find_mixers(nn.Sequential(LooksLikeSSoG())) == []
