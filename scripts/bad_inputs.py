"""Run the catalogue of bad inputs (scripts/bad_inputs_catalogue.py) against a checkout and classify every case.

    PYTHONPATH=<checkout>/src python scripts/bad_inputs.py [--subprocess] [--surface eval] [--json counts.json]

Each case is classified automatically:

- clear:  refused in one or two lines that name the argument (`needle`), exit status 2 (the API: a `ValueError`,
          `TypeError` or one of ssogvit's own errors), no traceback, nothing written;
- poor:   refused, but with a traceback, exit status 1 (or another), more than two lines, a message that does not
          name the argument, an exception of another kind, or files written;
- silent: accepted (exit status 0, no exception, or still running after `--timeout` seconds);
- lost:   a file that existed before was changed or removed.

Commands run in this process through `ssogvit.cli.main(argv)` (stdout and stderr captured, a fresh working folder
per case) unless `--subprocess` (or the case) asks for a child process, `python -m ssogvit`-like; the Python API
always runs here. The process runs under an address-space limit (`--mem-gb`, RLIMIT_AS) so that a request the
checkout does not refuse fails instead of taking the machine. A table per surface is printed, then every case that is
not clear.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bad_inputs_catalogue import CASES, TINY_RUN, Case  # noqa: E402

VERDICTS = ("clear", "poor", "silent", "lost")


@dataclass
class Result:
    case: Case
    verdict: str
    detail: str


class _Timeout(BaseException):
    """The case ran past its time: it was accepted."""


@contextlib.contextmanager
def _alarm(seconds: float):
    def ring(signum, frame):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# -- fixtures -------------------------------------------------------------------------------------------------------


def _flip_inside(path: Path, raw: bytes, n: int = 64) -> None:
    data = path.read_bytes()
    at = data.find(raw)
    assert at > 0, f"tensor bytes not found in {path}"
    path.write_bytes(data[:at] + os.urandom(n) + data[at + n:])


def _read_only(folder: Path) -> bool:
    """Make `folder` read-only (chattr +i for root); whether it worked."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        return shutil.which("chattr") is not None and subprocess.run(["chattr", "+i", str(folder)]).returncode == 0
    folder.chmod(0o555)
    return True


def build_fixtures(root: Path) -> dict[str, str]:
    """The files and folders the cases name (`{run}`, `{ckpt}`, ...), under `root`."""
    import torch

    from ssogvit.cli import main as cli_main
    from ssogvit.models import create_model
    from ssogvit.train.io import export_safetensors

    p: dict[str, Path] = {"missing": root / "missing.ckpt", "file": root / "a_file.txt"}
    p["file"].write_text("the user's own file\n")
    run = root / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = cli_main(["train", *TINY_RUN, f"output_dir={run}"])
    assert code == 0, "the tiny training run failed"
    p.update(run=run, ckpt=run / "checkpoints" / "best.ckpt", last=run / "checkpoints" / "last.ckpt",
             export=run / "export" / "model.safetensors")
    bad = root / "bad"
    bad.mkdir()
    p["torn"] = bad / "torn.ckpt"
    p["torn"].write_bytes(p["ckpt"].read_bytes()[:5000])
    p["empty"] = bad / "empty.ckpt"
    p["empty"].write_bytes(b"")
    p["text"] = bad / "text.ckpt"
    p["text"].write_text("hello\n")

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {root / 'pwned'}",))

    p["evil"] = bad / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"x": Evil()}}, p["evil"])
    unfinished = root / "unfinished"  # a copy of the run, not finished, whose last.ckpt took 64 random bytes
    shutil.copytree(run, unfinished)
    (unfinished / "run.json").write_text(json.dumps({"status": "running", "command": "train"}))
    for lock in unfinished.glob("*lock"):
        lock.unlink()
    last = torch.load(p["last"], weights_only=True)
    moments = next(iter(last["optimizer_states"][0]["state"].values()))["exp_avg"]
    _flip_inside(unfinished / "checkpoints" / "last.ckpt", moments.contiguous().view(torch.uint8).numpy().tobytes())
    p["unfinished"], p["flipped"] = unfinished, unfinished / "checkpoints" / "last.ckpt"
    flipped_export = bad / "export" / "model.safetensors"
    flipped_export.parent.mkdir()
    shutil.copy(p["export"], flipped_export)
    shutil.copy(p["export"].with_suffix(".json"), flipped_export.with_suffix(".json"))
    from safetensors.torch import load_file

    head = load_file(str(p["export"]))["head.weight"]
    _flip_inside(flipped_export, head.contiguous().view(torch.uint8).numpy().tobytes())
    p["flipped_export"] = flipped_export
    torn_export = bad / "torn_export" / "model.safetensors"
    torn_export.parent.mkdir()
    torn_export.write_bytes(p["export"].read_bytes()[:100])
    shutil.copy(p["export"].with_suffix(".json"), torn_export.with_suffix(".json"))
    p["torn_export"] = torn_export
    model = create_model("vit-tiny-ssog", embed_dim=32, num_heads=2, depth=1, img_size=16, patch_size=4)
    state = {"model." + k: v.clone() for k, v in model.state_dict().items()}
    state["model.head.weight"][0, 0] = float("nan")
    p["nan_ckpt"] = bad / "nan.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": {"model_config": dict(model.config)}}, p["nan_ckpt"])
    p["big_cfg_ckpt"] = bad / "big_cfg.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"model_config": {"name": "vit-base-ssog", "embed_dim": 65536,
                                                                         "depth": 96}}}, p["big_cfg_ckpt"])
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(7))
    for key, text in (("bomb_run", bomb + "data: *h\n"),
                      ("env_run", (run / "config.yaml").read_text().replace("root: null", "root: ${oc.env:HOME}")
                       .replace("name: synthetic", "name: ${oc.env:HOME}"))):
        folder = root / key
        (folder / "checkpoints").mkdir(parents=True)
        shutil.copy(p["ckpt"], folder / "checkpoints" / "best.ckpt")
        shutil.copytree(run / "logs", folder / "logs")
        (folder / "config.yaml").write_text(text)
        p[key] = folder
    torn_csv = root / "torn_csv_run"
    shutil.copytree(run, torn_csv)
    for csv_file in torn_csv.glob("logs/version_*/metrics.csv"):
        csv_file.write_bytes(b"\x00\xff\xfe garbage \x00" * 50)
    p["torn_csv_run"] = torn_csv
    saved = root / "saved"
    model.save_pretrained(saved)
    p["saved"] = saved
    cfg = json.loads((saved / "config.json").read_text())
    for key, change in (("huge_saved", {"embed_dim": 65536, "num_heads": 16, "depth": 1}),
                        ("foreign_saved", None), ("env_saved", {"global_pool": "${oc.env:HOME}"}), ("fat_saved", {})):
        folder = root / key
        shutil.copytree(saved, folder)
        doc = json.loads(json.dumps(cfg))
        if change is None:
            doc["architecture"] = "vit_huge_patch14_224"
        else:
            doc["model_args"].update(change)
        (folder / "config.json").write_text(json.dumps(doc))
        p[key] = folder
    with open(p["fat_saved"] / "model.safetensors", "r+b") as f:  # sparse: 20 GB on paper, nothing on disk
        f.truncate(20 * 10**9)
    lock_run = root / "lock_run"
    lock_run.mkdir()
    (lock_run / ".ssogvit.lock").write_text("another tool's lock\n")
    (lock_run / ".lock").write_text("another tool's lock\n")
    p["lock_run"] = lock_run
    teacher = create_model("vit-tiny-mha", embed_dim=16, num_heads=2, depth=1, img_size=16, patch_size=4, in_chans=1,
                           num_classes=10)
    p["teacher"] = export_safetensors(teacher, root / "teacher" / "model.safetensors")
    images = root / "images"
    images.mkdir()
    from PIL import Image

    for i in range(4):
        Image.new("L", (16, 16), color=i * 60).save(images / f"{i}.png")
    p["images"] = images
    for key, names in (("analysis", ("atoms.json", "atoms.md", "atoms.png")), ("report_out", ("runs.md", "curves.png"))):
        folder = root / key
        folder.mkdir()
        for name in names:
            (folder / name).write_text("the user's own file\n")
        p[key] = folder
    p["ro"] = root / "ro"
    if not _read_only(p["ro"]):
        p["ro"] = root / "no-read-only-folder-here"
    return {k: str(v) for k, v in p.items()}


def release_fixtures(root: Path) -> None:
    if os.geteuid() == 0 and (root / "ro").exists():
        subprocess.run(["chattr", "-i", str(root / "ro")])


# -- one case -------------------------------------------------------------------------------------------------------


def _snapshot(folders: list[Path]) -> dict[str, tuple]:
    out = {}
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file() and not path.is_symlink():
                st = path.stat()
                out[str(path)] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def _run_cli_here(argv: list[str], cwd: Path, timeout: float) -> tuple[object, str, str]:
    from ssogvit.cli import main as cli_main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _alarm(timeout):
            try:
                code: object = cli_main(argv)
            except SystemExit as exit_:  # argparse, or a command that exits itself
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
                if isinstance(exit_.code, str):
                    err.write(exit_.code + "\n")
    except _Timeout:
        code = "timeout"
    except BaseException:  # noqa: BLE001 - a traceback on the command line: the case is poor
        code = 1
        err.write(traceback.format_exc())
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


def _run_cli_child(argv: list[str], cwd: Path, timeout: float, mem_gb: float) -> tuple[object, str, str]:
    def limit() -> None:
        cap = int(mem_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    child = subprocess.Popen([sys.executable, "-c", "import sys; from ssogvit.cli import main; sys.exit(main())",
                              *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, preexec_fn=limit)
    try:
        out, err = child.communicate(timeout=timeout)
        return child.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the child's own session: it and whatever it started
        out, err = child.communicate()
        return "timeout", out, err


def _classify_cli(case: Case, code: object, err: str) -> tuple[str, str]:
    lines = [line for line in err.splitlines() if line.strip()]
    if code == "timeout":
        return "silent", "still running at the timeout (accepted)"
    if code == 0:
        return "silent", "exit status 0"
    if "Traceback" in err:
        return "poor", f"traceback, exit status {code}: {lines[-1][:200] if lines else ''}"
    mine = [line for line in lines if line.startswith("ssogvit") or line.startswith("usage:")]
    message = mine[-1] if mine else (lines[-1] if lines else "")
    if code != 2:
        return "poor", f"exit status {code}: {message[:200]}"
    if len(mine) > 1 or any(line.startswith("usage:") for line in lines) or len(message) > 1000:
        return "poor", f"{len(lines)} lines: {message[:200]}"
    if case.needle.lower() not in message.lower():
        return "poor", f"does not name {case.needle!r}: {message[:200]}"
    return "clear", message[:200]


def _namespace(paths: dict[str, str]) -> dict[str, object]:
    import numpy as np
    import timm
    import torch

    import ssogvit
    from ssogvit import Attention, SSoGAttention, create_mixer, create_model, ssogify
    from ssogvit.data import create_datamodule
    from ssogvit.models import from_pretrained
    from ssogvit.train.io import load_model

    def _setup(dm):
        dm.setup("fit")
        return dm

    return dict(ssogvit=ssogvit, torch=torch, np=np, timm=timm, create_model=create_model, create_mixer=create_mixer,
                SSoGAttention=SSoGAttention, Attention=Attention, ssogify=ssogify, from_pretrained=from_pretrained,
                load_model=load_model, create_datamodule=create_datamodule, _setup=_setup,
                TINY=dict(embed_dim=32, num_heads=2, depth=1, img_size=16, patch_size=4),
                P={k: Path(v) for k, v in paths.items()})


def _run_api(case: Case, paths: dict[str, str], timeout: float) -> tuple[str, str]:
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), _alarm(timeout):
            eval(case.code, _namespace(paths))  # noqa: S307 - the catalogue's own expressions
    except _Timeout:
        return "silent", "still running at the timeout (accepted)"
    except Exception as err:  # noqa: BLE001 - what kind of error is the point
        message = str(err).strip()
        ours = type(err).__module__.startswith("ssogvit") or type(err) in (ValueError, TypeError, FileNotFoundError,
                                                                          FileExistsError)
        if not ours:
            return "poor", f"{type(err).__name__}: {message.splitlines()[0][:200] if message else ''}"
        if len(message.splitlines()) > 2:
            return "poor", f"{len(message.splitlines())} lines: {message.splitlines()[0][:200]}"
        if case.needle.lower() not in message.lower():
            return "poor", f"does not name {case.needle!r}: {type(err).__name__}: {message[:200]}"
        return "clear", f"{type(err).__name__}: {message[:200]}"
    return "silent", "accepted: no exception"


def run_case(case: Case, paths: dict[str, str], work: Path, *, child: bool = False, timeout: float = 60,
             mem_gb: float = 10) -> Result:
    """Run one case in a fresh folder under `work` and classify it."""
    cwd = Path(tempfile.mkdtemp(dir=work, prefix="case-"))
    values = {**paths, "tmp": str(cwd)}
    watched = [Path(paths["run"]).parent]
    before = _snapshot(watched)
    if case.code is not None:
        verdict, detail = _run_api(case, paths, timeout)
    else:
        argv = [a.format(**values) for a in case.argv]
        if child or case.subprocess:
            code, _, err = _run_cli_child(argv, cwd, timeout, mem_gb)
        else:
            code, _, err = _run_cli_here(argv, cwd, timeout)
        verdict, detail = _classify_cli(case, code, err)
    after = _snapshot(watched)
    changed = [p for p, sig in before.items() if after.get(p) != sig]
    if changed:
        return Result(case, "lost", f"changed or removed: {', '.join(sorted(changed)[:3])}")
    written = [p for p in after if p not in before and not Path(p).is_relative_to(cwd)]
    written += [str(q) for q in cwd.rglob("*") if q.is_file()]
    if written and verdict == "clear":
        return Result(case, "poor", f"refused, but wrote {', '.join(sorted(written)[:3])}")
    return Result(case, verdict, detail)


def restore(root: Path, pristine: Path) -> None:
    """Put the fixtures back as they were (after a case changed them)."""
    for src in pristine.rglob("*"):
        dst = root / src.relative_to(pristine)
        if src.is_file() and (not dst.is_file() or dst.read_bytes() != src.read_bytes()):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


# -- the whole catalogue --------------------------------------------------------------------------------------------


def run_catalogue(cases: list[Case], *, child: bool = False, timeout: float = 60, mem_gb: float = 10,
                  progress: bool = False) -> list[Result]:
    """Build the fixtures in a temporary folder, run `cases`, clean up; the results in order."""
    base = Path(tempfile.mkdtemp(prefix="ssogvit-bad-inputs-"))
    root, work, pristine = base / "fixtures", base / "work", base / "pristine"
    for d in (root, work):
        d.mkdir()
    results = []
    try:
        paths = build_fixtures(root)
        shutil.copytree(root, pristine, ignore=shutil.ignore_patterns("ro", "fat_saved"), symlinks=True)
        for i, case in enumerate(cases, 1):
            result = run_case(case, paths, work, child=child, timeout=timeout, mem_gb=mem_gb)
            results.append(result)
            if progress:
                print(f"[{i}/{len(cases)}] {result.verdict:<6} {case.name[:110]}", file=sys.stderr, flush=True)
            if result.verdict == "lost":
                restore(root, pristine)
    finally:
        release_fixtures(root)
        shutil.rmtree(base, ignore_errors=True)
    return results


def table(results: list[Result]) -> str:
    """Counts per surface and verdict, as a Markdown table."""
    surfaces = list(dict.fromkeys(r.case.surface for r in results))
    counts = Counter((r.case.surface, r.verdict) for r in results)
    lines = ["| surface | cases | " + " | ".join(VERDICTS) + " |", "|---|---|" + "---|" * len(VERDICTS)]
    for s in surfaces:
        n = sum(counts[(s, v)] for v in VERDICTS)
        lines.append(f"| {s} | {n} | " + " | ".join(str(counts[(s, v)]) for v in VERDICTS) + " |")
    total = Counter(r.verdict for r in results)
    lines.append(f"| **all** | {len(results)} | " + " | ".join(str(total[v]) for v in VERDICTS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subprocess", action="store_true", help="run every command in a child process")
    parser.add_argument("--surface", action="append", default=[], help="only these surfaces (repeat)")
    parser.add_argument("--timeout", type=float, default=60, help="seconds before a case counts as accepted")
    parser.add_argument("--mem-gb", type=float, default=10, help="address-space limit (RLIMIT_AS) of the cases")
    parser.add_argument("--json", default=None, help="also write every result to this JSON file")
    parser.add_argument("--progress", action="store_true", help="a line per case on stderr")
    args = parser.parse_args(argv)
    cap = int(args.mem_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    cases = [c for c in CASES if not args.surface or c.surface in args.surface]
    import ssogvit

    print(f"ssogvit from {Path(ssogvit.__file__).parent}: {len(cases)} cases", flush=True)
    results = run_catalogue(cases, child=args.subprocess, timeout=args.timeout, mem_gb=args.mem_gb,
                            progress=args.progress)
    print(table(results))
    for r in results:
        if r.verdict != "clear":
            print(f"- {r.verdict}: {r.case.name[:160]}\n    {r.detail}")
    if args.json:
        Path(args.json).write_text(json.dumps([{"surface": r.case.surface, "kind": r.case.kind, "case": r.case.name,
                                                "verdict": r.verdict, "detail": r.detail} for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
