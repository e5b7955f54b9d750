"""``bigmem-train predict`` and ``evaluate``: apply a trained model to whole volumes and score the masks."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from bigmem_train.errors import EXIT_PASS, BadInput
from bigmem_train.sizes import format_bytes, parse_size


def add_parsers(sub) -> None:
    predict = sub.add_parser(
        "predict",
        help="segment whole volumes with a trained model (NIfTI masks out)",
        description="Segment whole volumes with a trained model: the training pipeline's channels and "
        "normalization, the whole volume when it fits the host (or --target), else overlapping tiles "
        "with Gaussian blending sized by the planner. One uint8 NIfTI mask per case with the image's "
        "geometry; cases already written are skipped. Exit 3 when not even the smallest tile fits.",
    )
    predict.add_argument(
        "--model", required=True, metavar="RUN_DIR|MODEL.keras", help="a run directory (its best checkpoint)"
    )
    predict.add_argument(
        "--data",
        required=True,
        nargs="+",
        metavar="DIR|IMAGE",
        help="NIfTI images, folders of them, or a Decathlon folder (its dataset.json's test list)",
    )
    predict.add_argument("--out", required=True, metavar="DIR", help="folder for the masks and predict.json")
    predict.add_argument(
        "--config", metavar="FILE", help="the job config the model was trained with (default: its run's)"
    )
    add_predict_options(predict)
    predict.add_argument("--plan", action="store_true", help="print each case's plan and stop")

    evaluate = sub.add_parser(
        "evaluate",
        help="score predicted masks against labels: Dice, HD95, volumes, BraTS regions",
        description="Score every mask in --pred against the label of the same name in --labels: per case "
        "and per class Dice, 95th-percentile Hausdorff distance in mm and volumes, and for BraTS labels the "
        "whole tumour, tumour core and enhancing tumour. Writes evaluation.json, .csv, .html and .png.",
    )
    evaluate.add_argument("--pred", required=True, metavar="DIR", help="the masks (e.g. predict's --out)")
    evaluate.add_argument("--labels", required=True, metavar="DIR", help="the labels (e.g. labelsTr/)")
    evaluate.add_argument("--out", metavar="DIR", help="where the results go (default: --pred)")


def add_predict_options(parser: argparse.ArgumentParser) -> None:
    """How predict runs: its options here and in `remote predict`, which passes them on
    (:func:`predict_option_flags`)."""
    parser.add_argument(
        "--subset",
        choices=["test", "training", "validation"],
        default="test",
        help="which cases of a Decathlon dataset.json to predict: its test or training list, or the "
        "validation cases of the run --model was trained in (default test)",
    )
    parser.add_argument("--tta", action="store_true", help="average over the 8 mirrorings (8x the time)")
    parser.add_argument(
        "--probabilities", action="store_true", help="also write NAME_probabilities.nii.gz (float32)"
    )
    parser.add_argument(
        "--target", metavar="SIZE", help="plan within this much memory: 8GiB, 50%% (default: usable memory)"
    )
    parser.add_argument("--tile", metavar="X,Y,Z", help="predict in tiles of this shape instead of planning")
    parser.add_argument(
        "--engine",
        choices=["auto", "tensorflow", "openvino"],
        default="auto",
        help="inference engine (default auto: OpenVINO when installed, else TensorFlow)",
    )
    parser.add_argument(
        "--precision",
        choices=["auto", "float32", "bfloat16", "int8"],
        default="auto",
        help="auto (the default): the fastest of int8 (VNNI or AMX, OpenVINO engine, the int8 extra: NNCF) and "
        "bfloat16 (AMX, AVX512_BF16) the CPU runs natively whose masks on the run's validation cases stay "
        "within a Dice gate of float32's (checked once per model, cached beside it), else float32; float32 or "
        "bfloat16: that precision, no gate; int8: quantized by NNCF, refused (exit 1) when it misses the gate",
    )


def predict_option_flags(args: argparse.Namespace) -> list[str]:
    """The options :func:`add_predict_options` parsed, as flags again (checked here: exit 2 before a job starts)."""
    flags = ["--subset", args.subset, "--engine", args.engine, "--precision", args.precision]
    if args.tta:
        flags.append("--tta")
    if args.probabilities:
        flags.append("--probabilities")
    if args.target:
        try:
            parse_size(args.target, host_total_bytes=1)  # the form only: the host's memory is not known here
        except BadInput as error:
            raise BadInput(f"--target {args.target}: {error}") from None
        flags += ["--target", args.target]
    if args.tile:
        _shape(args.tile)
        flags += ["--tile", args.tile]
    return flags


def _shape(text: str | None) -> tuple[int, int, int] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise BadInput(f"--tile {text}: give three positive edges, e.g. 128,128,128")
    return shape


def predict_command(args: argparse.Namespace) -> int:
    from bigmem_train.host import read_cpu_flags
    from bigmem_train.infer.engine import check_precision, resolve_engine
    from bigmem_train.infer.precision import choose_precision
    from bigmem_train.infer.predict import (
        PredictRequest,
        check_outputs,
        plan_cases,
        planned_conversion_bytes,
        predict,
    )
    from bigmem_train.infer.source import resolve_images, resolve_model, validation_names

    # The flags first (a second), then the model and the images' headers, then the outputs: all before
    # planning, and planning before any image is read whole or the model is loaded.
    engine = resolve_engine(args.engine)
    cpu_flags = read_cpu_flags()
    check_precision(args.precision, cpu_flags)
    if args.precision == "int8":
        from bigmem_train.infer.int8 import check_int8

        check_int8(engine, cpu_flags)  # the engine, NNCF and the CPU's int8 dot product
    tile = _shape(args.tile)
    source = resolve_model(args.model, args.config)
    only = validation_names(source) if args.subset == "validation" else None
    cases = resolve_images(args.data, args.subset, only)
    request = PredictRequest(
        source,
        cases,
        Path(args.out),
        tta=args.tta,
        probabilities=args.probabilities,
        target=args.target,
        tile=tile,
        engine=args.engine,
        # auto is planned as float32, the larger: what cannot fit is refused before the gate runs.
        precision="float32" if args.precision == "auto" else args.precision,
    )
    check_outputs(request)
    plans = plan_cases(request)
    dataset_dirs = [Path(spec) for spec in args.data if (Path(spec) / "dataset.json").is_file()]
    choice = choose_precision(request, args.precision, cpu_flags, dataset_dirs, run=not args.plan)
    if choice.precision != request.precision:
        request = replace(request, precision=choice.precision)
        plans = plan_cases(request)
    request = replace(request, precision_choice=choice.record())
    print(f"bigmem-train: precision {choice.precision} ({choice.reason})", flush=True)
    for case in cases:
        print(f"bigmem-train: plan {plans[case.name].describe()}", flush=True)
    if resolve_engine(args.engine) == "openvino":
        print(
            "bigmem-train: plan OpenVINO's one-time conversion of the model (skipped when cached): "
            f"{format_bytes(planned_conversion_bytes(source))}",
            flush=True,
        )
    if args.plan:
        return EXIT_PASS
    summary = predict(request, plans)
    peaks = [case["peak_rss_bytes"] for case in summary["cases"].values()]
    peak = f", process peak {format_bytes(max(peaks))}" if peaks else ""
    print(f"PREDICTED {len(summary['cases'])} case(s) in {args.out} ({choice.precision}){peak}")
    return EXIT_PASS


def evaluate_command(args: argparse.Namespace) -> int:
    from bigmem_train.verdict.evaluate import evaluate_folders

    out = Path(args.out) if args.out else None
    result = evaluate_folders(Path(args.pred), Path(args.labels), out)
    for name, row in result["summary"].items():
        print(
            f"  {name}: Dice mean {row['mean_dice']:.4f} (pooled {row['pooled_dice']:.4f}), "
            f"HD95 median {row['median_hd95_mm']:.2f} mm, {row['cases']} case(s)"
        )
    print(f"EVALUATED {out or args.pred}/evaluation.html")
    return EXIT_PASS
