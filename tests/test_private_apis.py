"""No private API of a dependency (issue 31): the package imports no private module of another package (a dotted
component or an imported name that starts with ``_``), but where one module isolates what has no public way and
names the version it was written for."""

from __future__ import annotations

import ast
from pathlib import Path

import hydra

import ssogvit
from ssogvit.train import _hydra_internal

SRC = Path(ssogvit.__file__).parent

#: module (relative to the package) -> the private modules it may import, and why
ISOLATED = {
    # hydra.main's own parser and runner: hydra.main cannot give one-line usage errors (see the module)
    "train/_hydra_internal.py": {"hydra._internal.utils"},
    # timm exports no public home for the index helper its own models use for forward_intermediates
    "models/_common.py": {"timm.models._features"},
}


def _private_imports(path: Path) -> set[str]:
    """The private modules of other packages that ``path`` imports (at any depth of the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [(node.module, [a.name for a in node.names])]
        else:
            continue
        for module, names in modules:
            if module.split(".")[0] in ("ssogvit", "__future__"):
                continue
            if any(part.startswith("_") for part in module.split(".")) or any(n.startswith("_") for n in names):
                found.add(module)
    return found


def test_no_private_module_of_a_dependency_is_imported_outside_its_one_isolating_module():
    used = {str(p.relative_to(SRC)): _private_imports(p) for p in sorted(SRC.rglob("*.py"))}
    used = {k: v for k, v in used.items() if v}
    assert used == ISOLATED, "private APIs of dependencies: " + repr(used)
    assert not any("torchdiffeq" in m for v in used.values() for m in v)  # the ODE family steps with its own table


def test_the_hydra_isolation_runs_on_the_version_it_was_written_for():
    """``train._hydra_internal`` calls Hydra's private ``_run_hydra`` and ``get_args_parser``: on any other
    hydra-core this fails, so that an upgrade re-reads them (and the CLI tests) before bumping ``WRITTEN_FOR``."""
    assert hydra.__version__ == _hydra_internal.WRITTEN_FOR, (
        f"hydra-core {hydra.__version__} is installed but ssogvit.train._hydra_internal was written for "
        f"{_hydra_internal.WRITTEN_FOR}: check that hydra._internal.utils._run_hydra and get_args_parser still take "
        f"the same arguments (hydra/main.py shows how hydra.main calls them), run the CLI tests, then update "
        f"WRITTEN_FOR")
