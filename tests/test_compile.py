"""``torch.compile`` sees the whole SSoG model: one graph (``fullgraph=True``: no graph break), compiled once per input
shape however many blocks (no recompile), and the same output and gradients as eager (docs/operator.md, "Backends").

The default run checks the mixers and one model per mixer with the ``aot_eager`` backend (Dynamo and AOTAutograd, the
parts that break graphs or recompile, without Inductor's code generation, which takes most of a compile); the
``slow`` ones compile every family and both mixers with Inductor, inference and training step."""

import pytest
import torch
from torch._dynamo.utils import counters

from ssogvit.layers import create_mixer
from ssogvit.models import create_model

MIXERS = ["ssog", "ssog-steered"]


def _compiled(fn, backend: str):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, fullgraph=True, backend=backend)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _outputs_and_grads(fn, x, params):
    x = x.clone().requires_grad_()
    y = fn(x)
    w = torch.linspace(-1, 1, y.numel()).view_as(y)
    return [y.detach(), *torch.autograd.grad((y * w).sum(), [x, *params])]


def _assert_close(got, want, tol):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", MIXERS)
def test_a_mixer_compiles_into_one_graph_and_matches_eager(name):
    m = create_mixer(name, 32, 4, num_atoms=2, **({"gate_init": -1.0} if name == "ssog-steered" else {}))
    fn = lambda x: m(x, grid=(4, 5), num_prefix_tokens=1)  # noqa: E731
    x = torch.randn(2, 1 + 20, 32)
    compiled = _compiled(fn, "aot_eager")
    with torch.no_grad():
        _assert_close([compiled(x)], [fn(x)], 1e-5)
    params = list(m.parameters())
    _assert_close(_outputs_and_grads(compiled, x, params), _outputs_and_grads(fn, x, params), 1e-5)
    with torch.no_grad():
        compiled(torch.randn(2, 1 + 20, 32))  # new values, same shapes: no recompile
    assert _graphs() == 2  # one inference graph, one training graph


def _model_case(family, mixer, backend, train):
    model = create_model(f"{family}-tiny-{mixer}", img_size=32, patch_size=8, depth=3, num_classes=10)
    model.train(train)
    x = torch.randn(2, 3, 32, 32)
    compiled = _compiled(model, backend)
    if train:
        tol = 1e-4
        _assert_close(_outputs_and_grads(compiled, x, list(model.parameters())),
                      _outputs_and_grads(model, x, list(model.parameters())), tol)
    else:
        with torch.no_grad():
            _assert_close([compiled(x)], [model(x)], 1e-5)
            compiled(torch.randn(2, 3, 32, 32))
    assert _graphs() == 1, f"{_graphs()} graphs: a block recompiled or the graph broke"


@pytest.mark.parametrize("mixer", MIXERS)
def test_a_model_compiles_into_one_graph_whatever_its_depth(mixer):
    """Three blocks, one graph, for inference and for a training step (the fixed field's kernel cache is not used
    under compile: it would be a guard, and its key a graph break)."""
    _model_case("vit", mixer, "aot_eager", train=False)
    _model_case("vit", mixer, "aot_eager", train=True)


@pytest.mark.slow
@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("family", ["vit", "looped", "ode"])
def test_every_family_compiles_with_inductor(family, mixer, train):
    _model_case(family, mixer, "inductor", train=train)
