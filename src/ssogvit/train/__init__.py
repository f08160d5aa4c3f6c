"""Training pipeline: Lightning module, Hydra configs, checkpoints (`io.load_model`), the main job and the CLI."""

from .errors import CheckpointError, ConfigError, NonFiniteError, RunFolderError, TrainError
from .io import build_model, count_parameters, export_safetensors, load_model, read_model_config, read_state_dict
from .losses import jasmin_penalty, softmax_jacobian_estimate, topk_correct

__all__ = [
    "CheckpointError", "ConfigError", "NonFiniteError", "RunFolderError", "TrainError", "ClassificationModule",
    "build_model", "count_parameters", "export_safetensors", "jasmin_penalty", "load_model", "read_model_config",
    "read_state_dict", "softmax_jacobian_estimate", "topk_correct",
    "compose", "train",
]


def __getattr__(name: str):
    # Lightning and Hydra load with what needs them: checkpoints and exports (``io``) are read without them
    if name == "ClassificationModule":
        from .module import ClassificationModule

        return ClassificationModule
    if name == "compose":
        from .config import compose

        return compose
    if name == "train":
        from .run import train

        return train
    raise AttributeError(name)
