"""The `zerotrain train` config: one YAML file with six sections, validated before anything starts.

    model     which network: a local Hugging Face directory, a config.json, or a named architecture
    data      which text: files (text, jsonl, parquet, arrow) or a generated task
    training  batch sizes, steps, optimizer and schedule settings, precision, eval/save cadence
    zero      the DeepSpeed config: a mapping, or a path to a JSON/JSONC/YAML DeepSpeed file
    logging   console, CSV, TensorBoard and Weights & Biases
    output    the run directory and what is kept there

``load_train_config`` reads a file, merges the files its ``inherit`` list names, applies
``--section.key VALUE`` overrides, validates the result (unknown keys and wrong types are
errors naming the dotted key, with "did you mean") and lets ``training`` adopt values the
DeepSpeed section sets (see ``zerotrain.train.zero_fill``).  Each field's docstring below is
its documentation.

Paths in ``inherit`` and a ``zero`` file path are relative to the file that names them;
paths in ``model``, ``data`` and ``output`` are relative to the working directory.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator, model_validator

from zerotrain.config.errors import ConfigError, describe_validation_error, render_value
from zerotrain.config.loader import read_config_file
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.config.schema_types import ConfigSection, NonNegativeFloat, NonNegativeInt, PositiveInt, config_problem
from zerotrain.system.durable_files import atomic_write_text
from zerotrain.train.config_paths import absolute_paths
from zerotrain.train.zero_section import validate_zero_section, zero_section_problems

DEFAULT_CONFIG_PATH = Path(__file__).with_name("default_config.yaml")
"""What `zerotrain train` runs without a CONFIG (and `make demo`)."""
CONFIG_FILE_NAME = "config.yaml"
MODEL_SOURCES = ("path", "config", "architecture")
_WRITTEN_HEADER = (
    "# The merged, validated config of this run (defaults filled in).\n"
    "# Run it again with: zerotrain train <this file> [--resume]\n"
)


class ModelSection(ConfigSection):
    """Which network to train: exactly one of ``path``, ``config`` or ``architecture``."""

    path: str | None = None
    """A local Hugging Face model directory (config.json and weights): fine-tune those weights."""
    config: str | None = None
    """A local config.json, or a directory holding one: train that architecture from scratch."""
    architecture: str | None = None
    """A model type ("llama", "mistral", "gpt2", ...) built with AutoConfig.for_model: train from scratch."""
    config_overrides: dict[str, Any] = {}
    """Config values to change (hidden_size, num_hidden_layers, ...).  Without vocab_size here, a model
    built from ``config`` or ``architecture`` takes its vocabulary size from the tokenizer."""
    trust_remote_code: bool = False
    """Let model code shipped inside the model directory run."""
    tokenizer: str | None = None
    """A tokenizer directory, or "byte" for the built-in byte-level tokenizer.  Unset: the model
    directory's tokenizer when it has one, else byte-level."""

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "ModelSection":
        chosen = [key for key in MODEL_SOURCES if getattr(self, key) is not None]
        if not chosen:
            raise config_problem(
                "set one of path (a local Hugging Face model directory), config (a config.json) "
                'or architecture (a model type such as "llama")'
            )
        if len(chosen) > 1:
            raise config_problem(
                f"{' and '.join(chosen)} are {'both' if len(chosen) == 2 else 'all'} set, but a model comes from "
                "exactly one of them: keep one "
                "(a later file or a --model.<key> flag replaces the others; within one file set the others to null)"
            )
        return self


class SyntheticSection(ConfigSection):
    """A generated task (``data.format: synthetic``): no files needed."""

    task: str = "arithmetic"
    """Which task to generate, e.g. "arithmetic"."""
    num_examples: PositiveInt = 20000
    """Examples generated (the evaluation split is taken from them)."""
    seed: int = 0
    """Seed of the generator: the same seed gives the same examples."""


class DataSection(ConfigSection):
    """The training (and evaluation) text."""

    path: str | None = None
    """A file, a directory of files, or a glob; unset only with format "synthetic"."""
    format: Literal["auto", "text", "jsonl", "parquet", "arrow", "synthetic"] = "auto"
    """How to read ``path``; "auto" goes by the file suffix."""
    text_field: str = "text"
    """The field holding plain text in jsonl/parquet/arrow records."""
    prompt_field: str = "prompt"
    """The prompt field of prompt/response records (loss on the response only)."""
    response_field: str = "response"
    """The response field of prompt/response records."""
    seq_len: PositiveInt = 256
    """Tokens per training sequence."""
    eval_path: str | None = None
    """Separate evaluation data; unset: ``eval_fraction`` of the training data is held out."""
    eval_fraction: float = Field(0.05, ge=0, lt=1)
    """Fraction of the training data held out for evaluation when ``eval_path`` is unset (0 = none)."""
    seed: int = 0
    """Seed for the split and the shuffling of the training data."""
    cache_dir: str | None = None
    """Where tokenized data is cached; unset: $ZEROTRAIN_CACHE/data, else ~/.cache/zerotrain/data."""
    synthetic: SyntheticSection = Field(default_factory=SyntheticSection)
    """Settings of the generated task (format "synthetic")."""


class TrainingSection(ConfigSection):
    """The optimization: the DeepSpeed section's "auto" values are filled from these."""

    micro_batch_size: PositiveInt = 8
    """Sequences per forward/backward on each process (DeepSpeed: train_micro_batch_size_per_gpu)."""
    gradient_accumulation_steps: PositiveInt = 1
    """Micro-batches per optimizer step."""
    max_steps: PositiveInt | None = None
    """Optimizer steps to train; unset: ``epochs`` passes over the data."""
    epochs: float = Field(1.0, gt=0)
    """Passes over the training data when ``max_steps`` is unset (fractions allowed)."""
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate (AdamW)."""
    min_lr: NonNegativeFloat = 0.0
    """Learning rate at the end of the cosine schedule."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW decoupled weight decay (not applied to biases and norm weights)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW beta1, beta2."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    warmup_steps: NonNegativeInt = 0
    """Steps of linear warmup from 0 to ``lr``."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """After warmup: cosine decay to ``min_lr``, linear decay to 0, or constant."""
    grad_clip: NonNegativeFloat = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Training precision; "auto": bf16 on a GPU that supports it, else fp32."""
    gradient_checkpointing: bool | Literal["selective"] = False
    """Recompute activations in backward to save memory: true recomputes each decoder layer whole
    (keeps only its input); "selective" keeps the layer's matmul and attention outputs and
    recomputes the rest (norms, activations, rotary: most of the tensors, few of the FLOPs)."""
    loss_chunk_tokens: PositiveInt | None = None
    """Compute the LM head and the loss this many tokens at a time, recomputing each chunk's logits
    in backward, so the full fp32 logits (4 bytes x tokens x vocabulary) never exist at once.
    None: the model's own loss. Llama, Mistral, Qwen2/3 and GPT-2 heads only."""
    tiled_mlp: bool | PositiveInt = False
    """Run each decoder layer's MLP this many tokens at a time, recomputed tile by tile in backward
    (DeepSpeed's TiledMLP); true: DeepSpeed's ceil(sequence length / hidden size) tiles. Long sequences."""
    offload_activations: bool = False
    """Keep each checkpointed layer's input in CPU memory until its recompute (pinned, asynchronous
    on a GPU); needs gradient_checkpointing. The DeepSpeed section's activation_checkpointing.cpu_checkpointing."""
    sequence_parallel_size: PositiveInt = 1
    """Ulysses sequence parallelism: this many consecutive ranks share each sequence, each holding 1/N
    of it, for sequences too long for one GPU. N divides the process count, data.seq_len and the
    attention heads; batch sizes count sequence groups (processes / N). The DeepSpeed section's key."""
    compile: bool = False
    """torch.compile (inductor) each decoder layer and the loss, ZeRO's hooks outside the graph: the
    DeepSpeed section's compile.enabled (its compile.backend and compile.kwargs apply)."""
    seed: int = 42
    """Seed for model initialization and dropout."""
    eval_interval: NonNegativeInt = 100
    """Evaluate every this many steps (0 = never)."""
    eval_batches: PositiveInt | None = None
    """Micro-batches per evaluation; unset: the whole evaluation split."""
    save_interval: NonNegativeInt = 500
    """Checkpoint every this many steps (0 = only at the end)."""
    resume: str = "never"
    """"auto" (continue from the newest checkpoint in output.dir, if any), "never", or a checkpoint
    directory: zerotrain's, or a DeepSpeed run's save_checkpoint folder (or its global_stepN).
    `zerotrain train --resume` sets "auto", `--resume-from PATH` a directory."""
    hang_timeout: NonNegativeFloat = 600.0
    """Seconds a rank may wait for the others (a step, a collective) before the job stops with every
    rank's stack and the ranks that did not arrive named; 0: wait forever."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in betas):
            raise config_problem(f"got {render_value(list(betas))}, expected two numbers from 0 up to (not incl.) 1")
        return betas

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_switch(cls, value: Any) -> Any:
        # `--training.resume true` reads as a YAML boolean.
        return {True: "auto", False: "never"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _min_lr_below_lr(self) -> "TrainingSection":
        if self.min_lr > self.lr:
            raise config_problem(f"min_lr {self.min_lr} is above lr {self.lr}: lower min_lr")
        return self


class TensorBoardSection(ConfigSection):
    """TensorBoard event files."""

    enabled: bool = False
    """Write metrics as TensorBoard events."""
    dir: str | None = None
    """Where the events go; unset: <output.dir>/tensorboard."""


class WandbSection(ConfigSection):
    """Weights & Biases."""

    enabled: bool = False
    """Send metrics to Weights & Biases."""
    project: str | None = None
    """Project name; unset: wandb's default."""
    name: str | None = None
    """Run name; unset: wandb picks one."""
    mode: str | None = None
    """"online", "offline" or "disabled"; unset: wandb's default."""


class LoggingSection(ConfigSection):
    """What is reported while training."""

    interval: PositiveInt = 10
    """Log metrics every this many steps."""
    csv: bool = True
    """Write metrics to <output.dir>/metrics.csv."""
    progress_bar: bool = True
    """Show a progress bar in a terminal."""
    tensorboard: TensorBoardSection = Field(default_factory=TensorBoardSection)
    """TensorBoard logging."""
    wandb: WandbSection = Field(default_factory=WandbSection)
    """Weights & Biases logging."""
    compute_probe: str | None = None
    """A `zerotrain bench compute --json` file of this machine: the first timed steps are compared with
    the step-time model's prediction (a known GPU is predicted from its defaults without one)."""
    comm_probe: str | None = None
    """A `zerotrain bench comm --json` file of these nodes, for that prediction's collectives; without it
    a run across nodes assumes the GPU's usual inter-node link (25 GbE between CPU machines), and says
    so in RUN/predicted_step.json."""


class OutputSection(ConfigSection):
    """The run directory."""

    dir: str = "runs/train"
    """Run directory: config.yaml, metrics, checkpoints and the final model."""
    export_hf: bool = True
    """Save the final model as a Hugging Face directory (<dir>/hf) at the end."""
    save_final: bool = True
    """Checkpoint at the end of training. A benchmark run (`zerotrain bench run --workload`) sets
    false to skip writing the model and optimizer state; needs export_hf false (the export reads it)."""
    keep_checkpoints: PositiveInt | None = None
    """Keep only the newest this many checkpoints; unset: keep all."""

    @model_validator(mode="after")
    def _export_needs_the_final_checkpoint(self) -> "OutputSection":
        if self.export_hf and not self.save_final:
            raise ValueError("output.save_final is false but output.export_hf is true: the Hugging Face export "
                             "is made from the final checkpoint; set output.export_hf: false as well")
        return self


def default_zero() -> dict[str, Any]:
    """The DeepSpeed section when a config has none: ZeRO stage 2, everything else from ``training``."""
    return {"zero_optimization": {"stage": 2}}


class TrainConfig(ConfigSection):
    """A whole `zerotrain train` config."""

    inherit: list[str] = []
    """Files merged under this one, later ones winning (paths relative to this file); consumed while loading."""
    model: ModelSection
    """The network."""
    data: DataSection = Field(default_factory=DataSection)
    """The data."""
    training: TrainingSection = Field(default_factory=TrainingSection)
    """The optimization."""
    zero: dict[str, Any] = Field(default_factory=default_zero)
    """The DeepSpeed config ("auto" allowed), or a path to a JSON/JSONC/YAML DeepSpeed file.  Keys it leaves
    out that ``training`` covers are filled from ``training``."""
    logging: LoggingSection = Field(default_factory=LoggingSection)
    """Logging."""
    output: OutputSection = Field(default_factory=OutputSection)
    """The run directory."""

    _source: str | None = PrivateAttr(None)
    _notes: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _model_section_present(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("model") is None:
            raise config_problem(
                "the model section is missing: set model.path (a local Hugging Face model directory), "
                'model.config (a config.json) or model.architecture (e.g. "llama")'
            )
        return data

    @field_validator("zero", mode="before")
    @classmethod
    def _read_zero_file(cls, value: Any) -> Any:
        # load_train_config reads file paths relative to the YAML file; a path reaching this
        # point (a TrainConfig built in code) is relative to the working directory.
        return read_config_file(Path(value).expanduser()) if isinstance(value, (str, os.PathLike)) else value

    @property
    def source(self) -> str | None:
        """Where this config was read from (for messages), if from a file."""
        return self._source

    @property
    def notes(self) -> list[str]:
        """Values ``training`` took over from the DeepSpeed section while loading."""
        return list(self._notes)

    def as_dict(self) -> dict[str, Any]:
        """The config as plain data (YAML/JSON types), defaults filled, without ``inherit``."""
        return self.model_dump(mode="json", exclude={"inherit"})

    def zero_dict(self) -> dict[str, Any]:
        """A copy of the DeepSpeed section as written ("auto" values not yet filled); training.compile
        switches its compile.enabled on."""
        zero = copy.deepcopy(self.zero)
        if self.training.compile:
            zero["compile"] = {**(zero.get("compile") or {}), "enabled": True}
        return zero

    def zero_config(self) -> ZeroTrainConfig:
        """The DeepSpeed section validated ("auto" values not yet filled); ConfigError if invalid."""
        return validate_zero_section(self.zero, self.source)

    def write(self, run_dir: str | os.PathLike) -> Path:
        """Write the config to ``run_dir/config.yaml``, every path in it absolute (resolved from the
        folder the run was started in, as it was read), so the file runs from any folder."""
        target = Path(run_dir) / CONFIG_FILE_NAME
        target.parent.mkdir(parents=True, exist_ok=True)
        text = _WRITTEN_HEADER + yaml.safe_dump(absolute_paths(self.as_dict()), sort_keys=False, allow_unicode=True)
        # Ranks may read the file while rank 0 rewrites it: replace it atomically.
        atomic_write_text(target, text)
        return target


# --------------------------------------------------------------------------- #
# validation


def validate_train_config(data: Mapping[str, Any], origin: str | None = None) -> TrainConfig:
    """Validate merged config data, reporting the problems of every section (``zero`` included) together."""
    problems: list[str] = []
    cfg: TrainConfig | None = None
    try:
        cfg = TrainConfig.model_validate(dict(data))
    except ValidationError as error:
        problems.extend(describe_validation_error(error, TrainConfig).splitlines())
    if isinstance(data.get("zero"), Mapping):
        problems.extend(zero_section_problems(data["zero"]))
    if problems or cfg is None:
        where = f" in {origin}" if origin else ""
        raise ConfigError(f"invalid zerotrain train config{where}:\n" + "\n".join(f"  {p}" for p in problems))
    cfg._source = origin
    return cfg


def mark_user_set(section: BaseModel, keys: set[str]) -> None:
    """Record which keys of ``section`` count as set by the user (pydantic's ``model_fields_set``):
    a DeepSpeed value wins silently only over a training key the user did not set."""
    object.__setattr__(section, "__pydantic_fields_set__", set(keys) & set(type(section).model_fields))
