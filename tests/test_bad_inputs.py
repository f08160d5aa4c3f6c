"""Every bad input of the catalogue (scripts/bad_inputs_catalogue.py, run by scripts/bad_inputs.py) through the real
entry points, crossing every command and public constructor with the classes of bad input (missing, existing,
read-only, a file where a folder belongs, wrong type, out of range, unknown, huge, malicious, truncated, bit-flipped,
ignored): each must be refused in one line naming the argument, exit status 2, nothing written, nothing changed.

The commands run in this process through `ssogvit.cli.main(argv)`, the console script's own entry function, in a
fresh working folder each; a sample (one case of every command) also in a child process, and the whole catalogue
in child processes under `-m slow`.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bad_inputs as runner  # noqa: E402
from bad_inputs_catalogue import CASES, Case  # noqa: E402

def _params(cases: list[Case]) -> list:
    return [pytest.param(c, id=f"{c.surface}-{c.kind}-{i}") for i, c in enumerate(cases)]


def _sample() -> list[Case]:
    """One command-line case of every command that no child-process case reaches already (every class of bad input
    goes through the same entry function in this process)."""
    reached = {c.argv[0] for c in CASES if c.subprocess and c.argv is not None}
    first = {}
    for c in CASES:
        if c.argv is not None and not c.subprocess and c.argv[0] not in reached:
            first.setdefault(c.argv[0], c)
    return list(first.values())


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory, worker_id):
    """Built once for the whole session and shared by the xdist workers (the first one builds them); each worker has
    its own read-only folder, working folders and pristine copy to restore from."""
    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    root, done = shared / "bad_inputs_fixtures", shared / "bad_inputs_fixtures.json"
    with FileLock(str(shared / "bad_inputs_fixtures.lock")):
        if not done.is_file():
            root.mkdir(exist_ok=True)
            done.write_text(json.dumps(runner.build_fixtures(root, read_only=False)))
    base = tmp_path_factory.mktemp("bad_inputs")
    work, pristine = base / "work", base / "pristine"
    work.mkdir()
    shutil.copytree(root, pristine, ignore=shutil.ignore_patterns("fat_saved"))  # 20 GB sparse: never read
    yield json.loads(done.read_text()), root, work, pristine


def _check(case: Case, fixtures, read_only_folder, *, child: bool) -> None:
    paths, root, work, pristine = fixtures
    ro = Path(tempfile.mkdtemp(dir=work)) / "ro"
    if "{ro}" in " ".join(case.argv or (case.code,)):
        with read_only_folder(ro):  # read-only only while the case runs
            result = runner.run_case(case, {**paths, "ro": str(ro)}, work, child=child, timeout=120)
    else:
        result = runner.run_case(case, {**paths, "ro": str(ro)}, work, child=child, timeout=120)
    if result.verdict == "lost":
        runner.restore(root, pristine)
    assert result.verdict == "clear", f"{result.verdict}: {result.detail}"


@pytest.mark.parametrize("case", _params([c for c in CASES if not c.subprocess]))
def test_bad_input_is_refused_clearly(case, fixtures, read_only_folder):
    _check(case, fixtures, read_only_folder, child=False)


@pytest.mark.parametrize("case", _params([c for c in CASES if c.subprocess] + _sample()))
def test_bad_input_is_refused_clearly_in_a_child_process(case, fixtures, read_only_folder):
    _check(case, fixtures, read_only_folder, child=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", _params([c for c in CASES if c.argv is not None]))
def test_every_command_case_is_refused_clearly_in_a_child_process(case, fixtures, read_only_folder):
    _check(case, fixtures, read_only_folder, child=True)


def test_the_catalogue_covers_every_command_constructor_and_class_of_bad_input():
    from bad_inputs_catalogue import KINDS

    from ssogvit.cli import COMMANDS

    commands = {c.argv[0] for c in CASES if c.argv is not None}
    assert commands == set(COMMANDS), set(COMMANDS) ^ commands
    surfaces = {c.surface for c in CASES}
    for api in ("create_model", "create_mixer", "SSoGAttention", "Attention", "mixer call", "ssogify",
                "from_pretrained", "timm local-dir", "load_model", "datamodules", "ode family"):
        assert api in surfaces, api
    assert {c.kind for c in CASES} == set(KINDS) and len(CASES) >= 300
    assert len({c.name for c in CASES}) == len(CASES)  # no case twice
