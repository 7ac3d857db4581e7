"""The recipe's typed schema. OmegaConf checks names and types; `problems()` checks values.

Each section is handed only to the component that owns it. Cross-field checks
return every problem instead of raising on the first, so that a user sees all of
them at once; the loader prefixes each with the file and line it came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from launcher.errors import short
from launcher.recipe.checks import at_least, devices_valid, int64_problems, positive, target_problems
from launcher.recipe.fault_tolerance import FaultToleranceConfig, FaultToleranceTimeouts  # noqa: F401 (its keys' type)
from launcher.recipe.ranks import DDPConfig, FSDPConfig, ParallelConfig
from launcher.recipe.slurm_options import SlurmConfig

STRATEGIES = ("auto", "single", "dp", "ddp", "fsdp", "accelerate")
CONSOLIDATE = ("final", "every", "never")
WANDB_MODES = ("online", "offline")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
START_METHODS = ("fork", "forkserver", "spawn")  # how a DataLoader's workers may start (multiprocessing's)
MAX_WORKERS = 256  # loader processes per rank: more is a typo, and would fork until the system refuses
DEVICES_HELP = "auto, cpu, cuda, cuda:N, auto:N (N free GPUs) or a list of physical GPU ids such as [0, 3]"

Target = Dict[str, Any]  # {_target_: dotted.path, _partial_: false, **kwargs}
TARGETS = ("model", "loss", "step", "optimizer", "lr_schedule")  # the Recipe's top-level components


@dataclass
class DataConfig:
    train: Target = MISSING  # a map-style Dataset (__getitem__, __len__) or a stream (an IterableDataset)
    val: Optional[Target] = None  # the same kinds; evaluated every trainer.eval_every steps and at the end
    batch_size: int = 64  # global, per forward/backward; x grad_accum_steps per optimizer step
    num_workers: int = 0  # DataLoader worker processes per rank (0: load in the training process)
    persistent_workers: bool = True  # with workers: kept between epochs and evaluations, not started again
    prefetch_factor: Optional[int] = None  # with workers: batches each makes ahead; null: torch's default (2)
    pin_memory: Optional[bool] = None  # page-locked batches, copied to a GPU asynchronously; null: on CUDA
    multiprocessing_context: Optional[str] = None  # with workers: fork, forkserver or spawn; null: fork, or forkserver under torch.distributed before Python 3.12
    shuffle: bool = True  # a new permutation each epoch (seed + epoch); map-style data only
    tokens_per_sample: Optional[int] = None  # turns samples/s into tokens/s in the logs
    collate: Optional[Target] = None  # collate(list of items) -> batch, e.g. padding; null: torch's default_collate

    def problems(self) -> List[tuple[str, str]]:
        out = target_problems("data.train", self.train) + target_problems("data.val", self.val)
        out += target_problems("data.collate", self.collate)
        out += at_least("data.batch_size", self.batch_size, 1)
        out += at_least("data.num_workers", self.num_workers, 0)
        if self.num_workers > MAX_WORKERS:
            out.append(("data.num_workers", f"at most {MAX_WORKERS} loader processes per rank, got {self.num_workers}"))
        out += at_least("data.tokens_per_sample", self.tokens_per_sample, 1)
        out += at_least("data.prefetch_factor", self.prefetch_factor, 1)
        if self.prefetch_factor is not None and self.num_workers == 0:
            out.append(("data.prefetch_factor", "is what each loader worker makes ahead, and data.num_workers is 0; "
                                                "set data.num_workers, or leave prefetch_factor null"))
        if self.multiprocessing_context not in (None, *START_METHODS):
            out.append(("data.multiprocessing_context", f"is how loader workers start: one of {', '.join(START_METHODS)} "
                                                        f"or null, got {self.multiprocessing_context!r}"))
        elif self.multiprocessing_context is not None and self.num_workers == 0:
            out.append(("data.multiprocessing_context", "is how loader workers start, and data.num_workers is 0; "
                                                        "set data.num_workers, or leave multiprocessing_context null"))
        return out


@dataclass
class TrainerConfig:
    max_steps: Optional[int] = None  # optimizer steps to train; a stream needs it
    max_epochs: Optional[int] = None  # epochs to train (whichever of the two ends first); map-style data only
    grad_accum_steps: int = 1  # micro-batches per optimizer step, each of data.batch_size
    clip_grad_norm: Optional[float] = None  # clip the gradients' global norm (over every shard) to this; null: none
    log_every: int = 50  # optimizer steps between two log lines (and the only host reads of the loop)
    eval_every: Optional[int] = None  # steps between evaluations (one at the end too); null: at the end only
    compile: bool = False  # torch.compile the (wrapped) model; checkpoints keep the plain model's keys
    activation_checkpointing: Any = None  # [class names] recomputed in backward; auto: the model's blocks; null: none
    loss_chunk: Optional[int] = None  # tokens a chunk of a causal LM's output layer and loss; null or 0: all at once

    def problems(self) -> List[tuple[str, str]]:
        out = []
        if self.max_steps is None and self.max_epochs is None:
            out.append(("trainer.max_steps", "set trainer.max_steps or trainer.max_epochs (or both)"))
        out += at_least("trainer.max_steps", self.max_steps, 1)
        out += at_least("trainer.max_epochs", self.max_epochs, 1)
        out += at_least("trainer.grad_accum_steps", self.grad_accum_steps, 1)
        out += at_least("trainer.log_every", self.log_every, 1)
        out += at_least("trainer.eval_every", self.eval_every, 1)
        out += at_least("trainer.loss_chunk", self.loss_chunk, 0)
        if self.clip_grad_norm is not None and not positive(self.clip_grad_norm):
            out.append(("trainer.clip_grad_norm", f"must be a positive number or null, got {self.clip_grad_norm}"))
        names = self.activation_checkpointing
        named = isinstance(names, list) and all(isinstance(n, str) and n for n in names)
        if names not in (None, "auto") and not named:
            out.append(("trainer.activation_checkpointing", f"must be a list of class names ([Block]), auto (the "
                                                            f"model's repeated blocks) or null, got {short(names)}"))
        return out


@dataclass
class CheckpointConfig:
    every: Optional[int] = 500  # optimizer steps between saves; null: only the final save
    keep: int = 3  # complete checkpoints kept (the newest is never deleted)
    resume: str = "auto"  # auto | never | <path of a checkpoint folder>
    init_from: Optional[str] = None  # a model state_dict file or a checkpoint folder; wrapper prefixes accepted
    on_signal: bool = True  # SIGTERM, Ctrl-C, Slurm's SIGUSR1: save at the next step boundary, then stop
    consolidate: str = "final"  # sharded runs: gather model.pt at the end (final), at every save (every), or never
    async_save: bool = False  # stage a checkpoint in host memory and write it while training goes on
    export_hf: bool = False  # an HF model: also write <run_dir>/hf/ at the end, a folder from_pretrained loads
    dir: Optional[str] = None  # where checkpoints go: null (<run_dir>/checkpoints), a folder, or s3://bucket/prefix

    def problems(self) -> List[tuple[str, str]]:
        out = at_least("checkpoint.every", self.every, 1) + at_least("checkpoint.keep", self.keep, 1)
        if self.consolidate not in CONSOLIDATE:
            out.append(("checkpoint.consolidate", f"got {short(self.consolidate)}; valid: {', '.join(CONSOLIDATE)}"))
        return out


@dataclass
class ProfileConfig:
    """A torch.profiler window: steps at_step .. at_step+steps-1 on the listed ranks, to <run_dir>/profile/."""

    at_step: Optional[int] = None  # the first step recorded; null: no profile
    steps: int = 3  # optimizer steps in the profiler's window
    ranks: List[int] = field(default_factory=lambda: [0])  # global ranks that record

    def problems(self) -> List[tuple[str, str]]:
        out = at_least("profile.at_step", self.at_step, 1) + at_least("profile.steps", self.steps, 1)
        if not self.ranks or any(r < 0 for r in self.ranks):
            out.append(("profile.ranks", f"must be a non-empty list of global ranks (0, 1, ...), got {short(self.ranks)}"))
        return out


@dataclass
class MemorySnapshotConfig:
    """CUDA's allocator history over steps at_step .. at_step+steps-1, dumped to <run_dir>/memory/."""

    at_step: Optional[int] = None  # the first step recorded; null: no snapshot
    steps: int = 3  # optimizer steps whose allocations the snapshot records

    def problems(self) -> List[tuple[str, str]]:
        return at_least("memory_snapshot.at_step", self.at_step, 1) + at_least("memory_snapshot.steps", self.steps, 1)


@dataclass
class MLflowConfig:
    tracking_uri: Optional[str] = None  # default: MLFLOW_TRACKING_URI, else file:./mlruns
    experiment: Optional[str] = None  # default: the recipe's name
    run_name: Optional[str] = None  # default: the recipe's name


@dataclass
class WandbConfig:
    project: Optional[str] = None  # default: the recipe's name
    entity: Optional[str] = None  # default: your wandb default entity
    mode: str = "online"  # online | offline (wandb sync uploads it later)
    run_name: Optional[str] = None  # default: the recipe's name
    group: Optional[str] = None  # runs shown together (a sweep sets its name); null: none


@dataclass
class LoggingConfig:
    tensorboard: bool = True  # <run_dir>/tensorboard
    mlflow: Optional[MLflowConfig] = None  # {} for the defaults (pip install 'launcher[mlflow]')
    wandb: Optional[WandbConfig] = None  # {} for the defaults (pip install 'launcher[wandb]')
    jsonl: bool = False  # <run_dir>/metrics.jsonl, one JSON object per log step; config.json, the recipe with what ran
    progress_bar: bool = True  # a tqdm bar when stderr is a terminal; otherwise one line per log interval
    peak_tflops: Optional[float] = None  # one device's peak, for MFU; default: a known GPU's dense bf16 peak
    memory_plan: Any = True  # true: rank 0 plans its layout's peak memory beside training (python -m launcher.plan), said with the measured peak if ready by the end; wait: waits for it; false: none

    def problems(self) -> List[tuple[str, str]]:
        out = []
        if self.peak_tflops is not None and not positive(self.peak_tflops):
            out.append(("logging.peak_tflops", f"must be a positive number of TFLOP/s or null, got {self.peak_tflops}"))
        if self.memory_plan not in (True, False, "wait"):
            out.append(("logging.memory_plan", f"must be true, false or wait, got {short(self.memory_plan)}"))
        if self.wandb is not None and self.wandb.mode not in WANDB_MODES:
            out.append(("logging.wandb.mode", f"got {short(self.wandb.mode)}; valid: {', '.join(WANDB_MODES)}"))
        return out


@dataclass
class Recipe:
    name: str = MISSING  # the run's name: its folder's and the trackers' (letters, digits, . _ -)
    run_dir: str = "runs/${name}"  # where the run's checkpoints, model.pt, logs and trackers' files go
    seed: int = 0  # seeds the model's initialisation, the data order and every RNG
    strategy: str = "auto"  # auto | single | dp | ddp | fsdp | accelerate; auto: by how the run started
    devices: Any = "auto"  # auto | auto:N | cpu | cuda | cuda:N | [ids]; auto: the GPUs, else the CPU
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16 with a grad scaler, CUDA only) | fp8 (torchao, GPUs with fp8)
    tf32: Optional[bool] = None  # CUDA fp32 matmuls and convolutions in TF32: true (faster, 10-bit mantissa), false (fp32); null: torch's (convolutions only)
    nproc_per_node: Optional[int] = None  # strategy=ddp outside torchrun: workers to start (default: one per GPU)
    dist_timeout: int = 600  # seconds a collective may wait for the other ranks before every rank stops (exit 6)
    model: Target = MISSING  # the model: any nn.Module built from _target_ and its arguments
    loss: Optional[Target] = None  # loss(output, target); null: the model computes its own loss
    step: Optional[Target] = None  # step(model, batch) -> loss | {loss, num_items, output, target}; null: the default
    optimizer: Target = MISSING  # the launcher passes the parameters
    lr_schedule: Optional[Target] = None  # the launcher passes the optimizer; stepped per optimizer step
    metrics: Dict[str, Target] = field(default_factory=dict)  # name -> callable(output, target) -> per-item values
    data: DataConfig = field(default_factory=DataConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    memory_snapshot: MemorySnapshotConfig = field(default_factory=MemorySnapshotConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    fault_tolerance: Optional[FaultToleranceConfig] = None  # replica groups that train on when one dies (torchft; python -m launcher.ft); null: none
    on_cpu: Optional[Dict[str, Any]] = None  # keys that apply when the run has no GPU (a smaller model, fp32)

    def problems(self) -> List[tuple[str, str]]:
        """Every value-level problem as (key, message); empty when the recipe is valid."""
        sections = {"": self, "data.": self.data, "ddp.": self.ddp, "fsdp.": self.fsdp, "parallel.": self.parallel,
                    "trainer.": self.trainer,
                    "checkpoint.": self.checkpoint, "logging.": self.logging, "profile.": self.profile,
                    "memory_snapshot.": self.memory_snapshot, "slurm.": self.slurm}
        if self.fault_tolerance is not None:
            sections["fault_tolerance."] = self.fault_tolerance
        huge = [p for prefix, section in sections.items() for p in int64_problems(prefix, section)]
        out = []
        if self.strategy not in STRATEGIES:
            out.append(("strategy", f"got {short(self.strategy)}; valid: {', '.join(STRATEGIES)}"))
        if self.precision not in PRECISIONS:
            out.append(("precision", f"got {short(self.precision)}; valid: {', '.join(PRECISIONS)}"))
        if not devices_valid(self.devices):
            out.append(("devices", f"got {short(self.devices)}; valid: {DEVICES_HELP}"))
        if not re.fullmatch(r"[\w.\-]+", self.name) or self.name in (".", "..") or len(self.name.encode()) > 255:
            out.append(("name", f"got {short(self.name)}; use up to 255 letters, digits, '.', '_' or '-' (it names "
                                f"the run folder)"))
        out += at_least("nproc_per_node", self.nproc_per_node, 1) + at_least("dist_timeout", self.dist_timeout, 1)
        for key in TARGETS:
            out += target_problems(key, getattr(self, key))
        for metric, spec in self.metrics.items():
            out += target_problems(f"metrics.{metric}", spec)
        if self.parallel.pp > 1 and self.trainer.compile:
            out.append(("trainer.compile", "compiles the model that one call runs, and parallel.pp runs it stage by "
                                           "stage through a schedule; set trainer.compile=false with parallel.pp"))
        if self.trainer.loss_chunk and (self.parallel.tp > 1 or self.parallel.pp > 1):
            out.append(("trainer.loss_chunk", "is not built with parallel.tp or parallel.pp yet (the output layer split "
                                              "over ranks, or on the last stage); set trainer.loss_chunk=null"))
        if self.parallel.cp > 1 and self.trainer.compile:
            out.append(("trainer.compile", "is not built with parallel.cp yet (the split's attention changes with each "
                                           "batch, which a compiled model would recompile for); set "
                                           "trainer.compile=false with parallel.cp"))
        for key in ("tp", "dp_replicate", "pp", "ep", "cp"):
            if getattr(self.parallel, key) > 1 and self.strategy != "fsdp":
                out.append((f"parallel.{key}", f"lays ranks out on a device mesh under strategy fsdp, and the strategy is "
                                               f"{short(self.strategy)}; set strategy=fsdp, or parallel.{key}=1"))
        for section in (self.data, self.ddp, self.fsdp, self.parallel, self.trainer, self.checkpoint, self.logging, self.profile,
                        self.memory_snapshot, self.slurm):
            out += section.problems()
        if self.fault_tolerance is not None:
            out += self.fault_tolerance.problems(self.strategy, self.dist_timeout, self.parallel.pp)
        # A value past 64 bits is reported once, not again by the range checks of its own key.
        return huge + [p for p in out if p[0] not in {key for key, _ in huge}]
