"""Semantic segmentation in the training pipeline: the Lightning module and the evaluation of a trained model.

The run (folder, resume, checkpoints, export) is the classification run's (`ssogvit.train.run`); only the steps
differ: per-pixel cross-entropy (pixels labelled `ignore_index` left out), and the metrics of torchmetrics, mIoU
(`MulticlassJaccardIndex`, the mean over classes of intersection over union, in %) and pixel accuracy
(`MulticlassAccuracy` with micro averaging: the share of labelled pixels whose class is right, in %), logged as
`val/miou` and `val/pixel_acc` (and `train/...` on the training batches).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import NonFiniteError
from .module import ClassificationModule

__all__ = ["SegmentationModule", "segmentation_metrics", "evaluate_segmentation", "SEGMENTATION_METRICS"]

SEGMENTATION_METRICS = ("miou", "pixel_acc")


def segmentation_metrics(num_classes: int, ignore_index: int | None) -> nn.ModuleDict:
    """The torchmetrics of a segmentation run, in %, on logits `(B, K, H, W)` against masks `(B, H, W)`: each is
    `update`d batch by batch and `compute`d over all of them."""
    from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex

    return nn.ModuleDict({
        "miou": MulticlassJaccardIndex(num_classes, average="macro", ignore_index=ignore_index) * 100.0,
        "pixel_acc": MulticlassAccuracy(num_classes, average="micro", ignore_index=ignore_index) * 100.0,
    })


class SegmentationModule(ClassificationModule):
    """Per-pixel classifier around an ssogvit segmentation model (`create_model(..., task="segmentation")`).

    Args:
        model_config: the model's `config` dict.
        recipe: as `ClassificationModule`'s, plus `ignore_index` (the data's).
        transfer, data: as `ClassificationModule`'s.
    """

    def __init__(self, model_config: dict, recipe: dict, transfer: dict | None = None, data: dict | None = None):
        super().__init__(model_config, recipe, transfer, data)
        if self.mixup_fn is not None:
            raise ValueError("mixup / cutmix mix images, not masks: set mixup.mixup_alpha=0 and mixup.cutmix_alpha=0")
        if self.jasmin_weight > 0:
            raise ValueError("loss.jasmin is a classification regulariser: set loss.jasmin.weight=0")
        self.ignore_index = int(recipe["ignore_index"])
        self.train_metrics = segmentation_metrics(self.num_classes, self.ignore_index)
        self.val_metrics = segmentation_metrics(self.num_classes, self.ignore_index)
        self.val_ema_metrics = segmentation_metrics(self.num_classes, self.ignore_index) if self.ema else None

    def _loss(self, logits: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(logits.float(), y, ignore_index=self.ignore_index, label_smoothing=self.smoothing)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch  # (B, C, H, W), (B, H, W)
        logits = self.model(x)  # (B, K, H, W)
        loss = self._loss(logits, y)
        if not torch.isfinite(loss):
            raise NonFiniteError(f"the training loss is {float(loss)} at epoch {self.current_epoch}, step "
                                 f"{self.global_step}: the run diverged (lower optim.lr?) and was stopped; "
                                 f"nothing of it was exported")
        bsz = x.shape[0]
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=bsz)
        self._log_metrics(self.train_metrics, logits.detach(), y, "train", bsz)
        return loss

    def _log_metrics(self, metrics: nn.ModuleDict, logits: Tensor, y: Tensor, prefix: str, bsz: int) -> None:
        for name, metric in metrics.items():
            metric.update(logits, y)
            self.log(f"{prefix}/{name}", metric, on_step=False, on_epoch=True, batch_size=bsz,
                     sync_dist=False, prog_bar=prefix == "val" and name == "miou")

    def _seg_eval_step(self, model: nn.Module, batch: tuple[Tensor, Tensor], prefix: str,
                       metrics: nn.ModuleDict) -> None:
        x, y = batch
        logits = model(x)
        self.log(f"{prefix}/loss", self._loss(logits, y), batch_size=x.shape[0], sync_dist=True,
                 prog_bar=prefix == "val")
        self._log_metrics(metrics, logits, y, prefix, x.shape[0])

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._seg_eval_step(self.model, batch, "val", self.val_metrics)
        if self.ema is not None:
            self._seg_eval_step(self.ema.module, batch, "val_ema", self.val_ema_metrics)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._seg_eval_step(self.model, batch, "test", self.val_metrics)


def evaluate_segmentation(model: nn.Module, dm: Any, *, device: str = "cpu", progress: str = "auto") -> dict[str, Any]:
    """mIoU and pixel accuracy (%) and the mean per-pixel cross-entropy of `model` on `dm`'s validation scenes."""
    from .progress import evaluation_batches, resolve_mode

    model = model.to(device).eval()
    ignore = int(getattr(dm, "ignore_index", -100))
    metrics = segmentation_metrics(int(model.num_classes), ignore).to(device)
    loss_sum, pixels, n = 0.0, 0, 0
    for i, total, y, logits, line in evaluation_batches(model, dm.val_dataloader(), device=device,
                                                        mode=resolve_mode(progress)):
        loss_sum += float(F.cross_entropy(logits.float(), y, ignore_index=ignore, reduction="sum"))
        pixels += int((y != ignore).sum())
        for metric in metrics.values():
            metric.update(logits, y)
        n += len(y)
        if line:
            print(f"eval: batch {i}/{total}, {n} images", flush=True)
    out: dict[str, Any] = {name: float(metric.compute()) for name, metric in metrics.items()}
    out.update(loss=loss_sum / max(pixels, 1), images=n)
    return out
