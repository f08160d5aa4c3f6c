"""Distil a multi-head-attention teacher into its SSoG student: the recipes, as one Lightning module.

Recipes (``RECIPES``), each on top of the carried weights and fitted fields:

- ``"logits"``: cross-entropy on the labels plus ``KL(teacher || student)`` of the class probabilities (temperature
  ``temperature``, scaled by its square), every parameter trained;
- ``"blocks"``: ``"logits"`` plus the relative squared error of the student's hidden states against the teacher's:
  every block's output (for an ODE model, whose solver calls no block's forward, every mixer call's input) and the
  final normalised tokens, both models running on their own; every parameter trained;
- ``"progressive"``: block by block, ``steps_per_block`` optimizer steps each: block ``k`` alone is trained to
  reproduce the teacher's hidden state after block ``k`` from the output of the student's (already converted)
  blocks before it, every other parameter frozen; after the last block, the ``"blocks"`` loss on every parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssogvit.layers import is_ssog
from ssogvit.train.losses import topk_correct

from .student import record_block_outputs, record_mixer_inputs

__all__ = ["DEFAULT_RECIPE", "RECIPES", "ConversionModule", "relative_error"]

RECIPES = ("logits", "blocks", "progressive")
DEFAULT_RECIPE = "blocks"
_TOPK = (1, 3, 5)


def relative_error(student: Tensor, teacher: Tensor) -> Tensor:
    """``||s - t||^2 / ||t||^2`` over each sample's tokens and features, averaged over the batch."""
    dims = tuple(range(1, teacher.ndim))
    return ((student - teacher).pow(2).sum(dims) / teacher.pow(2).sum(dims).clamp_min(1e-12)).mean()


def _hidden_states(model: nn.Module, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Logits and the hidden states: every block call's output (or, if none, every mixer call's input), then the
    final normalised tokens."""
    with record_block_outputs(model) as outputs, record_mixer_inputs(model) as inputs:
        tokens = model.forward_features(x)
    states = outputs if outputs else [r[1] for r in inputs]
    return model.forward_head(tokens), states + [tokens]


class ConversionModule(pl.LightningModule):
    """Student, frozen teacher and recipe.

    Args:
        student: the SSoG model being trained (``build_student``, fields fitted).
        teacher: the attention ViT it learns from; frozen, in eval mode.
        recipe: ``optim`` (``opt``, ``lr``, ``lr_base_batch``, ``weight_decay``, ``betas``, ``eps``), ``sched``
            (``warmup_epochs``, ``warmup_lr``, ``min_lr``), ``batch_size``, ``smoothing``; a key left out of
            ``optim`` or ``sched`` takes its declared default (``ssogvit.train.settings``).
        distill: ``recipe`` (one of ``RECIPES``), ``temperature``, ``kd_weight``, ``feature_weight``,
            ``steps_per_block`` (progressive), ``field_lr_scale`` (learning rate of the fields over the rest's).
        hparams: stored in checkpoints as they are (the conversion's config, the student's ``model_config``).
    """

    def __init__(self, student: nn.Module, teacher: nn.Module, *, recipe: Mapping[str, Any],
                 distill: Mapping[str, Any], hparams: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(dict(hparams or {}))
        if distill["recipe"] not in RECIPES:
            raise ValueError(f"unknown conversion recipe {distill['recipe']!r}; expected one of {RECIPES}")
        self.model = student.train()
        self.teacher = teacher.eval().requires_grad_(False)
        self.recipe = dict(recipe)
        self.distill = dict(distill)
        self.kind = str(distill["recipe"])
        self.num_blocks = len(student.blocks)
        if self.kind == "progressive" and (self.num_blocks < 2 or getattr(student, "family", "vit") != "vit"):
            raise ValueError("progressive replacement needs a discrete ViT with several blocks; use recipe 'blocks'")

    def train(self, mode: bool = True) -> ConversionModule:
        super().train(mode)
        self.teacher.eval()  # the teacher never drops paths or tokens
        return self

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    # training -----------------------------------------------------------------------------------------------------
    def phase(self) -> int | None:
        """The block being replaced (progressive recipe), or ``None`` when every parameter trains."""
        if self.kind != "progressive":
            return None
        k = self.global_step // max(int(self.distill["steps_per_block"]), 1)
        return k if k < self.num_blocks else None

    def _progressive_loss(self, x: Tensor, k: int) -> Tensor:
        with torch.no_grad():
            _, t_states = _hidden_states(self.teacher, x)
        # block k reads the student's own state, detached: no other parameter gets a gradient
        hook = self.model.blocks[k].register_forward_pre_hook(lambda mod, args: (args[0].detach(), *args[1:]))
        try:
            _, s_states = _hidden_states(self.model, x)
        finally:
            hook.remove()
        return relative_error(s_states[k], t_states[k])

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        bsz = x.shape[0]
        k = self.phase()
        if k is not None:
            loss = self._progressive_loss(x, k)
            self.log("train/block_error", loss, on_step=True, batch_size=bsz)
            self.log("train/loss", loss, on_step=True, prog_bar=True, batch_size=bsz)
            return loss
        with torch.no_grad():
            t_logits, t_states = _hidden_states(self.teacher, x)
        logits, s_states = _hidden_states(self.model, x)
        temp = float(self.distill["temperature"])
        ce = F.cross_entropy(logits.float(), y, label_smoothing=float(self.recipe.get("smoothing", 0.0)))
        kd = F.kl_div(F.log_softmax(logits.float() / temp, -1), F.log_softmax(t_logits.float() / temp, -1),
                      log_target=True, reduction="batchmean") * temp**2
        loss = ce + float(self.distill["kd_weight"]) * kd
        self.log("train/kd", kd, on_step=True, batch_size=bsz)
        if self.kind != "logits":
            if len(s_states) != len(t_states):
                raise ValueError(f"the teacher has {len(t_states) - 1} hidden states and the student "
                                 f"{len(s_states) - 1}: matching them needs a fixed-step solver")
            feats = torch.stack([relative_error(s, t) for s, t in zip(s_states, t_states)]).mean()
            loss = loss + float(self.distill["feature_weight"]) * feats
            self.log("train/block_error", feats, on_step=True, batch_size=bsz)
        self.log("train/loss", loss, on_step=True, prog_bar=True, batch_size=bsz)
        with torch.no_grad():
            self.log("train/top1", 100.0 * topk_correct(logits, y, (1,))[1] / bsz, on_step=False, on_epoch=True,
                     batch_size=bsz)
        return loss

    # evaluation ---------------------------------------------------------------------------------------------------
    def _eval_step(self, batch: tuple[Tensor, Tensor], prefix: str) -> None:
        x, y = batch
        logits = self.model(x)
        bsz = x.shape[0]
        self.log(f"{prefix}/loss", F.cross_entropy(logits.float(), y), batch_size=bsz, sync_dist=True)
        for k, n in topk_correct(logits, y, _TOPK).items():
            self.log(f"{prefix}/top{k}", 100.0 * n / bsz, batch_size=bsz, sync_dist=True, prog_bar=k == 1)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    # optimisation -------------------------------------------------------------------------------------------------
    def _param_groups(self, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        """Weight decay on matrices only; the Gaussian fields (what ``SSoGAttention.no_weight_decay`` names: ``mu, rho,
        ell, theta`` and the steering gates) without it, at ``field_lr_scale`` times the learning rate (Adam moves a
        parameter by about the learning rate per step, so at 1e-3 a field fitted wide could not narrow within a short
        conversion)."""
        field_names = {f"{prefix}.{name}" for prefix, m in self.model.named_modules() if is_ssog(m)
                       for name in m.no_weight_decay()}
        decay, no_decay, fields = [], [], []
        for name, p in self.model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name in field_names:
                fields.append(p)
            elif p.ndim <= 1 or leaf in ("pos_embed", "cls_token", "reg_token"):
                no_decay.append(p)
            else:
                decay.append(p)
        scale = float(self.distill.get("field_lr_scale", 1.0))
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0},
                {"params": fields, "weight_decay": 0.0, "lr": lr * scale}]

    def configure_optimizers(self):
        from timm.optim import create_optimizer_v2

        from ssogvit.train.module import scaled_lr, step_cosine_schedule
        from ssogvit.train.settings import OptimSettings, settings_of

        optim = settings_of(OptimSettings, self.recipe["optim"], key="optim")  # missing keys: the declared defaults
        lr = scaled_lr(optim, int(self.recipe["batch_size"]), self.trainer)
        optimizer = create_optimizer_v2(
            self._param_groups(lr, float(optim.weight_decay)), opt=optim.opt, lr=lr, weight_decay=0.0,
            betas=tuple(optim.betas), eps=float(optim.eps),
        )
        schedule = step_cosine_schedule(optimizer, self.trainer, self.recipe["sched"])
        return {"optimizer": optimizer, "lr_scheduler": schedule}

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        scheduler.step_update(num_updates=self.global_step)
