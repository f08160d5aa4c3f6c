"""The run config's settings, declared once: one dataclass per section, each field with its default, its check (a
`Spec` of `ssogvit.specs`, the same declarations the commands and constructors use) and a line of help.

How the declaration is used (docs/training.md, "The run config"):

- Hydra composes every run config on top of it: `RUN_DEFAULTS`, the defaults of `RunSettings`, is registered in
  Hydra's ConfigStore and is the first entry of `conf/config.yaml`'s defaults list; the YAML recipes (`data/`,
  `model/`, `experiment/`) then set what they change. A key that is not declared cannot be overridden (Hydra's
  "Could not override 'optim.lrr'").
- `check_values` checks each value of a composed config by its field's spec, before a launch writes anything, and
  refuses an added key (`+optim.momentum=0.9`) in a section that the training code reads field by field.
- The training code reads typed sections (`OptimSettings`, `SchedSettings`, ...) built by `settings_of`: a key left out
  of a partial mapping takes its declared default, so no default is written twice.

The defaults are registered as plain values, not as an OmegaConf structured config: a wrong value is then refused by
its spec in one line naming the key, the value and what was expected (`trainer.max_epochs='abc': expected an integer
>= 1 or -1`), and the composed config keeps the YAML's own values (an int stays an int).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ssogvit.errors import InputError
from ssogvit.specs import (
    BATCH_SIZE,
    IMG_SIZE,
    NUM_WORKERS,
    SEED,
    AppliesOnly,
    Choice,
    Flag,
    Float,
    Int,
    Items,
    Spec,
    check_applies,
)

__all__ = [
    "RunSettings", "TrainerSettings", "ProgressSettings", "ClusterSettings", "OptimSettings", "SchedSettings",
    "JasminSettings", "LossSettings", "MixupSettings", "EmaSettings", "CkptSettings", "ExportSettings",
    "TransferSettings", "DataSettings", "RUN_DEFAULTS_NAME", "run_defaults", "register_run_defaults", "rules",
    "check_values", "settings_of", "settings_table", "settings_markdown",
]

#: the name of the registered defaults in Hydra's ConfigStore (the first entry of conf/config.yaml's defaults list)
RUN_DEFAULTS_NAME = "run_defaults"


def setting(default: Any, spec: Spec | None = None, doc: str = "", *, applies: AppliesOnly | None = None) -> Any:
    """A field of a settings class: its default, its check (`None`: any value), its help line and (`applies`) the
    settings of the others it needs: given off its default where they leave it unused, it is refused
    (`check_values`), never recorded and ignored. `applies.when` takes `v(dotted key)`, as `CONSTRAINTS` do."""
    metadata = {"spec": spec, "doc": doc, "applies": applies}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _default(f: dataclasses.Field) -> Any:
    """A setting's declared default (`dataclasses.MISSING` where the data group gives it)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def section(cls: type, doc: str) -> Any:
    """A field holding a nested section (`loss.jasmin`)."""
    return field(default_factory=cls, metadata={"section": cls, "doc": doc})


def _required(spec: Spec | None = None, doc: str = "") -> Any:
    """A field without a default: the YAML group that provides the section gives it (`data/<name>.yaml`)."""
    return field(default=dataclasses.MISSING, metadata={"spec": spec, "doc": doc})


# best.ckpt keeps the highest value, so only accuracies can be monitored
MONITORS = ("val/top1", "val/top3", "val/top5", "val_ema/top1", "val_ema/top3", "val_ema/top5",
            "val/miou", "val/pixel_acc", "val_ema/miou", "val_ema/pixel_acc")


@dataclass
class TrainerSettings:
    """`trainer`: arguments of Lightning's `Trainer`. Open: an added key (`+trainer.val_check_interval=11`) goes to the
    `Trainer` as it is."""

    OPEN = True
    max_epochs: int = setting(300, Int(1, also=(-1,)), "-1: by max_steps")
    max_steps: int = setting(-1, Int(1, also=(-1,)), "-1: by max_epochs")
    accelerator: str = setting("auto", doc="cpu, gpu, auto")
    devices: Any = setting("auto", doc="e.g. 1, 8, auto")
    num_nodes: int = setting(1, Int(1, 100_000))
    strategy: str = setting("auto", doc="ddp for several GPUs / nodes (torchrun and SLURM are detected by Lightning)")
    precision: Any = setting("auto", doc="auto: 16-mixed on CUDA, 32-true elsewhere")
    deterministic: bool = setting(True, Flag())
    gradient_clip_val: float | None = setting(1.0, Float(0, none=True))
    accumulate_grad_batches: int = setting(1, Int(1))
    log_every_n_steps: int = setting(20, Int(1))
    check_val_every_n_epoch: int = setting(1, Int(1))
    limit_train_batches: Any = setting(None, doc="a count or a fraction of the training batches per epoch")
    limit_val_batches: Any = setting(None, doc="a count or a fraction of the validation batches")
    enable_progress_bar: bool = setting(True, Flag(), "false: no progress output at all (as progress.mode=none)")
    logger: bool = setting(True, doc="false: no logger at all, whatever `logger` selects")
    benchmark: bool | None = setting(None, doc="cudnn.benchmark; null: Lightning's choice")


@dataclass
class ProgressSettings:
    """`progress`: what a run prints while it trains (and `ssogvit eval`, `bench` while they work)."""

    mode: str = setting("auto", doc="auto: Lightning's bar on a terminal, else lines; bar; lines (never a \\r frame); "
                                    "none")
    every_n_steps: int = setting(0, Int(0), "lines: also one line every N training steps (0: one line per epoch)",
                                 applies=AppliesOnly(lambda v: v("progress.mode") in ("auto", "lines"),
                                                     "progress.mode=lines (or auto, lines where stdout is no terminal)"))


@dataclass
class ClusterSettings:
    """`cluster`: what each job of `-m hydra/launcher=submitit_slurm` asks SLURM for (conf/hydra/launcher)."""

    OPEN = True
    gpus_per_node: int = setting(8, doc="one task (DDP process) per GPU; nodes come from trainer.num_nodes")
    timeout_min: int = setting(4320)
    cpus_per_task: int = setting(10)
    mem_gb: int | None = setting(None)
    partition: str | None = setting(None)
    account: str | None = setting(None)
    qos: str | None = setting(None)
    constraint: str | None = setting(None)


#: timm optimizers without Adam-type moments (no betas, no eps in the denominator)
PLAIN_OPTIMIZERS = ("sgd", "momentum", "nesterov", "sgdp", "sgdw", "rmsprop", "rmsproptf", "adagrad", "adadelta",
                    "lars", "larc", "nlars", "nlarc")
_MOMENTS = AppliesOnly(lambda v: str(v("optim.opt")).lower().split("_")[-1] not in PLAIN_OPTIMIZERS,
                       "an Adam-type optimizer (optim.opt=adamw, adam, lamb, ...; not sgd, rmsprop, adagrad, ...)")


@dataclass
class OptimSettings:
    """`optim`: the optimizer (`timm.optim.create_optimizer_v2`)."""

    opt: str = setting("adamw", doc="a timm optimizer name (adamw, sgd, lamb, ...)")
    lr: float = setting(5.0e-4, Float(0, low_open=True),
                        "at a global batch of lr_base_batch; scaled linearly with the real global batch")
    lr_base_batch: float | None = setting(512, Float(0, low_open=True, none=True), "null: lr is not scaled")
    weight_decay: float = setting(0.05, Float(0), "not applied to the model's no_weight_decay() set, norms and biases")
    betas: list[float] = setting([0.9, 0.999], Items(Float(0, 1, high_open=True), min_len=2, max_len=2),
                                 "Adam-type optimizers' moment decays", applies=_MOMENTS)
    eps: float = setting(1.0e-8, Float(0), "Adam-type optimizers' denominator term", applies=_MOMENTS)


@dataclass
class SchedSettings:
    """`sched`: timm's `CosineLRScheduler`, stepped every optimizer update."""

    warmup_epochs: float = setting(5, Float(0), "linear warm-up from warmup_lr")
    warmup_lr: float = setting(1.0e-6, Float(0))
    min_lr: float = setting(1.0e-5, Float(0))


@dataclass
class JasminSettings:
    """`loss.jasmin`: the attention regulariser of the ODE-ViT baseline (docs/training.md, "JaSMin")."""

    weight: float = setting(0.0, Float(0), "0: off; ODE-ViT trains with 1")
    kind: str = setting("jasmin", doc="jasmin: ODE-ViT's loss; softmax-jacobian: mean/max of max_k g_k")
    k: int = setting(10, doc="jasmin: 0 for Eq. 8 (log g_1), k >= 2 for Eq. 9 (log g_1/g_k); ODE-ViT trains with 10")
    maps: str = setting("last", doc="last: the last attention map of the forward (ODE-ViT); all: mean over every map")
    reduce: str = setting("mean", Choice(("mean", "max")),
                          "softmax-jacobian only: mean over rows, heads, maps, images; max: worst row per image",
                          applies=AppliesOnly(lambda v: v("loss.jasmin.kind") == "softmax-jacobian",
                                              "loss.jasmin.kind=softmax-jacobian"))


@dataclass
class LossSettings:
    """`loss`: the classification loss."""

    smoothing: float = setting(0.1, Float(0, 1, high_open=True),
                               "label smoothing when mixup/cutmix are off (with them it goes into the soft targets)")
    jasmin: JasminSettings = section(JasminSettings, "the attention regulariser of the ODE-ViT baseline")


_MIXING = AppliesOnly(lambda v: v("mixup.mixup_alpha") > 0 or v("mixup.cutmix_alpha") > 0,
                      "mixup or cutmix on (mixup.mixup_alpha > 0 or mixup.cutmix_alpha > 0)")


@dataclass
class MixupSettings:
    """`mixup`: timm's `Mixup` / CutMix (DeiT: 0.8 / 1.0); both alphas 0 switch it off."""

    mixup_alpha: float = setting(0.8, Float(0))
    cutmix_alpha: float = setting(1.0, Float(0))
    prob: float = setting(1.0, Float(0, 1), applies=_MIXING)
    switch_prob: float = setting(0.5, Float(0, 1), "the chance of CutMix where both are on",
                                 applies=AppliesOnly(lambda v: v("mixup.mixup_alpha") > 0 and v("mixup.cutmix_alpha") > 0,
                                                     "mixup.mixup_alpha > 0 and mixup.cutmix_alpha > 0"))
    mode: str = setting("batch", Choice(("batch", "pair", "elem")), "timm's: one draw per batch, pair or image",
                        applies=_MIXING)


@dataclass
class EmaSettings:
    """`ema`: timm's `ModelEmaV3`, validated and exported beside the raw weights."""

    enabled: bool = setting(False, Flag())
    decay: float = setting(0.99996, Float(0, 1))


@dataclass
class CkptSettings:
    """`ckpt`: checkpoints (last.ckpt is saved at each epoch end whatever these say)."""

    every_n_train_steps: int | None = setting(500, Int(1, none=True),
                                              "mid-epoch snapshots step=*.ckpt (not resumable); null: none")
    keep: int = setting(2, Int(0), "most recent periodic checkpoints kept besides last.ckpt and best.ckpt")
    monitor: str = setting("val/top1", Choice(MONITORS), "what best.ckpt keeps the highest of (an accuracy)")


@dataclass
class ExportSettings:
    """`export`: the final weights under `<output_dir>/export`."""

    safetensors: bool = setting(True, Flag())


@dataclass
class TransferSettings:
    """`transfer`: set by `ssogvit transfer`: start from a checkpoint, new head."""

    ckpt: str | None = setting(None, doc="the source checkpoint or export; null: train from scratch")
    mode: str = setting("finetune", Choice(("finetune", "linear")),
                        "finetune: train everything; linear: freeze all but the head (linear probe)")
    use_ema: bool = setting(False, Flag(), "take the source's EMA weights")


def _transfer_without_source(v: Callable[[str], Any]) -> bool:
    """Whether a `transfer` option other than `ckpt` is set off its default while `transfer.ckpt` is not: an option
    of a source's weights with no source would be recorded but not obeyed."""
    return not v("transfer.ckpt") and any(v(f"transfer.{f.name}") not in (None, f.default)
                                          for f in fields(TransferSettings) if f.name != "ckpt")


@dataclass
class DataSettings:
    """`data`: the keys every dataset's YAML (`conf/data/<name>.yaml`) gives; the rest of `data` are the options of
    its datamodule (`ssogvit.data.create_datamodule`), checked there. No defaults here: the data group gives them."""

    OPEN = True
    name: str = _required(doc="the dataset: digits, cifar100, imagefolder, synthetic, digit_scenes, segfolder")
    img_size: int = _required(IMG_SIZE, "side of the (square) training images in pixels")
    batch_size: int = _required(BATCH_SIZE, "per device")
    eval_batch_size: int | None = _required(Int(1, 1 << 20, none=True))
    num_workers: int = _required(NUM_WORKERS)
    num_classes: int | None = _required(Int(0, 1_000_000, none=True), "null: the classes the data have (imagefolder)")
    in_chans: int | None = _required(Int(1, 1024, none=True))


@dataclass
class RunSettings:
    """The run config (`ssogvit train`), less the YAML groups (`model`, `data`, `logger`, `callbacks`)."""

    OPEN = True  # the groups, and a command's own section (`convert`)
    name: str = setting("${model.name}_${data.name}", doc="run name; experiments set it to their file name")
    output_dir: str = setting("runs/${name}",
                              doc="checkpoints/, logs/ (CSV), tb/ (TensorBoard), export/, config.yaml")
    seed: int = setting(42, SEED)
    resume: str | None = setting("auto", doc="auto: continue the unfinished run of this config in output_dir; extend: "
                                             "train the finished run there on to a larger trainer.max_epochs; new: a "
                                             "new try in the next free folder (output_dir-2, -3, ...); null: "
                                             "fresh; or a path (a folder holding a finished or different run is "
                                             "refused)")
    meta: dict[str, Any] = setting({"paper": None, "description": None},
                                   doc="what the run reproduces (shown by `ssogvit list`)")
    trainer: TrainerSettings = section(TrainerSettings, "Lightning's Trainer")
    progress: ProgressSettings = section(ProgressSettings, "what a run prints")
    cluster: ClusterSettings = section(ClusterSettings, "SLURM jobs")
    optim: OptimSettings = section(OptimSettings, "the optimizer")
    sched: SchedSettings = section(SchedSettings, "the learning-rate schedule")
    loss: LossSettings = section(LossSettings, "the loss")
    mixup: MixupSettings = section(MixupSettings, "mixup / cutmix")
    ema: EmaSettings = section(EmaSettings, "EMA of the weights")
    ckpt: CkptSettings = section(CkptSettings, "checkpoints")
    export: ExportSettings = section(ExportSettings, "the export")
    transfer: TransferSettings = section(TransferSettings, "transfer learning")


def run_defaults() -> dict[str, Any]:
    """The declared defaults of the run config, as the plain nested dict Hydra composes the YAML onto."""
    return dataclasses.asdict(RunSettings())


def register_run_defaults() -> None:
    """Register `run_defaults()` in Hydra's ConfigStore as `RUN_DEFAULTS_NAME` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=RUN_DEFAULTS_NAME, node=run_defaults())


def _walk(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """`(dotted key, field)` of every setting of `cls`, nested sections expanded, in declaration order."""
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        if "section" in f.metadata:
            yield from _walk(f.metadata["section"], key + ".")
        else:
            yield key, f


def rules() -> dict[str, Spec]:
    """`{dotted key: spec}` of every checked setting of the run config, `data.*` included."""
    declared = [*_walk(RunSettings), *_walk(DataSettings, "data.")]
    return {key: f.metadata["spec"] for key, f in declared if f.metadata.get("spec") is not None}


def _sections(cls: type, prefix: str = "") -> Iterator[tuple[str, type]]:
    """`(dotted key, class)` of every section below `cls`."""
    for f in fields(cls):
        if "section" in f.metadata:
            key = f"{prefix}{f.name}"
            yield key, f.metadata["section"]
            yield from _sections(f.metadata["section"], key + ".")


def _refuse_unknown(cls: type, values: Mapping[str, Any], key: str) -> None:
    """`InputError` for the first key of `values` that `cls` does not declare (`key`: the section's dotted key)."""
    known = [f.name for f in fields(cls)]
    unknown = [k for k in values if k not in known]
    if unknown:
        name = f"{key}.{unknown[0]}" if key else unknown[0]
        raise InputError(f"{name} is not a setting of {key or cls.__name__} (its settings: {', '.join(known)})",
                         argument=name, expected=f"one of {', '.join(known)}")


#: settings that contradict each other, declared once: (whether the values contradict, given `v(dotted key)` -> the
#: value or None where unset; the one line that names them all and what to give instead), checked with the values,
#: before a launch writes anything
CONSTRAINTS: tuple[tuple[Callable[[Callable[[str], Any]], bool], str], ...] = (
    (lambda v: v("trainer.max_epochs") == -1 and v("trainer.max_steps") in (None, -1),
     "trainer.max_epochs=-1 and trainer.max_steps=-1: the run would never end; give either a positive value"),
    (lambda v: v("trainer.limit_train_batches") is not None and float(v("trainer.limit_train_batches")) == 0,
     "trainer.limit_train_batches=0: the run would train nothing; give a count >= 1 or a fraction in (0, 1]"),
    (lambda v: None not in (v("model.kwargs.num_classes"), v("data.num_classes"))
     and v("model.kwargs.num_classes") != v("data.num_classes"),
     "model.kwargs.num_classes differs from data.num_classes: the head must have one output per class of the data; "
     "set data.num_classes (the model takes it from there)"),
    (lambda v: str(v("ckpt.monitor")).startswith("val_ema/") and not v("ema.enabled"),
     "ckpt.monitor=val_ema/... needs ema.enabled=true"),
    (_transfer_without_source,
     "transfer.mode / transfer.use_ema without transfer.ckpt: they apply to a source checkpoint's weights, and this "
     "run trains from scratch; give transfer.ckpt=<checkpoint or export> (or `ssogvit transfer`), or leave them out"),
)


def check_values(cfg: Any) -> None:
    """Raise `InputError` naming the first value of the composed config `cfg` (a `DictConfig`) that its declared spec
    refuses, a key added to a section that is not open (`OPEN`) to added keys, or settings that contradict each other
    (`CONSTRAINTS`)."""
    from omegaconf import OmegaConf

    absent = object()
    for key, spec in rules().items():
        value = OmegaConf.select(cfg, key, default=absent)
        if value is not absent:
            spec.check(value, key)
    for key, cls in _sections(RunSettings):
        node = OmegaConf.select(cfg, key, default=None)
        if not getattr(cls, "OPEN", False) and isinstance(node, Mapping):
            _refuse_unknown(cls, node, key)
    for key, f in [*_walk(RunSettings), *_walk(DataSettings, "data.")]:
        rule = f.metadata.get("applies")
        value = OmegaConf.select(cfg, key, default=absent)
        if rule is not None and value is not absent:
            value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            check_applies({key: rule}, {key: value}, {key: _default(f)},
                          lambda k: OmegaConf.select(cfg, k, default=None))
    for contradicts, message in CONSTRAINTS:
        if contradicts(lambda key: OmegaConf.select(cfg, key, default=None)):
            raise InputError(message)


def settings_of(cls: type, values: Mapping[str, Any] | None = None, *, key: str = "") -> Any:
    """An instance of the settings class `cls` from `values` (a section of a run config, possibly partial): each value
    given is checked by its spec, a key left out takes its declared default, a nested section is built the same way;
    a refused value or an undeclared key raises `InputError` (a `ValueError`) naming the dotted key (`key.name`)."""
    values = dict(values or {})
    known = {f.name: f for f in fields(cls)}
    where = f"{key}." if key else ""
    _refuse_unknown(cls, values, key)
    kwargs = {}
    for name, value in values.items():
        nested, spec = known[name].metadata.get("section"), known[name].metadata.get("spec")
        if nested:
            value = settings_of(nested, value, key=f"{where}{name}")
        elif spec is not None:
            value = spec.check(value, f"{where}{name}")
        kwargs[name] = value
    return cls(**kwargs)


def settings_markdown() -> str:
    """The table of docs/training.md, "The settings and their defaults": every setting of the run config (`data.*`
    included) with its default, what it accepts and what it means."""
    rows = ["| key | default | accepts | meaning |", "|---|---|---|---|"]
    return "\n".join(rows + settings_table() + settings_table(DataSettings, "data."))


def settings_table(cls: type = RunSettings, prefix: str = "") -> list[str]:
    """Markdown table rows (`| key | default | accepts | meaning |`) of every setting of `cls`."""

    import yaml

    def shown(value: Any) -> str:
        if value is dataclasses.MISSING:
            return "(the data group's)"
        if isinstance(value, (dict, list)):
            return yaml.safe_dump(value, default_flow_style=True, sort_keys=False).strip()
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    rows = []
    for key, f in _walk(cls, prefix):
        default = _default(f)
        spec = f.metadata.get("spec")
        accepted = spec.expected() + (", or null" if spec.none else "") if spec else "any"
        rows.append(f"| `{key}` | `{shown(default)}` | {accepted} | "
                    f"{f.metadata.get('doc', '')} |")
    return rows

