"""Optional dependencies: what each extra of ``pip install 'ssogvit[...]'`` brings, and the one-line refusal of a
command whose extra is not installed.

The core (``import ssogvit``: the operator, the mixers, the three model families, ``ssogify``, ``ssogvit.export``'s
TorchScript and ``torch.export`` formats) needs torch, timm, torchdiffeq and safetensors only; ``import ssogvit``
imports none of the extras.
"""

from __future__ import annotations

import importlib.util

from ssogvit.errors import UsageError

__all__ = ["EXTRAS", "missing", "require_extra"]

#: extra -> import names of what it installs (pyproject.toml's optional-dependencies; ``all`` is every one)
EXTRAS: dict[str, tuple[str, ...]] = {
    "train": ("lightning", "hydra", "omegaconf", "hydra_plugins.hydra_submitit_launcher",
              "hydra_plugins.hydra_joblib_launcher", "tensorboard", "sklearn", "matplotlib", "tqdm", "numpy"),
    "analysis": (),  # ssogvit[train] (below)
    "bench": ("matplotlib",),
    "export": ("onnx", "onnxruntime", "onnxscript"),
    "hub": ("huggingface_hub",),
    "dense": ("segmentation_models_pytorch",),  # smp's decoders on ssogvit's pyramid (docs/dense.md); no command
}
EXTRAS["analysis"] = EXTRAS["train"]


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package that is not installed
        return False


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [name for name in EXTRAS[extra] if not _installed(name)]


def require_extra(extra: str, what: str) -> None:
    """Raise a ``UsageError`` naming the extra to install when ``extra`` is missing; ``what`` (``"this command"``,
    ``"--format onnx"``) is what needs it."""
    gone = missing(extra)
    if gone:
        raise UsageError(f"{what} needs the '{extra}' extra ({', '.join(gone)} not installed): "
                         f"pip install 'ssogvit[{extra}]'")
