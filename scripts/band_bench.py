"""Banded against dense SSoG mixing on the CPU (docs/operator.md, "Bands"; docs/benchmarks.md, "Banded mixing").

Each point (mixer, grid side, field width, banded or dense) runs in a fresh process; the repeats are interleaved
(every point once, then every point again), so that a busy spell of a shared machine falls on both sides of a ratio.
Prints, per point, the medians and the ratio banded / dense, and the bands' mean length over the row's.
``--train`` times a training step (forward and backward; both read the bands, or neither), ``--part mixing`` the
mixing op alone (``ops.ssog_mix_field``, ``ops.ssog_mix_steered`` of the mixer's geometry) without the value and
output projections around it.

    PYTHONPATH=src python scripts/band_bench.py --sides 32 64 128 256 --sigmas 0.5 1 2 4 --repeats 3
    PYTHONPATH=src python scripts/band_bench.py --train --part mixing --sides 64 128 --sigmas 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def _point(kind: str, side: int, sigma: float, banded: bool, train: bool, part: str, dim: int, heads: int,
           calls: int, threads: int) -> dict:
    """One point, in this process: the mixer's (or with ``part="mixing"`` the mixing op's) forward (inference) or
    forward and backward (training step), the median of ``calls`` timed calls after two warm-up calls."""
    import time

    import torch

    from ssogvit import core, ops
    from ssogvit.backends import cpu
    from ssogvit.layers import create_mixer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cpu.BAND_FRACTION = 1.0 if banded else -1.0  # always banded, or never
    mixer = create_mixer(kind, dim=dim, num_heads=heads)
    with torch.no_grad():  # every atom as wide as asked: sigma = sigma_min + softplus(rho) + eps, tau = 1
        mixer.rho.fill_(float(torch.log(torch.expm1(torch.tensor(max(sigma - 0.25 - 1e-4, 1e-3))))))
        mixer.theta.fill_(float(torch.log(torch.expm1(torch.tensor(0.5)))))
    x = torch.randn(1, 1 + side * side, dim, requires_grad=train)
    grid = (side, side)
    if part == "mixing" and kind == "ssog":
        def mix():
            return ops.ssog_mix_field(x, grid, mixer.mu, mixer.sigma(), mixer.mixture(), mixer.tau())
    elif part == "mixing":
        with torch.no_grad():
            geometry = [t.detach().requires_grad_(train) for t in mixer.geometry(x[:, 1:])]

        def mix():
            return ops.ssog_mix_steered(x, grid, *geometry, mixer.tau())
    else:
        def mix():
            return mixer(x, grid)

    def call():
        if train:
            mix().sum().backward()
        else:
            with torch.no_grad():
                mix()

    times = []
    for i in range(calls + 2):
        start = time.perf_counter()
        call()
        if i >= 2:
            times.append(time.perf_counter() - start)
    scale = torch.rsqrt(torch.tensor(2.0 * float(mixer.tau()))) / mixer.sigma().detach()
    bands = core.field_bands(mixer.mu.detach(), scale, (side, side), torch.float32)
    fraction = float(sum(((b[..., 1] - b[..., 0]) / side).float().mean() for b in bands) / 2)
    return {"ms": 1e3 * statistics.median(times), "band_fraction": fraction}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["ssog", "ssog-steered"])
    parser.add_argument("--sides", nargs="+", type=int, default=[32, 64, 128, 256])
    parser.add_argument("--sigmas", nargs="+", type=float, default=[1.0, 4.0])
    parser.add_argument("--train", action="store_true", help="time a training step (forward and backward)")
    parser.add_argument("--part", choices=["mixer", "mixing"], default="mixer", help="the whole mixer (value and "
                        "output projections included) or the mixing op alone")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per point (1: steadier on a shared "
                        "machine)")
    parser.add_argument("--point", help=argparse.SUPPRESS)  # internal: run one point, print its JSON
    args = parser.parse_args()
    if args.point:
        print(json.dumps(_point(**json.loads(args.point))))
        return
    points = [dict(kind=k, side=n, sigma=s, banded=b, train=args.train, part=args.part, dim=args.dim,
                   heads=args.heads, calls=args.calls, threads=args.threads)
              for k in args.kinds for n in args.sides for s in args.sigmas for b in (False, True)]
    results: dict[int, list[dict]] = {i: [] for i in range(len(points))}
    for _ in range(args.repeats):  # interleaved: every point once per round, each in a fresh process
        for i, point in enumerate(points):
            done = subprocess.run([sys.executable, __file__, "--point", json.dumps(point)], capture_output=True,
                                  text=True, check=True)
            results[i].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"# {point['kind']} side {point['side']} sigma {point['sigma']} banded {point['banded']}: "
                  f"{results[i][-1]['ms']:.2f} ms", flush=True)
    print(f"{'mixer':14} {'side':>5} {'sigma':>6} {'band/row':>8} {'dense ms':>10} {'banded ms':>10} {'ratio':>6}")
    for i in range(0, len(points), 2):
        dense, band = (statistics.median(r["ms"] for r in results[j]) for j in (i, i + 1))
        p = points[i]
        print(f"{p['kind']:14} {p['side']:5d} {p['sigma']:6.2f} {results[i][0]['band_fraction']:8.2f} "
              f"{dense:10.2f} {band:10.2f} {band / dense:6.2f}")


if __name__ == "__main__":
    main()
