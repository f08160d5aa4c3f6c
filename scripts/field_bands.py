"""The band widths of trained SSoG fields, per block (docs/operator.md, "Bands"; the table in docs/benchmarks.md,
"Band widths of trained fields").

For each model file (an exported ``.safetensors`` or a checkpoint) and each SSoG mixer in order of application: the
atoms' widths ``sigma``, the temperature ``tau``, and the band ``core.axis_band`` keeps of each kernel row in float32
and float64: its length on an interior row (``2 w + 1`` cells at most, ``w = core.band_halfwidth``; no border
clamps it: the mean over the atoms and the widest), and its mean length over the rows of the model's own grid. A
steered mixer's widths can grow by its width gate, ``sigma exp(s_sigma)``; the widest such atom is shown beside. Files of one run group (seeds) are summarised
together: the median of each number over them, and the largest.

    PYTHONPATH=src python scripts/field_bands.py /work/runs/main/ssog/avg/seed*/export/model.safetensors
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from ssogvit import core
from ssogvit.layers import is_ssog
from ssogvit.train.io import load_model


def block_bands(path: str | Path) -> tuple[tuple[int, int], list[dict]]:
    """The model's grid, and one row per SSoG mixer of the model in ``path``."""
    model = load_model(path)
    size = model.img_size if isinstance(model.img_size, (tuple, list)) else (model.img_size,) * 2
    grid = tuple(int(s) // int(model.patch_size) for s in size)
    rows = []
    with torch.no_grad():
        for block, mixer in enumerate(m for m in model.mixers() if is_ssog(m)):
            sigma, tau = mixer.sigma().double(), mixer.tau().double()
            tau = tau[:, None, None] if tau.ndim else tau
            scale = core.kernel_scale(sigma, tau)
            row = {"block": block, "sigma_min": float(sigma.min()), "sigma_max": float(sigma.max()),
                   "tau": float(tau.max())}
            for name, dtype in (("f32", torch.float32), ("f64", torch.float64)):
                w = core.band_halfwidth(scale, dtype)
                bands = core.field_bands(mixer.mu.double(), scale, grid, dtype)
                row[f"interior_{name}"] = float((2 * w.floor() + 1).max())
                row[f"mean_{name}"] = float((2 * w.floor() + 1).mean())
                row[f"grid_{name}"] = float(sum((b[..., 1] - b[..., 0]).double().mean() for b in bands) / 2)
            if "sigma" in mixer.steer:
                wide = scale / torch.exp(mixer.gates()["sigma"].double())
                row["steered_interior_f32"] = float((2 * core.band_halfwidth(wide, torch.float32).floor() + 1).max())
            rows.append(row)
    return grid, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="model files of one run group (e.g. its seeds)")
    args = parser.parse_args()
    grids, per_file = zip(*(block_bands(f) for f in args.files))
    grid = grids[0][1]
    print(f"{len(args.files)} file(s), grid {grids[0][0]} x {grid}; band lengths in cells (median over files, max)")
    print("| block | sigma | tau | interior band f32: mean, widest | f64: mean, widest | mean band f32 on the grid | "
          "steered widest f32 |")
    print("|---|---|---|---|---|---|---|")
    for block in range(len(per_file[0])):
        rows = [f[block] for f in per_file]

        def med(key, rows=rows):
            return statistics.median(r[key] for r in rows)

        def top(key, rows=rows):
            return max(r[key] for r in rows)

        steered = f"{med('steered_interior_f32'):.0f} ({top('steered_interior_f32'):.0f})" if (
            "steered_interior_f32" in rows[0]) else "-"
        print(f"| {block} | {med('sigma_min'):.2f}-{med('sigma_max'):.2f} | {med('tau'):.2f} | "
              f"{med('mean_f32'):.1f}, {top('interior_f32'):.0f} | {med('mean_f64'):.1f}, {top('interior_f64'):.0f} | "
              f"{med('grid_f32'):.1f} of {grid} | {steered} |")


if __name__ == "__main__":
    main()
