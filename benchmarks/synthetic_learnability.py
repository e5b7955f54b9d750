"""Check by hand that the synthetic dataset is learnable: a small U-Net's validation Dice rises.

    python benchmarks/synthetic_learnability.py [--cases 12] [--shape 48,48,32] [--epochs 6]

Writes the dataset to a temporary folder, trains the depth-3, 8-filter U-Net on FLAIR with binary
labels through the real reader and pipeline, and prints loss and Dice per epoch. Not a test: it
trains for minutes on two cores.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bigmem_train.config import config_from_dict
from bigmem_train.data.pipeline import make_datasets
from bigmem_train.data.reader import check_dataset
from bigmem_train.data.split import split_cases
from bigmem_train.data.synth import write_synthetic_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--shape", default="48,48,32")
    parser.add_argument("--input-shape", default=None, help="crop shape (default: the volume shape)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--filters", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--jitter", type=int, default=4)
    # Experiments on the model, not the data: start the sigmoid at a small foreground probability,
    # and let BatchNormalization's moving statistics follow faster in short runs.
    parser.add_argument("--output-bias", type=float, default=None, help="initial bias of the output layer")
    parser.add_argument("--bn-momentum", type=float, default=None, help="BatchNormalization momentum")
    args = parser.parse_args()
    shape = tuple(int(edge) for edge in args.shape.split(","))
    input_shape = tuple(int(edge) for edge in (args.input_shape or args.shape).split(","))

    with tempfile.TemporaryDirectory(prefix="learnability-") as folder:
        started = time.perf_counter()
        dataset = write_synthetic_dataset(Path(folder) / "data", cases=args.cases, shape=shape, seed=1234)
        print(f"synth: {time.perf_counter() - started:.1f} s")
        config = config_from_dict(
            {
                "data": {
                    "source": "decathlon",
                    "path": str(dataset),
                    "input_shape": list(input_shape),
                    "crop_jitter": args.jitter,
                },
                "model": {"depth": args.depth, "base_filters": args.filters},
                "training": {
                    "batch_size": args.batch,
                    "epochs": args.epochs,
                    "learning_rate": args.learning_rate,
                },
            }
        )
        cases = check_dataset(config)
        train_cases, validation_cases = split_cases(
            cases, config.data.validation_fraction, config.data.split_seed
        )
        datasets = make_datasets(config, train_cases, validation_cases)

        from bigmem_train.model.unet import compile_model

        model = compile_model(config)
        if args.output_bias is not None:
            model.get_layer("segmentation").bias.assign([args.output_bias])
        if args.bn_momentum is not None:
            for layer in model.layers:
                if layer.__class__.__name__ == "BatchNormalization":
                    layer.momentum = args.bn_momentum
        history = model.fit(
            datasets.train,
            epochs=args.epochs,
            steps_per_epoch=datasets.train_steps,
            validation_data=datasets.validation,
            validation_steps=datasets.validation_steps,
            verbose=2,
        )
        print("epoch  loss    dice    val_dice  val_hard_dice")
        for epoch in range(args.epochs):
            row = {key: values[epoch] for key, values in history.history.items()}
            print(
                f"{epoch + 1:5d}  {row['loss']:.4f}  {row['dice']:.4f}  {row['val_dice']:.4f}    "
                f"{row['val_hard_dice']:.4f}"
            )
        print(f"total: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
