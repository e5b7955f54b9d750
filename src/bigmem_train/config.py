"""The one typed config of a training job: data, model, training, runtime, footprint, validation, output.

Field defaults are the study's job (240x240x144, batch 16, 16 base filters, 4 poolings, FLAIR); the
built-in default run uses the small preset ``presets/default.yaml``.

Loaded from YAML (or the built-in default), validated with pydantic before TensorFlow is imported or
anything is written. Unknown keys and bad values raise :class:`~bigmem_train.errors.BadInput` with one
line naming the field.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bigmem_train.errors import BadInput
from bigmem_train.sizes import parse_size


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


Shape3D = tuple[int, int, int]

# The largest batch a config may ask for (and the planner may choose when sizing to a target).
MAX_BATCH_SIZE = 4096


def _check_edge_count(value: Any) -> Any:
    """A shape given as a list must have three edges; said so, rather than as a missing third item."""
    if isinstance(value, list | tuple) and len(value) != 3:
        raise ValueError(f"a shape has 3 edges (x, y, z), got {len(value)}: {list(value)}")
    return value


def _check_shape(value: Shape3D) -> Shape3D:
    if any(edge < 1 for edge in value):
        raise ValueError(f"every edge must be positive, got {list(value)}")
    return value


class DataConfig(_Section):
    """Where the volumes come from and how they are prepared."""

    # "synthetic": generate a Decathlon-layout dataset in the run's results folder first;
    # "decathlon": read an existing Medical Segmentation Decathlon folder (dataset.json + NIfTI).
    source: Literal["synthetic", "decathlon"] = "synthetic"
    # Dataset folder (the one holding dataset.json). Required for "decathlon".
    path: Path | None = None
    # Synthetic data: number of cases and the full volume shape written to disk.
    synthetic_cases: int = Field(16, ge=2, le=10000)
    synthetic_shape: Shape3D = (64, 64, 48)
    synthetic_seed: int = 1234
    # Input channels by index into the 4D image (MSD Task01: 0 FLAIR, 1 T1w, 2 T1gd, 3 T2w), or "all".
    channels: list[int] | Literal["all"] = Field(default_factory=lambda: [0])
    # "binary": every label > 0 is tumour (the study); "multiclass": keep labels as classes.
    label_mode: Literal["binary", "multiclass"] = "binary"
    # Shape the volumes are cropped or padded to (the study: 240x240x144).
    input_shape: Shape3D = (240, 240, 144)
    # Fraction of cases held out for validation, split with this seed.
    validation_fraction: float = Field(0.25, gt=0.0, lt=1.0)
    split_seed: int = 42
    # Random flips along the three axes during training.
    augment_flips: bool = True
    # Largest random shift of the training crop away from the centre, in voxels per axis.
    crop_jitter: int = Field(8, ge=0)
    # Parallel volume readers in the tf.data map ("auto" = AUTOTUNE); 0: one reader, run by the training
    # step itself when it asks for the next batch (no reader threads beside the step).
    parallel_reads: Annotated[int, Field(ge=0)] | Literal["auto"] = 2
    # Batches prefetched ahead of the step.
    prefetch_batches: int = Field(1, ge=0, le=64)

    _count_edges = field_validator("synthetic_shape", "input_shape", mode="before")(_check_edge_count)
    _check_synthetic_shape = field_validator("synthetic_shape", "input_shape")(_check_shape)

    @field_validator("channels")
    @classmethod
    def _check_channels(cls, value: list[int] | str) -> list[int] | str:
        if isinstance(value, list):
            if not value:
                raise ValueError("at least one channel is needed")
            if any(index < 0 for index in value) or len(set(value)) != len(value):
                raise ValueError(f"channel indices must be distinct and >= 0, got {value}")
        return value

    @model_validator(mode="after")
    def _check_source(self) -> DataConfig:
        if self.source == "decathlon" and self.path is None:
            raise ValueError("data.path is required when data.source is 'decathlon'")
        # Refused here, before a synthetic dataset (minutes at full size) is written only to fail its check.
        if self.source == "synthetic" and isinstance(self.channels, list) and max(self.channels) >= 4:
            raise ValueError(
                f"data.channels {self.channels}: the synthetic dataset has 4 channels "
                "(0 FLAIR, 1 T1w, 2 T1gd, 3 T2w)"
            )
        return self


class ModelConfig(_Section):
    """The study's 3D U-Net."""

    # Number of poolings (the study: 4).
    depth: int = Field(4, ge=1, le=7)
    # Filters of the first level, doubled at each pooling (the study: 16).
    base_filters: int = Field(16, ge=1, le=1024)
    # "transpose": Conv3DTranspose (the study); "resize": UpSampling3D then Conv3D.
    upsampling: Literal["transpose", "resize"] = "transpose"
    # Output classes: 1 = one sigmoid channel (tumour vs not); >1 = softmax over classes incl. background.
    output_classes: int = Field(1, ge=1, le=64)
    # Batch normalization after every convolution (the study: yes).
    batch_norm: bool = True
    # Gradient recomputation: keep only each level's input for backward and recompute the rest.
    recompute: bool = False
    # The two shallowest decoder levels' upsampling, concatenation and first convolution as one folded
    # transposed convolution (upconv.py): the same mathematics, fewer multiply-adds and less memory.
    # Applies to transpose upsampling without recompute, on CPUs with AVX-512; elsewhere the model is unfolded.
    fold_upsampling: bool = True


class TrainingConfig(_Section):
    """Optimisation."""

    # Samples per training step (the study: 16); a multi-worker job's global batch, split across its workers.
    batch_size: int = Field(16, ge=1, le=MAX_BATCH_SIZE)
    # Passes of steps_per_epoch steps; a killed run resumes from its last finished epoch.
    epochs: int = Field(30, ge=1, le=100000)
    # Steps per epoch; null = one pass over the training cases.
    steps_per_epoch: int | None = Field(None, ge=1)
    # Validation steps per epoch; null = one pass over the validation cases.
    validation_steps: int | None = Field(None, ge=1)
    # Adam's learning rate.
    learning_rate: float = Field(1e-3, gt=0.0, le=1.0)
    # Loss = dice_weight * -log(soft Dice) + (1 - dice_weight) * BCE (the study: 0.7).
    dice_weight: float = Field(0.7, ge=0.0, le=1.0)
    # Seed of the initial weights and of the training order, crops and flips.
    seed: int = 0
    # "single": one process; "multi_worker": tf.distribute.MultiWorkerMirroredStrategy from TF_CONFIG.
    strategy: Literal["single", "multi_worker"] = "single"
    # multi_worker: seconds a worker may send no heartbeat before the job stops as failed. TensorFlow's
    # default is 10 s, which a loaded host can miss while it faults in a large step's memory (a two-worker
    # job on 2 vCPUs stopped so, both workers healthy); a worker that really died is noticed this late.
    worker_heartbeat_timeout: float = Field(60.0, gt=0.0, le=86400.0)


def _check_size_text(value: str, what: str, alternatives: str = "") -> None:
    """A size's syntax, checked when the config is read (a percentage is resolved against the host later);
    ValueError naming it otherwise."""
    try:
        size = parse_size(value, host_total_bytes=1 << 40)
    except BadInput as error:
        raise ValueError(f"{error}{alternatives}") from None
    if size <= 0:
        raise ValueError(f"size {value!r}: {what} must be more than 0 bytes")


class RuntimeConfig(_Section):
    """How TensorFlow uses this host.

    Every field says why a user would set it, with the measurement behind it (issue 37: a knob no
    measurement shows helping a user is removed; see REMOVED_KEYS for those that were).
    """

    intra_op_threads: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Threads inside one op; null = the host's physical cores (or those of the bound NUMA node): "
        "at the study's tile on a 2-vCPU EPYC one intra-op thread took 26.8 s a step against 21.0 s with two "
        "(docs/results/performance.md, 'On the EPYC').",
    )
    inter_op_threads: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Ops run side by side by a multi-worker job (or a single-host one with inline_ops off); "
        "null = chosen for the host: TensorFlow's default pool of 2 took 23.5 s a step at the tile against "
        "21.0 s with the ops inline (docs/results/performance.md, 'On the EPYC').",
    )
    inline_ops: bool = Field(
        True,
        description="Run a single-host job's ops in the calling thread (TensorFlow's inter-op parallelism -1): "
        "with an inter-op pool the study's tile peaked at 10.20, 10.26 and 11.66 GiB in three runs, inline at "
        "10.64 GiB (+-0.05 %) at the same step time (docs/design/planner.md, 'One op at a time'); a multi-worker job "
        "keeps its pool, which its collective ops need.",
    )
    precision: Literal["float32", "mixed_bfloat16"] = Field(
        "float32",
        description="'mixed_bfloat16' (Keras mixed precision) changes the arithmetic for speed and memory where "
        "the CPU has native bfloat16: at the study's tile on an AMX Xeon 0.57x the float32 step and 7,375 "
        "against 8,394 MiB (docs/results/performance.md, 'What each lever costs or saves').",
    )
    allocator: Literal["glibc", "jemalloc", "tcmalloc"] = Field(
        "tcmalloc",
        description="Memory allocator preloaded by the container entrypoint and the CLI's launcher "
        "(LD_PRELOAD): tcmalloc took 21.0 s a step at the tile and peaked at 10.7 GiB, glibc 31.5 s and "
        "11.5 GiB (docs/results/performance.md, 'On the EPYC'); the others are for hosts without it.",
    )
    tensor_allocator: Literal["system", "bfc"] = Field(
        "system",
        description="Where TensorFlow's oneDNN build puts tensors (TF_ONEDNN_USE_SYSTEM_ALLOCATOR): 'system' "
        "hands them to the allocator above; TensorFlow's own 'bfc' pool fragments at scale (a 224x224x144 "
        "batch-3 job planned at 19.6 GiB grew past 23 GiB and was OOM-killed in 4 of 6 runs, 17.9 GiB with "
        "'system'; docs/design/planner.md), and is kept because calibration files record which one they were "
        "fitted with.",
    )
    onednn: bool = Field(
        True,
        description="oneDNN kernels (TF_ENABLE_ONEDNN_OPTS, set before TensorFlow is imported): stock "
        "TensorFlow turns them on only for CPUs with AVX512_VNNI/BF16 or AMX, and on AVX2 runs Eigen's "
        "convolutions, 3-4x slower for this model (docs/design/performance.md, 'The runtime around the ops').",
    )
    numa_policy: Literal["auto", "bind", "interleave", "none"] = Field(
        "auto",
        description="NUMA placement: 'auto' binds to one node when the job fits it (its memory and cores "
        "local), else interleaves, since a footprint larger than one node fills it and the kernel reclaims or "
        "kills; not measured on a multi-node host yet (docs/design/planner.md, NUMA placement).",
    )


class FootprintConfig(_Section):
    """Memory target: size the job to it and check the measured peak against it."""

    target: str | None = Field(
        None,
        description="Target peak memory ('1TiB', '900GB', '80%' of the host); null = no target. The planner "
        "sizes the job to it and the verdict checks the measured peak against it (docs/design/planner.md, sizing).",
    )
    tolerance: float = Field(
        0.10,
        gt=0.0,
        lt=1.0,
        description="Allowed relative distance of the measured peak from the target: the same job's peak parts "
        "from run to run by up to a tenth for large plain jobs (176x176x128 batch 3: 11.150 to 12.335 GiB in three "
        "runs, docs/results/planner-accuracy.md). The plan criterion has its own bounds: a run may end at most "
        "3 % above its plan (docs/design/planner.md, "
        '"The plan is an envelope").',
    )
    safety_margin: float = Field(
        0.10,
        ge=0.0,
        lt=1.0,
        description="Share of the host's available memory (MemAvailable) kept free when deciding whether a plan "
        "fits, for the OS and everything else on the host. Under a cgroup limit (a scheduler's --mem, docker "
        "--memory: the job's own allowance) a plan fits up to the limit x guard.threshold / 1.03, so a run "
        "that ends 3 % above its plan (none of the 78 scored runs did more; docs/results/planner-accuracy.md) "
        "stays under the point where the memory guard stops it (docs/guides/slurm.md).",
    )
    resize: Literal["batch", "shape", "both"] = Field(
        "both",
        description="What the planner may change to reach the target: one sample of the study's tile is "
        "about 9 GiB, so batch alone may land far from a target that a shape meets (docs/design/planner.md).",
    )
    levers: Literal["off", "auto"] = Field(
        "off",
        description="'auto': when the job as configured misses its target (or the host's memory), apply the "
        "cheapest lever that keeps its batch and shape before resizing: gradient recomputation held the "
        "study's tile at 7,686 against 8,394 MiB for 1.47x the step on an AMX Xeon (docs/results/performance.md, "
        "'What each lever costs or saves'); 'off': only resize.",
    )

    @field_validator("levers", mode="before")
    @classmethod
    def _levers_off_is_not_a_boolean(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false (and `on` as true): take them as the words they were.
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("target")
    @classmethod
    def _check_target(cls, value: str | None) -> str | None:
        if value is not None:
            _check_size_text(value, "a memory target")
        return value


class GuardConfig(_Section):
    """The memory guard: stop cleanly (checkpoint, exit 3) before the kernel's OOM killer ends the run.

    Measured memory is the run's cgroup working set (RSS without a memory cgroup); usable memory is the
    cgroup limit in force, or without one what the host has left for the process.
    """

    # Watch memory while training and stop at a step boundary when it runs short.
    enabled: bool = True
    # Stop when measured memory passes this share of usable memory.
    threshold: float = Field(0.97, gt=0.0, le=1.0)
    # Also stop when measured memory passes the planned peak by more than footprint.tolerance and less than
    # this share of usable memory is left.
    room: float = Field(0.10, ge=0.0, lt=1.0)


class ValidationConfig(_Section):
    """What a passing run must show."""

    # Best validation Dice must reach this floor.
    dice_floor: float = Field(0.5, ge=0.0, le=1.0)
    # "hard": Dice of the thresholded segmentation (what a reader of the mask sees);
    # "soft": Dice of the probabilities (the study's training metric, lower while the net is unsure).
    dice_metric: Literal["hard", "soft"] = "hard"
    # The training loss of the last epoch must be below that of the first.
    require_loss_decrease: bool = True


class OutputConfig(_Section):
    """Where results go."""

    # Folder holding run directories (and the synthetic dataset of the default run).
    results_dir: Path = Path("results")
    # Run directory name; null = timestamped. An existing unfinished run with this name is resumed.
    run_name: str | None = None
    # Write TensorBoard logs.
    tensorboard: bool = True
    # Memory sampler period in seconds.
    sample_interval: float = Field(0.25, gt=0.0, le=60.0)

    @field_validator("run_name")
    @classmethod
    def _check_run_name(cls, value: str | None) -> str | None:
        if value is not None and (not value or "/" in value or value in {".", ".."}):
            raise ValueError(f"run_name must be a plain folder name, got {value!r}")
        return value


class Config(_Section):
    """A whole training job."""

    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    footprint: FootprintConfig = Field(default_factory=FootprintConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @property
    def runs_ops_inline(self) -> bool:
        """Whether TensorFlow runs this job's ops one at a time in the calling thread (runtime.inline_ops):
        a single-host job; a multi-worker one keeps its inter-op pool, which its collective ops need."""
        return self.runtime.inline_ops and self.training.strategy == "single"

    @property
    def synchronized_batch_norm(self) -> bool:
        """Whether batch normalization takes its statistics over the global batch of all workers (a
        multi-worker job): Keras' own layer then, not the fused kernel (norm.py), and planned as such."""
        return self.training.strategy == "multi_worker"

    @model_validator(mode="after")
    def _check_cross_fields(self) -> Config:
        divisor = 2**self.model.depth
        for name, shape in (("data.input_shape", self.data.input_shape),):
            bad = [edge for edge in shape if edge % divisor]
            if bad:
                raise ValueError(
                    f"{name} {list(shape)}: every edge must be divisible by 2**model.depth = {divisor}"
                )
        if self.data.label_mode == "binary" and self.model.output_classes != 1:
            raise ValueError("model.output_classes must be 1 when data.label_mode is 'binary'")
        if self.data.label_mode == "multiclass" and self.model.output_classes < 2:
            raise ValueError("model.output_classes must be >= 2 when data.label_mode is 'multiclass'")
        if (
            self.data.source == "synthetic"
            and self.data.label_mode == "multiclass"
            and self.model.output_classes < 4
        ):
            raise ValueError(
                "model.output_classes must be >= 4 for the synthetic dataset's multiclass labels (0..3: background, "
                "edema, non-enhancing and enhancing tumour)"
            )
        return self

    # Derived values, computed in one place.
    @property
    def num_channels(self) -> int:
        """Input channels; "all" means the four MSD Task01 contrasts unless the data says otherwise."""
        return 4 if self.data.channels == "all" else len(self.data.channels)

    @property
    def voxels_per_sample(self) -> int:
        x, y, z = self.data.input_shape
        return x * y * z

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# Keys that were removed by the knob review (issue 37): an old config that sets one is refused (exit 2)
# saying so, not as a typo.
REMOVED_KEYS = {
    "runtime.release_between_epochs": "its one gain, 20.40 -> 19.68 GiB in one run, is the run-to-run "
    "parting of one tensor, and the sweep's 2-12 GiB jobs peaked 3-9 % higher with it",
    "runtime.python_gc": "the collector at step ends left the same 9 % run-to-run spread as Python's own",
    "runtime.heap_limit": "held to its plan the tile peaked at 3.90 and 4.27 GiB against 3.87-4.48 "
    "unheld, and an allocation refused inside a kernel ended the run with a segmentation fault",
    "runtime.xla": "XLA's CPU convolutions are Eigen's, not oneDNN's, and it was slower where measured",
}


def _closest_key(location: tuple) -> str:
    """`` (did you mean 'training.epochs'?)`` for an unknown key, from the keys of its section; else
    `` (typo?)``."""
    section: type[BaseModel] = Config
    for part in location[:-1]:
        field = section.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return " (typo?)"
        section = annotation
    close = difflib.get_close_matches(str(location[-1]), list(section.model_fields), n=1)
    if not close:
        return (
            f" (the keys of {'.'.join(map(str, location[:-1])) or 'the top level'}: docs/reference/config.md)"
        )
    return f" (did you mean {'.'.join([*map(str, location[:-1]), close[0]])!r}?)"


def _format_error(error: ValidationError) -> str:
    """One line naming the field: ``training.batch_size: Input should be greater than or equal to 1``."""
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        removed = REMOVED_KEYS.get(location)
        message = f"removed ({removed}); delete it" if removed else f"unknown key{_closest_key(first['loc'])}"
    extra = f" (and {len(error.errors()) - 1} more)" if len(error.errors()) > 1 else ""
    return f"config {location or '<root>'}: {message}{extra}" if location else f"config: {message}{extra}"


def config_from_dict(
    raw: dict[str, Any] | None, source: str = "config", overrides: dict[str, str] | None = None
) -> Config:
    """Validate a mapping into a :class:`Config`, raising :class:`BadInput` with one line.

    ``overrides`` maps each dotted key set on the command line to how it was given (``--set
    training.epochs=0``, ``--run-name x``): an error in such a key names that, not the file; an error
    of the whole config (a rule across keys) names the file and every override.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadInput(f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}")
    try:
        return Config.model_validate(raw)
    except ValidationError as error:
        overrides = overrides or {}
        location = ".".join(str(part) for part in error.errors()[0]["loc"])
        given = [text for key, text in overrides.items() if location == key or location.startswith(f"{key}.")]
        # A rule of a section (or of the whole config) may be broken by overrides of its keys.
        within = [text for key, text in overrides.items() if not location or key.startswith(f"{location}.")]
        if given:
            source = given[0]
        elif within:
            source = f"{source} with {' '.join(within)}"
        raise BadInput(f"{source}: {_format_error(error)}") from None


PRESETS_DIR = Path(__file__).parent / "presets"


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one mapping (YAML 1.2 requires keys to be unique; PyYAML keeps the last)."""

    def __init__(self, key: Any, first_line: int, second_line: int):
        super().__init__(f"key {key!r} is given twice in one mapping (lines {first_line} and {second_line})")
        self.key, self.first_line, self.second_line = key, first_line, second_line


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping, as strict YAML loaders do.

    Keys brought in by a merge (``<<: *defaults``) may be overridden, as YAML's merge key allows.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise DuplicateKeyError(key, first, line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """Parse YAML with :class:`StrictLoader` (safe, duplicate keys refused)."""
    return yaml.load(text, Loader=StrictLoader)


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    origins: dict[str, str] | None = None,
) -> Config:
    """Load a YAML config (the built-in default preset when ``path`` is None), apply dotted overrides.

    ``path`` may also name a preset: ``default`` or ``study``. ``origins`` says how an override was
    given (``{"output.run_name": "--run-name x"}``) for the error that names it; an override without
    one is named as ``--set key=value``.
    """
    raw: dict[str, Any] = {}
    if path is None:
        path = PRESETS_DIR / "default.yaml"
    elif not Path(path).exists() and (PRESETS_DIR / f"{path}.yaml").is_file():
        path = PRESETS_DIR / f"{path}.yaml"
    file = Path(path)
    # A preset is named as the user asked for it, not by where the package is installed.
    source = f"preset {file.stem}" if file.parent == PRESETS_DIR else str(path)
    if file.is_dir():
        raise BadInput(f"config file {source} is a folder; name a YAML file (or a preset: default, study)")
    if not file.is_file():
        raise BadInput(f"config file {source} does not exist")
    try:
        raw = load_yaml(file.read_text()) or {}
    except DuplicateKeyError as error:
        raise BadInput(f"config file {source}: {error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise BadInput(f"config file {source} is not valid YAML{where}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"config file {source} cannot be read: {error}") from None
    for dotted, value in (overrides or {}).items():
        set_dotted(raw, dotted, value)
    given = {
        dotted: (origins or {}).get(dotted, f"--set {dotted}={_override_text(value)}")
        for dotted, value in (overrides or {}).items()
    }
    return config_from_dict(raw, source, given)


def _override_text(value: Any) -> str:
    """An override's value as it would be typed: YAML flow style, one line."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``raw["a"]["b"] = value`` for ``dotted == "a.b"``."""
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise BadInput(f"config {dotted}: {part} is not a section")
        node = child
    node[leaf] = value


def parse_override(text: str, flag: str = "--set", example: str = "training.epochs=3") -> tuple[str, Any]:
    """``--set training.epochs=3`` -> ("training.epochs", 3), the value parsed as YAML; ``flag`` and
    ``example`` name the option in the error (``--var``, ``epochs=3``)."""
    if "=" not in text:
        raise BadInput(f"{flag} {text!r}: expected KEY=VALUE, e.g. {example}")
    key, value = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError:
        raise BadInput(f"{flag} {text!r}: value is not valid YAML") from None
