"""The Lightning module: one image classifier trained with the DeiT recipe from timm.

Everything it needs arrives as plain dicts (saved verbatim as the checkpoint's hyper-parameters, so a checkpoint
loads with `torch.load(weights_only=True)` and rebuilds its model without running code from the file).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from lightning.pytorch.utilities import rank_zero_warn

from ssogvit.models.maps import record_attention

from .errors import NonFiniteError
from .io import build_model, read_state_dict
from .losses import attention_penalty, jasmin_options, topk_correct
from .resume import rng_state, set_rng_state
from .settings import (EmaSettings, LossSettings, MixupSettings, OptimSettings, SchedSettings, TransferSettings,
                       settings_of)

__all__ = ["ClassificationModule", "scaled_lr", "step_cosine_schedule", "TOPK"]

TOPK = (1, 3, 5)


def scaled_lr(optim: OptimSettings | Mapping[str, Any], batch_size: int, trainer: Any) -> float:
    """``optim.lr`` scaled by the global batch (per-device batch x devices x accumulation) over ``optim.lr_base_batch``
    (DeiT's linear rule); unscaled when ``lr_base_batch`` is null. A mapping's missing keys take the declared
    defaults (`OptimSettings`)."""
    optim = _settings(OptimSettings, optim, "optim")
    accumulate = trainer.accumulate_grad_batches if trainer else 1
    world = trainer.world_size if trainer else 1
    global_batch = int(batch_size) * world * accumulate
    return float(optim.lr) * global_batch / float(optim.lr_base_batch or global_batch)


def step_cosine_schedule(optimizer: torch.optim.Optimizer, trainer: Any,
                         sched: SchedSettings | Mapping[str, Any]) -> dict[str, Any]:
    """timm's cosine schedule over the run's optimizer steps, with ``sched.warmup_epochs`` of linear warm-up, as the
    ``lr_scheduler`` entry of ``configure_optimizers`` (stepped per optimizer step by ``lr_scheduler_step``). A
    mapping's missing keys take the declared defaults (`SchedSettings`)."""
    from timm.scheduler import CosineLRScheduler

    sched = _settings(SchedSettings, sched, "sched")
    total = max(int(trainer.estimated_stepping_batches), 1)
    epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else 1
    warmup = int(round(float(sched.warmup_epochs) * total / epochs))
    if warmup >= total and total > 1:  # said, not silently capped (a short run of a recipe made for a long one)
        rank_zero_warn(f"sched.warmup_epochs={sched.warmup_epochs:g} covers the whole run ({epochs} epochs): the "
                       f"warm-up is capped at {total - 1} of its {total} steps, so the learning rate peaks at the end; "
                       f"give fewer warm-up epochs for a schedule that decays")
    peak = max(group.get("initial_lr", group["lr"]) for group in optimizer.param_groups)  # timm keeps the base
    if float(sched.min_lr) > peak:  # said, not silently followed: the "decay" would rise to its floor
        rank_zero_warn(f"sched.min_lr={float(sched.min_lr):g} is above the peak learning rate {peak:g} (optim.lr "
                       f"scaled by the batch over optim.lr_base_batch): the cosine schedule rises from the peak to "
                       f"that floor; give a smaller sched.min_lr (or a larger optim.lr) for one that decays")
    scheduler = CosineLRScheduler(
        optimizer, t_initial=total, lr_min=float(sched.min_lr), warmup_t=min(warmup, total - 1),
        warmup_lr_init=float(sched.warmup_lr), t_in_epochs=False,
    )
    return {"scheduler": scheduler, "interval": "step"}


def _settings(cls: type, values: Any, key: str) -> Any:
    """`values` as the settings class `cls` (an instance already, or a mapping: see `settings_of`)."""
    return values if isinstance(values, cls) else settings_of(cls, values, key=key)


class ClassificationModule(pl.LightningModule):
    """Classifier around a `ssogvit` model.

    Args:
        model_config: the model's `config` dict (name and kwargs of `create_model`).
        recipe: `optim`, `sched`, `loss`, `mixup`, `ema` sections of the run config, plus `batch_size` (per device);
            a section or key left out takes its declared default (`ssogvit.train.settings`).
        transfer: optional `{"ckpt", "mode", "use_ema"}`: load a source checkpoint's weights (all but the head) and,
            with `mode="linear"`, train only the head (linear probe).
        data: the run's `data` section, recorded with the checkpoint (under its digest): `eval` and `analyze` draw
            the validation split from it (`ssogvit.train.io.sealed_data_config`), never from an edited config.yaml.

    The plain dicts are saved as the hyper-parameters; the module reads them as typed settings (`self.optim`,
    `self.sched`, `self.loss`, `self.mixup`, `self.ema_settings`), each value checked by its declared spec.
    """

    def __init__(self, model_config: dict, recipe: dict, transfer: dict | None = None, data: dict | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.model = build_model(model_config)
        self.hparams["model_config"] = dict(self.model.config)  # the canonical form, as create_model records it
        self.recipe = recipe
        self.optim = settings_of(OptimSettings, recipe.get("optim"), key="optim")
        self.sched = settings_of(SchedSettings, recipe.get("sched"), key="sched")
        self.loss = settings_of(LossSettings, recipe.get("loss"), key="loss")
        self.mixup = settings_of(MixupSettings, recipe.get("mixup"), key="mixup")
        self.ema_settings = settings_of(EmaSettings, recipe.get("ema"), key="ema")
        self.num_classes = int(self.model.num_classes)
        source = settings_of(TransferSettings, transfer, key="transfer") if transfer else TransferSettings()
        self.linear_probe = bool(source.ckpt and source.mode == "linear")
        if source.ckpt:
            self._load_source(source.ckpt, use_ema=bool(source.use_ema))

        mix = self.mixup
        self.smoothing = float(self.loss.smoothing)
        self.mixup_fn = None
        if mix.mixup_alpha > 0 or mix.cutmix_alpha > 0:
            from timm.data import Mixup

            self.mixup_fn = Mixup(
                mixup_alpha=mix.mixup_alpha, cutmix_alpha=mix.cutmix_alpha, prob=mix.prob, switch_prob=mix.switch_prob,
                mode=mix.mode, label_smoothing=self.smoothing, num_classes=self.num_classes,
            )
        self.jasmin_weight = float(self.loss.jasmin.weight)
        self.jasmin_options = jasmin_options(dataclasses.asdict(self.loss.jasmin))

        self.ema = None
        if self.ema_settings.enabled:
            from timm.utils import ModelEmaV3

            self.ema = ModelEmaV3(self.model, decay=float(self.ema_settings.decay))
        self.saving_resumable = False  # set by `save_resumable` around the saves a resume may use

    # transfer -----------------------------------------------------------------------------------------------------
    def _load_source(self, path: str, *, use_ema: bool) -> None:
        state, _ = read_state_dict(path, use_ema=use_ema)
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith("head.")]
        if missing or unexpected:
            raise RuntimeError(f"source checkpoint {path} does not fit: missing {missing}, unexpected {unexpected}")
        if self.linear_probe:
            for name, p in self.model.named_parameters():
                p.requires_grad_(name.startswith("head."))

    # checkpoints: exact resume ----------------------------------------------------------------------------------------
    # Every checkpoint carries the RNG states, and says whether a resume may use it (`ssogvit.train.resume`).
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        bad = [k for k, v in checkpoint["state_dict"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise NonFiniteError(f"the weights became non-finite ({bad[0]}, ...) at epoch {self.current_epoch}, step "
                                 f"{self.global_step}: the run diverged (lower optim.lr?) and was stopped; no "
                                 f"checkpoint of it was written")
        checkpoint["ssogvit"] = {"resumable": self.saving_resumable, "rng": rng_state()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning restores the module before it creates the first training iterator (which draws the workers' base
        # seed, then the shuffle's): from here on a resumed launch draws what the uninterrupted run drew after the
        # checkpoint. The sanity-check validation runs with its own isolated RNG.
        state = (checkpoint.get("ssogvit") or {}).get("rng")
        if state is not None:
            set_rng_state(state)

    def on_train_epoch_start(self) -> None:
        if self.linear_probe:  # frozen backbone: no drop path, features as at evaluation
            self.model.eval()
            self.model.head.train()

    # steps --------------------------------------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        y_hard = y
        if self.mixup_fn is not None:
            x, y = self.mixup_fn(x, y)  # y: soft targets (B, C) with label smoothing folded in
        if self.jasmin_weight > 0:
            with record_attention(self.model) as attns:
                logits = self.model(x)
        else:
            logits = self.model(x)
        if y.ndim == 2:
            loss = torch.sum(-y * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()  # SoftTargetCrossEntropy
        else:
            loss = F.cross_entropy(logits.float(), y, label_smoothing=self.smoothing)
        bsz = x.shape[0]
        if self.jasmin_weight > 0:
            reg = attention_penalty(attns, **self.jasmin_options)
            self.log("train/jasmin", reg, on_step=False, on_epoch=True, batch_size=bsz)
            loss = loss + self.jasmin_weight * reg
        if not torch.isfinite(loss):
            raise NonFiniteError(f"the training loss is {float(loss)} at epoch {self.current_epoch}, step "
                                 f"{self.global_step}: the run diverged (lower optim.lr?) and was stopped; "
                                 f"nothing of it was exported")
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=bsz)
        with torch.no_grad():  # accuracy against the original labels (under mixup: of the mixed image)
            for k, n in topk_correct(logits.detach(), y_hard, TOPK).items():
                self.log(f"train/top{k}", 100.0 * n / bsz, on_step=False, on_epoch=True, batch_size=bsz)
        return loss

    def _eval_step(self, model: nn.Module, batch: tuple[Tensor, Tensor], prefix: str) -> None:
        x, y = batch
        logits = model(x)
        bsz = x.shape[0]
        self.log(f"{prefix}/loss", F.cross_entropy(logits.float(), y), batch_size=bsz, sync_dist=True,
                 prog_bar=prefix == "val")
        for k, n in topk_correct(logits, y, TOPK).items():
            self.log(f"{prefix}/top{k}", 100.0 * n / bsz, batch_size=bsz, sync_dist=True, prog_bar=k == 1)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(self.model, batch, "val")
        if self.ema is not None:
            self._eval_step(self.ema.module, batch, "val_ema")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(self.model, batch, "test")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.ema is not None:
            self.ema.update(self.model, step=self.global_step)

    # optimisation -------------------------------------------------------------------------------------------------
    def configure_optimizers(self):
        from timm.optim import create_optimizer_v2

        optim = self.optim
        lr = scaled_lr(optim, int(self.recipe["batch_size"]), self.trainer)
        # timm: AdamW; the model's no_weight_decay() set, 1-D params (norms, biases) get no weight decay
        optimizer = create_optimizer_v2(
            self.model, opt=optim.opt, lr=lr, weight_decay=float(optim.weight_decay), betas=tuple(optim.betas),
            eps=float(optim.eps), filter_bias_and_bn=True, **self._fused_step(optim),
        )
        schedule = step_cosine_schedule(optimizer, self.trainer, self.sched)
        return {"optimizer": optimizer, "lr_scheduler": schedule}

    def _fused_step(self, optim: OptimSettings) -> dict[str, bool]:
        """`fused=True` for Adam(W) on the CPU: PyTorch's one-kernel update, 6x faster than its per-tensor loop on a
        small model (on CUDA PyTorch already picks its multi-tensor path, and AMP's gradient clipping refuses
        fused optimizers)."""
        fusable = str(optim.opt).lower() in ("adam", "adamw")
        return {"fused": True} if fusable and self.device.type == "cpu" else {}

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        scheduler.step_update(num_updates=self.global_step)
