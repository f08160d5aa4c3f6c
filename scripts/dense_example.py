"""An SSoG backbone for dense prediction, through the public API (docs/dense.md): build a segmentation model, train it
for a few steps on digit scenes, score it at the training size and at twice that size with and without
`rescale_field`, and put the same backbone under segmentation_models_pytorch's Unet if it is installed.

    PYTHONPATH=src python scripts/dense_example.py              # about a minute on one CPU core
    PYTHONPATH=src python scripts/dense_example.py --size 128 --steps 60

Writes nothing. Numbers from a handful of steps say only that the pieces fit; docs/dense.md has the measured ones.
"""

from __future__ import annotations

import argparse
import copy

import torch

from ssogvit.data import create_datamodule
from ssogvit.specs import IMG_SIZE, Int
from ssogvit.models import create_segmentation_model
from ssogvit.train.segmentation import evaluate_segmentation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=IMG_SIZE.argparse, default=128, help="training canvas (a multiple of 16)")
    parser.add_argument("--steps", type=Int(1, 100_000).argparse, default=40)
    parser.add_argument("--mixer", default="ssog", help="any registered mixer (ssogvit list mixers)")
    args = parser.parse_args()
    torch.manual_seed(0)

    model = create_segmentation_model(
        f"vit-tiny-{args.mixer}", num_classes=11, in_chans=1, img_size=args.size, patch_size=16,
        embed_dim=64, num_heads=4, depth=4, pyramid_dim=32, head_dim=32,
    )
    data = dict(img_size=args.size, batch_size=4, eval_batch_size=8, num_train_scenes=4 * args.steps,
                num_val_scenes=32)
    dm = create_datamodule("digit_scenes", **data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    model.train()
    for step, (images, masks) in enumerate(dm.train_dataloader(), 1):  # images (B, 1, S, S), masks (B, S, S)
        loss = torch.nn.functional.cross_entropy(model(images), masks)  # logits (B, 11, S, S)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item():.3f}")

    def score(m, size):
        result = evaluate_segmentation(m, create_datamodule("digit_scenes", **{**data, "img_size": size}),
                                       progress="none")
        return f"mIoU {result['miou']:.1f}%  pixel accuracy {result['pixel_acc']:.1f}%"

    print(f"{args.size} px (training size): {score(model, args.size)}")
    print(f"{2 * args.size} px, field as trained: {score(model, 2 * args.size)}")
    rescaled = copy.deepcopy(model)
    rescaled.rescale_field(2.0, 2.0)  # each Gaussian covers the same image area on the twice finer grid
    print(f"{2 * args.size} px, rescale_field(2, 2): {score(rescaled, 2 * args.size)}")

    try:
        import segmentation_models_pytorch as smp
    except ImportError:
        print("segmentation_models_pytorch is not installed (pip install 'ssogvit[dense]'): Unet skipped")
        return
    unet = smp.Unet(f"tu-ssogvit_vit_tiny_{args.mixer.replace('-', '_')}_pyramid", encoder_weights=None,
                    in_channels=1, classes=11)
    print(f"smp Unet on the pyramid: logits {tuple(unet(images[:1]).shape)}")


if __name__ == "__main__":
    main()
