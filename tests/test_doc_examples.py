"""Every `ssogvit ...` example of README.md, docs/*.md and `ssogvit train --help` runs, in the form its kind allows.

Kinds, and the form each runs in (docs/DEVELOPING.md, "Examples in the docs"):

- `train`, `transfer`, `convert` (commands that run a Hydra config): their `--cfg job` form (the composed config is
  printed, nothing is trained), a `...` (the rest of a command line) left out; a sweep (`-m`) runs as its first
  point, each sweep value replaced by its first choice (`a,b` -> `a`, `glob(p*)` -> the first experiment matching
  `p*`), since Hydra refuses `-m` with `--cfg`.
- `list`, `--help` and override fragments of `ssogvit train --help`: as written (fragments: each with `--cfg job`).
- `main`: its short form, one epoch of one seed, two batches (`--epochs 1 --seeds 0 trainer.limit_train_batches=2
  trainer.limit_val_batches=1`).
- `eval`, `report`, `analyze` (and `transfer`/`convert` examples that read a checkpoint): as written, in a folder
  where a short digits run stands at each path the example names (`runs/x`, `runs/<name>`, ...) (slow).
- synopsis lines (`[--ckpt PATH ...]`, `<what>`), `bench` (docs/benchmarks.md: run by the benchmark's own tests) and
  lines needing a cluster, a GPU or a dataset that is not here (`data.root=/data` in a real run) are listed in
  `NOT_RUN` with the reason, and the test checks that list names only lines that exist.

The default run covers every `--cfg job`, `list` and help example in this process (a few seconds); `-m slow` runs the
rest as subprocesses.

The Python code blocks of the same files (a ```` ```python ```` fence, or an indented block that starts with `import` or
`from`) run as written, each as if in a fresh process: one child process imports torch and timm (not ssogvit) and
forks once per block, so a block that forgets `import ssogvit` fails as it would for a user. Each block runs in a
folder of its own where `runs/x/export/model.safetensors` is a `vit-small-ssog` export. A block that cannot run here
says so on the line before it: `<!-- doc-example: slow (why) -->` (run with `-m slow`) or
`<!-- doc-example: not run (why) -->`.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
from pathlib import Path

import pytest

import cli_process

ROOT = Path(__file__).resolve().parents[1]
HYDRA_COMMANDS = ("train", "transfer", "convert")
#: example -> why it is not run here (matched by its start)
NOT_RUN = {
    "ssogvit analyze <what>": "a synopsis (placeholders), not an example",
    "ssogvit bench": "benchmarks: docs/benchmarks.md's commands are run by the benchmark tests (tests/test_bench_*)",
    "ssogvit train -m hydra/launcher=submitit_slurm": "needs a SLURM cluster (its --cfg job form is checked)",
    "ssogvit eval --ckpt runs/scenes_vit_ssog": "a digit-scenes run: tests/test_dense_train.py evaluates one at "
                                                 "another size, with and without --rescale-field",
    "ssogvit report runs/scenes": "the comparison's sweep folders: tests/test_dense_train.py reports a scenes run",
}


def _doc_files() -> list[tuple[Path, list[str]]]:
    """`(path, lines)` of README.md and every docs/*.md: the files whose examples run."""
    return [(p, p.read_text().splitlines()) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]


def doc_examples() -> list[tuple[str, str]]:
    """`(where, command)` for each `ssogvit ...` line of a code block in README.md and docs/*.md; backslash
    continuations joined, a trailing `# comment` and a `.venv/bin/` prefix removed."""
    found = []
    for path, lines in _doc_files():
        fenced = False
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.lstrip().startswith("```"):
                fenced = not fenced
            text = line.strip()
            if (fenced or line.startswith("    ")) and re.match(r"^(\.venv/bin/)?ssogvit [a-z-]", text):
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1].rstrip() + " " + lines[i].strip()
                text = re.sub(r"\s+#\s.*$", "", text).removeprefix(".venv/bin/")
                found.append((f"{path.relative_to(ROOT)}:{i + 1}", text))
            i += 1
    return found


PY_MARKER = re.compile(r"<!-- doc-example: (slow|not run) \((.+)\) -->")


def doc_python_blocks() -> list[tuple[str, str, str | None]]:
    """`(where, code, marker)` for each Python block of README.md and docs/*.md: a ```` ```python ```` fence, or an
    indented block starting with `import` / `from`; `marker` is `slow`, `not run` or None (`PY_MARKER` on the
    nearest non-blank line before the block)."""
    found = []
    for path, lines in _doc_files():
        fenced = False
        i = 0
        while i < len(lines):
            line, start = lines[i], i
            if line.strip().startswith("```") and (fenced or line.strip() != "```python"):
                fenced = not fenced  # another language's block opens, or a block closes
                i += 1
                continue
            if line.strip() == "```python":
                j = i + 1
                while j < len(lines) and lines[j].strip() != "```":
                    j += 1
                code, i = "\n".join(lines[i + 1:j]), j + 1
            elif (not fenced and re.match(r"    (import|from) ", line) and (i == 0 or not lines[i - 1].strip())):
                j = i
                while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                    j += 1
                code, i = "\n".join(x[4:] for x in lines[i:j]), j
            else:
                i += 1
                continue
            before = next((x for x in reversed(lines[:start]) if x.strip()), "")
            mark = PY_MARKER.search(before)
            found.append((f"{path.relative_to(ROOT)}:{start + 1}", code.strip("\n") + "\n", mark and mark.group(1)))
    return found


#: the child that runs the Python blocks: torch and timm imported once, one fork per block, each in its own folder
_BLOCK_RUNNER = """
import json, os, sys, time, traceback
import torch, timm
torch.set_num_threads(1)
blocks, root = json.loads(sys.stdin.read()), sys.argv[1]
failures, seconds = {}, {}
for n, (where, code) in enumerate(blocks):
    start = time.perf_counter()
    folder = os.path.join(root, f"block{n}")
    os.makedirs(folder)
    os.symlink(os.path.join(root, "runs"), os.path.join(folder, "runs"))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.chdir(folder)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        try:
            exec(compile(code, where, "exec"), {"__name__": "__main__"})
            os._exit(0)
        except BaseException:
            os.write(write, traceback.format_exc()[-3000:].encode())
            os._exit(1)
    os.close(write)
    with os.fdopen(read) as pipe:
        error = pipe.read()
    _, status = os.waitpid(pid, 0)
    if status:
        failures[where] = error or f"exit status {status}"
    seconds[where] = round(time.perf_counter() - start, 1)
print(json.dumps(seconds), file=sys.stderr)
print(json.dumps(failures))
"""


def _run_python_blocks(blocks: list[tuple[str, str]], tmp_path) -> dict[str, str]:
    import json
    import subprocess
    import sys

    import torch

    from ssogvit.models import create_model
    from ssogvit.train.io import export_safetensors

    (tmp_path / "runs").mkdir()
    if any("runs/x/" in code for _, code in blocks):
        torch.manual_seed(0)
        export_safetensors(create_model("vit-small-ssog"), tmp_path / "runs" / "x" / "export" / "model.safetensors")
    done = subprocess.run([sys.executable, "-c", _BLOCK_RUNNER, str(tmp_path)], input=json.dumps(blocks),
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    print("seconds per block:", done.stderr.strip().splitlines()[-1])  # shown with -s, or when a block fails
    return json.loads(done.stdout.splitlines()[-1])


PY_BLOCKS = doc_python_blocks()
#: the blocks of the default run (about 15 s: each builds a ViT-S); the others with `-m slow`
DEFAULT_PY_FILES = ("README.md:", "docs/dense.md:")


def _failures_text(failures: dict[str, str]) -> str:
    return "\n\n".join(f"{where}:\n{error}" for where, error in failures.items())


def test_the_python_blocks_of_the_readme_and_dense_docs_run_as_written_in_a_fresh_process(tmp_path):
    blocks = [(where, code) for where, code, mark in PY_BLOCKS if mark is None and where.startswith(DEFAULT_PY_FILES)]
    assert len(blocks) >= 3 and len(PY_BLOCKS) >= 10
    failures = _run_python_blocks(blocks, tmp_path)
    assert not failures, _failures_text(failures)


@pytest.mark.slow
def test_the_other_python_blocks_of_the_docs_run_as_written(tmp_path):
    blocks = [(where, code) for where, code, mark in PY_BLOCKS
              if mark == "slow" or (mark is None and not where.startswith(DEFAULT_PY_FILES))]
    failures = _run_python_blocks(blocks, tmp_path)
    assert not failures, _failures_text(failures)


def help_fragments() -> list[str]:
    """The overrides that `ssogvit train --help` shows as examples (`key=value` tokens of its header), with each
    `a|b|c` alternative on its own."""
    text = (ROOT / "src/ssogvit/conf/config.yaml").read_text()  # the help text is data: hydra.help.header
    block = text[text.index("Train a model. OVERRIDEs"):text.index("Sweeps:")]
    tokens = []
    for line in block.splitlines()[1:]:
        for token in shlex.split(line):
            if "=" not in token or "<" in token:
                continue
            key, _, value = token.partition("=")
            tokens += [f"{key}={v}" for v in value.split("|")] if "|" in value and "[" not in value else [token]
    return tokens


def first_point(args: list[str]) -> list[str]:
    """A sweep's first point: `-m` dropped, each sweep value replaced by its first choice."""
    from ssogvit.train.config import list_experiments

    out = []
    for arg in args:
        if arg in ("-m", "--multirun", "..."):  # `...`: "the rest of your command line"
            continue
        key, sep, value = arg.partition("=")
        glob = re.fullmatch(r"glob\((.+)\)", value)
        if sep and glob:
            value = next(n for n in list_experiments() if fnmatch.fnmatch(n, glob.group(1)))
        elif sep and "," in value and not value.startswith(("[", "'", '"')):
            value = value.split(",")[0]
        out.append(f"{key}{sep}{value}" if sep else arg)
    return out


def _not_run(command: str) -> str | None:
    return next((why for start, why in NOT_RUN.items() if command.startswith(start)), None)


def _reads_a_file(args: list[str]) -> bool:
    return any(a in ("--ckpt", "--teacher") for a in args)


CFG_JOB = [(where, cmd) for where, cmd in doc_examples()
           if cmd.split()[1] in HYDRA_COMMANDS and not _reads_a_file(shlex.split(cmd)[2:])]


def test_the_docs_have_examples_and_every_not_run_entry_names_one():
    examples = doc_examples()
    assert len(examples) > 40 and len(CFG_JOB) > 15
    for start in NOT_RUN:
        assert any(cmd.startswith(start) for _, cmd in examples), f"NOT_RUN names no example: {start}"


@pytest.mark.parametrize("where, command", CFG_JOB, ids=[w for w, _ in CFG_JOB])
def test_hydra_examples_compose_in_their_cfg_job_form(where, command, capsys):
    from ssogvit.cli import main

    args = first_point(shlex.split(command)[1:])
    if "--help" in args:  # the help itself, as written (Hydra ends it with SystemExit(0))
        with pytest.raises(SystemExit) as stop:
            main(args)
        assert stop.value.code in (0, None) and "usage: ssogvit" in capsys.readouterr().out, where
        return
    code = main([*args, "--cfg", "job"])
    out, err = capsys.readouterr()
    assert code == 0, f"{where}: `{command}` as `{' '.join(args)} --cfg job`: {err}"
    assert out.startswith("name:") or "\nname:" in out


@pytest.mark.parametrize("fragment", help_fragments())
def test_train_help_examples_compose(fragment, capsys):
    from ssogvit.cli import main

    code = main(["train", fragment, "--cfg", "job"])
    assert code == 0, f"`ssogvit train {fragment}` (from ssogvit train --help): {capsys.readouterr().err}"


def test_train_help_no_longer_advertises_what_fails():
    fragments = help_fragments()
    assert "logger=[]" in fragments and "progress.mode=lines" in fragments
    assert not any(f in ("logger=none", "progress=lines") for f in fragments)


def test_list_examples_run(capsys):
    from ssogvit.cli import main

    for where, command in doc_examples():
        if command.split()[1] == "list":
            assert main(shlex.split(command)[1:]) == 0, where
    assert "digits8_vit_ssog" in capsys.readouterr().out


SLOW = [(where, cmd) for where, cmd in doc_examples()
        if (where, cmd) not in CFG_JOB and cmd.split()[1] != "list" and not _not_run(cmd)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with a short digits run at `runs/x` (and at the other run paths the examples name)."""
    import shutil

    root = tmp_path_factory.mktemp("examples")
    done = cli_process.run(["train", "experiment=digits8_vit_ssog", "trainer.max_epochs=1",
                            "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "output_dir=runs/x",
                            "progress.mode=none"], cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("digits_vit_mha", "name", "cifar100_ode_base_ssog", "cifar100_ode_base_steer_mu"):
        shutil.copytree(root / "runs/x", root / "runs" / name)
    return root


def _runnable(command: str) -> list[str]:
    args = shlex.split(command.replace("<name>", "name").replace("runs/main/<date-time>", "runs/x"))[1:]
    if args[0] == "report":  # the fixture's runs are copies of one run: report refuses them as seeds of one model
        args = [a.replace("runs/*", "runs/x") for a in args]
    if args[0] == "eval" and "--img-size" in args:  # the fixture's model sees 8 px digits through patch 1
        args[args.index("--img-size") + 1] = "16"
    if args[0] == "main":
        args += ["--epochs", "1", "--seeds", "0", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
    if args[0] in HYDRA_COMMANDS and "--print-config" not in args:
        args = [*first_point(args), "--cfg", "job"]
    return args


@pytest.mark.slow
@pytest.mark.parametrize("where, command", SLOW, ids=[w for w, _ in SLOW])
def test_the_other_examples_run_as_written(where, command, workdir):
    args = _runnable(command)
    res = cli_process.run(args, cwd=workdir, timeout=600)
    assert res.returncode == 0, f"{where}: `{command}` ran as `ssogvit {' '.join(args)}`:\n{res.stderr[-2000:]}"
