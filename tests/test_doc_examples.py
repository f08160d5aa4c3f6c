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
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

import pytest

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


def doc_examples() -> list[tuple[str, str]]:
    """`(where, command)` for each `ssogvit ...` line of a code block in README.md and docs/*.md; backslash
    continuations joined, a trailing `# comment` and a `.venv/bin/` prefix removed."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
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
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("examples")
    subprocess.run([sys.executable, "-m", "ssogvit", "train", "experiment=digits8_vit_ssog", "trainer.max_epochs=1",
                    "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "output_dir=runs/x",
                    "progress.mode=none"], cwd=root, check=True, capture_output=True, timeout=300)
    for name in ("digits_vit_mha", "name", "cifar100_ode_base_ssog", "cifar100_ode_base_steer_mu"):
        shutil.copytree(root / "runs/x", root / "runs" / name)
    return root


def _runnable(command: str) -> list[str]:
    args = shlex.split(command.replace("<name>", "name").replace("runs/main/<date-time>", "runs/x"))[1:]
    if args[0] == "main":
        args += ["--epochs", "1", "--seeds", "0", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
    if args[0] in HYDRA_COMMANDS and "--print-config" not in args:
        args = [*first_point(args), "--cfg", "job"]
    return args


@pytest.mark.slow
@pytest.mark.parametrize("where, command", SLOW, ids=[w for w, _ in SLOW])
def test_the_other_examples_run_as_written(where, command, workdir):
    import subprocess
    import sys

    args = _runnable(command)
    res = subprocess.run([sys.executable, "-m", "ssogvit", *args], cwd=workdir, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, f"{where}: `{command}` ran as `ssogvit {' '.join(args)}`:\n{res.stderr[-2000:]}"
