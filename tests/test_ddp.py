"""DDP: two CPU processes (gloo) launched by torchrun train a few steps and end with identical weights."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    import lightning.pytorch as pl
    from ssogvit.train.config import compose
    from ssogvit.train.run import train

    out = sys.argv[1]
    rank = int(os.environ["RANK"])

    class SaveOwnWeights(pl.Callback):  # each process writes the weights it holds in memory
        def on_train_end(self, trainer, pl_module):
            state = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
            torch.save({"state": state, "steps": trainer.global_step, "backend": torch.distributed.get_backend()},
                       os.path.join(out, f"rank{rank}.pt"))

    summary = train(compose(sys.argv[2:]), callbacks=[SaveOwnWeights()], verbose=False)
    assert summary["world_size"] == 2 and summary["global_rank"] == rank
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_ddp_ranks_end_identical(tmp_path):
    script = tmp_path / "ddp_run.py"
    script.write_text(SCRIPT)
    out = tmp_path / "ddp"
    overrides = [
        "data=synthetic", "data.img_size=16", "data.train_size=64", "data.val_size=16", "data.batch_size=8",
        "data.learnable=true", "model.size=tiny", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2",
        "model.kwargs.depth=1", "model.kwargs.patch_size=4", "trainer.max_epochs=1", "trainer.accelerator=cpu",
        "trainer.devices=2", "trainer.strategy=ddp", "trainer.enable_progress_bar=false", f"output_dir={out}",
        "ckpt.every_n_train_steps=null", "export.safetensors=false",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           f"--master_port={_free_port()}", str(script), str(out), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["backend"] == r1["backend"] == "gloo"
    assert r0["steps"] == r1["steps"] == 4  # 64 images / (2 ranks x 8) per step
    assert r0["state"].keys() == r1["state"].keys()
    for k in r0["state"]:
        assert torch.equal(r0["state"][k], r1["state"][k]), k
