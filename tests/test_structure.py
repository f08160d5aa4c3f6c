"""What is SSoG-specific lives in ``SSoGAttention`` and the rest asks it; one model constructor; one reading of
``KEY=VALUE``; no import cycles (docs/models.md)."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import timm
import torch

import ssogvit
from ssogvit import ops
from ssogvit.cli import main as ssogvit_main
from ssogvit.layers import Attention, SSoGAttention, is_ssog
from ssogvit.models import FAMILIES, LoopedViT, ODEViT, VisionTransformer, create_model, model_options
from ssogvit.timm_compat import ssogify
from ssogvit.train.config import split_override

TINY = {"img_size": 32, "patch_size": 8, "depth": 2, "num_classes": 3, "embed_dim": 24, "num_heads": 3}


def _mixer(**kw) -> SSoGAttention:
    torch.manual_seed(0)
    m = SSoGAttention(12, 3, num_atoms=2, **kw).double()
    with torch.no_grad():
        m.rho.uniform_(0.0, 3.0)  # widths >= 0.94: halved, still above the floor 0.25
    return m


# -- SSoGAttention owns the field's transfer and its weight-decay names ----------------------------------------------


def test_rescale_field_scales_centres_and_widths_per_axis_and_the_radius_by_the_geometric_mean():
    m = _mixer(steer="all", radius=3.0)
    mu, sigma = m.mu.detach().clone(), m.sigma().detach().clone()
    m.rescale_field(2.0, 0.5)
    factor = torch.tensor([2.0, 0.5], dtype=torch.float64)
    torch.testing.assert_close(m.mu.detach(), mu * factor, rtol=0, atol=0)
    torch.testing.assert_close(m.sigma().detach(), sigma * factor, rtol=1e-12, atol=1e-12)
    assert m.radius == pytest.approx(3.0 * math.sqrt(2.0 * 0.5), rel=1e-15)


def test_rescale_field_clamps_a_width_below_the_floor_just_above_it_and_refuses_non_positive_ratios():
    m = _mixer()
    m.rescale_field(1e-3, 1e-3)
    floor = m.sigma_min + m.eps_sigma
    sigma = m.sigma().detach()
    assert torch.isfinite(m.rho).all() and (sigma > floor).all() and (sigma < floor + 1e-6).all()
    for bad in ((0.0, 1.0), (1.0, -2.0), (float("nan"), 1.0), (float("inf"), 1.0), (True, 1.0), ("2", 1.0)):
        with pytest.raises(ValueError, match=r"factor_[yx]=.*: expected a number > 0"):  # the fifth audit's E144-E145
            m.rescale_field(*bad)


@pytest.mark.parametrize("name", ["vit-tiny-ssog", "vit-tiny-ssog-steered"])
def test_a_rescale_that_would_overflow_the_field_is_refused_and_changes_nothing(name):
    """The fifth audit's E141-E142: 1e39 is a finite float that float32 centres cannot hold; the new field is checked
    in every mixer before any changes, so a refusal leaves the model (weights and recorded radius) as it was."""
    from ssogvit.models import create_model

    model = create_model(name, img_size=16, patch_size=4, depth=2)
    with torch.no_grad():
        for m in model.mixers():
            m.mu.normal_()
    before, config = {k: v.clone() for k, v in model.state_dict().items()}, dict(model.config)
    for bad in ((1e39, 1.0), (1e300, 1e300)):
        with pytest.raises(ValueError, match="leave the field non-finite in torch.float32"):
            model.rescale_field(*bad)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and model.config == config


def test_rho_for_is_the_inverse_of_the_width_formula_in_float64():
    m = _mixer()
    rho = torch.linspace(-15.0, 30.0, 181, dtype=torch.float64)
    torch.testing.assert_close(m.rho_for(ops.field_sigma(rho, m.sigma_min, m.eps_sigma)), rho, rtol=1e-9, atol=1e-9)


def test_no_weight_decay_names_the_field_and_the_gates_of_the_enabled_paths():
    fixed, steered = _mixer(), _mixer(steer=("mu", "lambda"))
    assert fixed.no_weight_decay() == {"mu", "rho", "ell", "theta"}
    assert steered.no_weight_decay() == {"mu", "rho", "ell", "theta", "alpha_mu", "alpha_lambda"}
    assert steered.no_weight_decay() <= dict(steered.named_parameters()).keys()


def test_field_parameters_are_all_but_the_value_and_output_projections():
    fixed, steered = _mixer(), _mixer(steer=("mu",))
    assert list(fixed.field_parameters()) == ["mu", "rho", "ell", "theta"]
    assert set(steered.field_parameters()) == {"mu", "rho", "ell", "theta", "alpha_mu", "mu_steer.weight",
                                               "mu_steer.bias"}
    assert all(p is dict(steered.named_parameters())[n] for n, p in steered.field_parameters().items())


def test_the_model_excludes_exactly_what_its_mixers_name_plus_tokens_and_one_dimensional_parameters():
    model = create_model("looped-tiny-ssog-steered", **TINY, num_registers=1)
    names = dict(model.named_parameters())
    field = {f"blocks.0.attn.{n}" for n in model.mixers()[0].no_weight_decay()}
    expected = {n for n, p in names.items() if p.ndim <= 1} | {"pos_embed", "cls_token", "reg_token"} | field
    assert model.no_weight_decay() == expected
    assert "blocks.0.attn.mu" in expected and "blocks.0.attn.ell" in expected  # 3-D and 2-D, named by the mixer


def test_is_ssog_is_the_class_not_the_attribute_names():
    timm_vit = ssogify(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                         num_classes=3, dynamic_img_size=True))
    assert is_ssog(SSoGAttention(12, 3)) and all(is_ssog(b.attn) for b in timm_vit.blocks)
    assert not is_ssog(Attention(12, 3))
    assert not is_ssog(timm.layers.Attention(12, 3))
    impostor = torch.nn.Module()
    impostor.mu, impostor.rho, impostor.ell = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    impostor.mixture = lambda: None
    assert not is_ssog(impostor)


# -- the model asks its mixers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_rescale_field_rescales_every_ssog_mixer_and_records_the_radius(family):
    model = create_model(f"{family}-tiny-ssog-steered", **TINY, radius=2.0).double()
    before = [(m.mu.detach().clone(), m.sigma().detach().clone()) for m in model.mixers()]
    model.rescale_field(2.0, 2.0)
    for m, (mu, sigma) in zip(model.mixers(), before):
        torch.testing.assert_close(m.mu.detach(), 2 * mu, rtol=0, atol=0)
        torch.testing.assert_close(m.sigma().detach(), 2 * sigma, rtol=1e-12, atol=1e-12)
        assert m.radius == 4.0
    assert model.config["radius"] == 4.0
    twin = create_model(**model.config)
    assert all(m.radius == 4.0 for m in twin.mixers())


def test_model_rescale_field_leaves_attention_models_and_the_fixed_field_config_alone():
    mha = create_model("vit-tiny-mha", **TINY)
    state, config = {k: v.clone() for k, v in mha.state_dict().items()}, dict(mha.config)
    mha.rescale_field(2.0, 2.0)
    assert mha.config == config and all(torch.equal(v, state[k]) for k, v in mha.state_dict().items())
    fixed = create_model("vit-tiny-ssog", **TINY)
    fixed.rescale_field(2.0, 2.0)
    assert "radius" not in fixed.config  # the radius only matters to steering


# -- one constructor --------------------------------------------------------------------------------------------------


def test_the_families_share_the_base_constructor_and_add_only_their_own_options():
    for cls in (VisionTransformer, LoopedViT, ODEViT):
        assert "__init__" not in vars(cls), cls
    shared = model_options("looped")
    assert model_options("vit") == [*shared, "global_blocks"]
    assert model_options("ode") == [*shared, "solver", "scale", "norm", "rtol", "atol", "adjoint"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'solver'"):
        VisionTransformer(**TINY, solver="rk4")
    with pytest.raises(ValueError, match="unknown norm 'batchnorm'"):
        ODEViT(**TINY, norm="batchnorm")


def test_a_model_built_directly_has_one_config_that_rebuilds_it():
    model = ODEViT(**TINY, mixer="ssog", mixer_options={"num_atoms": 3}, norm="CenterNorm", solver="rk4")
    assert model.config["norm"] == "centernorm" and model.config["num_atoms"] == 3
    assert list(model.config)[:2] == ["name", "embed_dim"] and list(model.config)[-1] == "num_atoms"
    assert (model.solver, model.scale, model.norm_name) == ("rk4", 2.0, "centernorm")
    twin = create_model(**model.config)
    assert type(twin) is ODEViT and twin.config == model.config
    assert list(twin.state_dict()) == list(model.state_dict())
    model.prune_intermediate_layers([0])  # the first of 2 steps: t in [0, 1/2], the same flow at half the scale
    assert model.scale == model.config["scale"] == 1.0 and model.blocks.total == 1


# -- one reading of KEY=VALUE -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("data.root=/x", ("data.root", "/x")),
    ("+data.root=/x", ("data.root", "/x")),
    ("++trainer.max_epochs=3", ("trainer.max_epochs", "3")),
    ("~ema", ("ema", None)),
    ("resume=/runs/a/step=0000100.ckpt", ("resume", "/runs/a/step=0000100.ckpt")),
    ("depth=", ("depth", "")),
])
def test_split_override(text, expected):
    assert split_override(text) == expected


def test_analyze_refuses_a_model_option_without_a_value(tmp_path, capsys):
    rc = ssogvit_main(["analyze", "atoms", "--model", "vit-tiny-ssog", "--model-kw", "depth", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "--model-kw 'depth' is not KEY=VALUE" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


# -- no import cycles -------------------------------------------------------------------------------------------------


def _import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the ``ssogvit`` modules it imports, at module level or inside functions, packages included.

    ``from P import name`` is an edge to ``P.name`` when that is a module, else to ``P`` (a package's ``__init__``,
    whose own imports are edges too); ``import P.Q`` is an edge to ``P.Q``. The parents a submodule import runs first
    (``ssogvit/__init__`` for ``ssogvit.ops``) are not edges: Python runs them whatever the importer, and they take
    no name from a module that is still loading.
    """
    def name(path: Path) -> str:
        parts = path.relative_to(root.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                submodules = {f"{target}.{a.name}" for a in node.names} & modules.keys()
                targets |= submodules
                if len(submodules) < len(node.names) and target in modules:  # a name the module itself defines
                    targets.add(target)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in modules}
        graph[mod] = targets - {mod}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is a set of modules that import one
    another round a circle; sorted names, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(mod: str) -> None:
        index[mod] = low[mod] = len(index)
        stack.append(mod)
        for t in graph.get(mod, ()):
            if t not in index:
                visit(t)
                low[mod] = min(low[mod], low[t])
            elif t in stack:
                low[mod] = min(low[mod], index[t])
        if low[mod] == index[mod]:
            component = []
            while True:
                t = stack.pop()
                component.append(t)
                if t == mod:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for mod in sorted(graph):
        if mod not in index:
            visit(mod)
    return sorted(found, key=len, reverse=True)


def test_no_module_imports_one_that_imports_it_back():
    graph = _import_graph(Path(ssogvit.__file__).parent)
    circles = _circles(graph)
    assert not circles, f"{len(circles)} circle(s):\n" + "\n".join(f"{len(c)} modules: {' '.join(c)}" for c in circles)
    # the graph is real: it holds a function-level import, an import of a package's name, a package's own imports
    assert "ssogvit.train.io" in graph["ssogvit.train.module"] and "ssogvit.analysis.atoms" in graph[
        "ssogvit.analysis.fields"]
    assert "ssogvit.models" in graph["ssogvit.train.io"] and "ssogvit.layers.ssog" in graph["ssogvit.layers"]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: the bottom floor (docs/DEVELOPING.md, "Package layout"): what every other module stands on. These import nothing
#: of ssogvit but each other, and of the rest only the standard library, torch, numpy and PyYAML.
FLOOR = ("ssogvit.errors", "ssogvit.specs", "ssogvit.documents", "ssogvit.resources", "ssogvit.outputs",
         "ssogvit.inputs", "ssogvit.core", "ssogvit.extras")
FLOOR_DEPENDENCIES = {"torch", "numpy", "yaml"}


def test_the_bottom_floor_imports_nothing_above_it():
    import sys

    root = Path(ssogvit.__file__).parent
    graph = _import_graph(root)
    assert set(FLOOR) <= graph.keys()
    upward = {mod: sorted(graph[mod] - set(FLOOR)) for mod in FLOOR if graph[mod] - set(FLOOR)}
    assert not upward, upward
    foreign = {}
    for mod in FLOOR:
        tree = ast.parse((root.parent / (mod.replace(".", "/") + ".py")).read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        tops = {n.split(".")[0] for n in names} - {"ssogvit", "__future__"} - FLOOR_DEPENDENCIES
        if tops - set(sys.stdlib_module_names):
            foreign[mod] = sorted(tops - set(sys.stdlib_module_names))
    assert not foreign, foreign


def test_every_error_of_a_users_mistake_is_a_user_error_and_the_reporter_catches_that_one_class():
    from ssogvit.data import DataConfigError, DataError
    from ssogvit.documents import DocumentError
    from ssogvit.errors import InputError, InputTypeError, UsageError, UserError, user_errors
    from ssogvit.outputs import OutputError, OutputExistsError
    from ssogvit.resources import MemoryLimitError
    from ssogvit.train.errors import CheckpointError, ConfigError, NonFiniteError, RunFolderError, TrainError

    ours = (InputError, InputTypeError, UsageError, DocumentError, MemoryLimitError, OutputError, OutputExistsError,
            TrainError, CheckpointError, ConfigError, NonFiniteError, RunFolderError, DataError, DataConfigError)
    assert [cls.__name__ for cls in ours if not issubclass(cls, UserError)] == []
    assert user_errors()[0] is UserError and not any(issubclass(e, UserError) for e in user_errors()[1:])
    assert issubclass(InputError, ValueError) and issubclass(TrainError, RuntimeError)  # as before the base came


# -- where a module's tests are (docs/DEVELOPING.md) -----------------------------------------------------------------


def _defined_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def module_test_map() -> dict[str, list[str]]:
    """Module of `src/ssogvit` (path relative to it) -> the test files that exercise it by name: those that import
    it (`import ssogvit.a.b`, `from ssogvit.a.b import x`, `from ssogvit.a import b`), import a name it defines
    through its package (`from ssogvit.a import x`, `x` defined at the top of a module under `a/`), or name it as
    `ssogvit.a.b` in their text."""
    root = Path(ssogvit.__file__).parent
    files = {".".join(("ssogvit", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
             for p in sorted(root.rglob("*.py"))}
    defined = {mod: _defined_names(p) for mod, p in files.items()}
    found: dict[str, set[str]] = {mod: set() for mod in files}
    for test in sorted(Path(__file__).parent.glob("test_*.py")):
        text = test.read_text()
        hits = {mod for mod in files if mod != "ssogvit" and re.search(rf"\b{re.escape(mod)}\b(?![.\w])", text)}
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ssogvit"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    owners = [m for m in files if m.startswith(f"{node.module}.") and alias.name in defined[m]]
                    hits |= {sub} if sub in files else set(owners[:1]) or {node.module}
            elif isinstance(node, ast.Import):
                hits |= {a.name for a in node.names if a.name in files}
        for mod in hits & set(found):
            found[mod].add(test.name)
    return {str(p.relative_to(root)): sorted(found[mod]) for mod, p in files.items()}


def module_test_map_markdown() -> str:
    rows = ["| module (`src/ssogvit/`) | test files |", "|---|---|"]
    for module, tests in module_test_map().items():
        shown = ", ".join(f"`{t}`" for t in tests) or "none by name (reached through the modules that use it)"
        rows.append(f"| `{module}` | {shown} |")
    return "\n".join(rows)


def test_the_developer_guide_maps_every_module_to_its_tests_as_they_are():
    text = (Path(__file__).parents[1] / "docs" / "DEVELOPING.md").read_text()
    begin = "<!-- test map: generated by tests/test_structure.py module_test_map_markdown() -->\n"
    shown = text[text.index(begin) + len(begin):text.index("\n<!-- end of the test map -->")]
    assert shown == module_test_map_markdown(), (
        "docs/DEVELOPING.md's test map is out of date: paste the output of `python -c 'import sys; "
        "sys.path.insert(0, \"tests\"); import test_structure as t; print(t.module_test_map_markdown())'`")
