"""The recipe's sections for a run of several ranks: ddp (DistributedDataParallel's options), fsdp (FSDP2's) and
parallel (the device mesh: pipeline stages, replicas, shards, tensor parallel). Each goes to the strategy that
reads it; one process ignores them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from launcher.errors import short
from launcher.recipe.checks import at_least, positive

REDUCE_DTYPES = ("fp32", "bf16")
TP_STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "embedding_rowwise", "split_sequence",
             "sequence_parallel", "gather_sequence", "rowwise_seq", "heads_norm")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv")  # torch.distributed.pipelining's
PP_MULTI = ("interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv")  # schedules of several stages per rank
CP_IMPLS = ("auto", "ulysses", "ring")


@dataclass
class DDPConfig:
    """DistributedDataParallel's options, for strategy ddp and accelerate's DDP; one process ignores them."""

    find_unused_parameters: bool = False  # parameters that get no gradient in some step (an unused head)
    static_graph: bool = False  # the same parameters are used in every step: DDP can skip its per-step search
    gradient_as_bucket_view: bool = False  # gradients are views into the all-reduce buckets: less memory
    bucket_cap_mb: Optional[float] = None  # null: torch's default (25 MiB)
    sync_batchnorm: bool = False  # BatchNorm statistics over the global batch (SyncBatchNorm, CUDA only)

    def problems(self) -> List[tuple[str, str]]:
        cap = self.bucket_cap_mb
        if cap is not None and not (positive(cap) and cap < 2**43):  # DDP takes the cap in bytes, in 64 bits
            return [("ddp.bucket_cap_mb", f"must be a positive number of MiB below 2^43 or null, got {cap}")]
        return []


@dataclass
class FSDPConfig:
    """FSDP2's options (torch.distributed.fsdp.fully_shard), for strategy fsdp."""

    units: Optional[List[str]] = None  # class names sharded on their own, e.g. [Block]; null: the model's own
    # (_no_split_modules, as HF models name them), else the classes of the layers held in a ModuleList
    reshard_after_forward: bool = True  # free the gathered parameters after forward (less memory, one more gather)
    reduce_dtype: str = "fp32"  # gradients reduce-scattered in fp32 (default) or bf16; parameters follow precision
    cpu_offload: bool = False  # keep sharded parameters, gradients and optimizer state in CPU memory (CUDA only)
    empty_init: bool = True  # with checkpoint.init_from: built on the meta device, each rank reads its slices of the weights (no rank holds the whole model); false: every rank builds and loads it whole first

    def problems(self) -> List[tuple[str, str]]:
        out = []
        if self.reduce_dtype not in REDUCE_DTYPES:
            out.append(("fsdp.reduce_dtype", f"got {short(self.reduce_dtype)}; valid: {', '.join(REDUCE_DTYPES)}"))
        if self.units is not None and (not self.units or not all(isinstance(u, str) and u for u in self.units)):
            out.append(("fsdp.units", f"must be a non-empty list of class names or null, got {short(self.units)}"))
        return out


@dataclass
class ParallelConfig:
    """The device mesh of strategy fsdp: pp x dp_replicate x dp_shard x cp x tp ranks, dp_shard = world / (pp x
    dp_replicate x cp x tp); ep of dp_shard's ranks split each MoE layer's experts."""

    tp: int = 1  # tensor parallel: each layer's matmuls split over this many ranks (of one node), which read one batch
    dp_replicate: int = 1  # replicas of the sharded model (HSDP: sharded within a group, replicated across groups)
    ep: int = 1  # expert parallel: each MoE layer's experts split over this many of dp_shard's ranks (which read different tokens), tokens sent by all-to-all; divides dp_shard and num_experts; with tp, the experts are not split over tp
    tp_plan: Any = "auto"  # auto: the model's own (an HF model's _tp_plan); or {module name pattern: style}
    pp: int = 1  # pipeline stages (the outermost dimension): each rank holds a share of the model's repeated blocks
    pp_schedule: str = "1f1b"  # gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zb (zero bubble), zbv
    microbatches: Optional[int] = None  # each rank's batch split into this many for the pipeline; null: pp x stages
    stages_per_rank: Optional[int] = None  # stages each rank holds (interleaved schedules); null: 1, or 2 for those
    pp_split: Optional[List[str]] = None  # the blocks that begin stages 2, 3, ...; null: the blocks split evenly
    cp: int = 1  # context parallel: each sequence of a batch split along its length over this many ranks (which read one batch), attention exact across the split
    cp_impl: str = "auto"  # how attention crosses the split: ulysses (all-to-all from sequence to heads and back); auto: ulysses; ring: not built yet

    def laid_out(self) -> Optional[Tuple[str, int]]:
        """The keys of this section that lay ranks out (`parallel.ep=2`), and the ranks they take together, which
        the world must be a multiple of; None where none is above 1."""
        sizes = {key: getattr(self, key) for key in ("pp", "dp_replicate", "cp", "tp", "ep")}
        above = {key: size for key, size in sizes.items() if isinstance(size, int) and size > 1}
        if not above:
            return None
        return " ".join(f"parallel.{key}={size}" for key, size in above.items()), math.prod(above.values())

    def stages(self) -> int:
        """Stages per rank, the schedule's own default where the recipe gives none."""
        return self.stages_per_rank or (2 if self.pp_schedule in PP_MULTI else 1)

    def _cp_problems(self) -> List[tuple[str, str]]:
        out = at_least("parallel.cp", self.cp, 1)
        if self.cp_impl not in CP_IMPLS:
            return out + [("parallel.cp_impl", f"got {short(self.cp_impl)}; valid: {', '.join(CP_IMPLS)}")]
        if self.cp_impl == "ring":
            out.append(("parallel.cp_impl", "ring attention is not built yet; use ulysses (or auto, which is ulysses)"))
        if not isinstance(self.cp, int) or self.cp <= 1:
            return out
        others = [f"parallel.{key}={getattr(self, key)}" for key in ("pp", "tp", "ep")
                  if isinstance(getattr(self, key), int) and getattr(self, key) > 1]
        if others:
            out.append(("parallel.cp", f"splits sequences over dp_shard's ranks, and is not built with "
                                       f"{' or '.join(others)}; set parallel.cp=1, or {' and '.join(o.split('=')[0] + '=1' for o in others)}"))
        return out

    def problems(self) -> List[tuple[str, str]]:
        out = at_least("parallel.tp", self.tp, 1) + at_least("parallel.dp_replicate", self.dp_replicate, 1)
        out += at_least("parallel.pp", self.pp, 1) + at_least("parallel.ep", self.ep, 1)
        out += self._cp_problems()
        if self.ep > 1 and self.pp > 1:
            out.append(("parallel.ep", f"splits experts over data-parallel ranks, and is not built with pipeline "
                                       f"stages (parallel.pp={self.pp}); set parallel.pp=1, or parallel.ep=1"))
        if self.microbatches is not None:
            out += at_least("parallel.microbatches", self.microbatches, 1)
        if self.stages_per_rank is not None:
            out += at_least("parallel.stages_per_rank", self.stages_per_rank, 1)
        if self.pp_schedule not in PP_SCHEDULES:
            out.append(("parallel.pp_schedule", f"got {short(self.pp_schedule)}; valid: {', '.join(PP_SCHEDULES)}"))
        elif self.pp_schedule in PP_MULTI and self.stages_per_rank == 1:
            out.append(("parallel.stages_per_rank", f"{self.pp_schedule} runs several stages on each rank, and "
                                                    f"stages_per_rank is 1; use 2 or more, or pp_schedule 1f1b"))
        elif self.pp_schedule not in PP_MULTI and (self.stages_per_rank or 1) > 1:
            out.append(("parallel.stages_per_rank", f"{self.pp_schedule} runs one stage on each rank; use "
                                                    f"interleaved_1f1b (or another of {', '.join(PP_MULTI)}) for "
                                                    f"{self.stages_per_rank}"))
        elif self.pp_schedule == "zbv" and self.stages() != 2:
            out.append(("parallel.stages_per_rank", f"zbv runs exactly 2 stages on each rank (a V), got "
                                                    f"{self.stages_per_rank}"))
        if self.pp_split is not None and (not isinstance(self.pp_split, list)
                                          or not all(isinstance(n, str) for n in self.pp_split)):
            out.append(("parallel.pp_split", f"must be a list of block names (the first block of each stage after "
                                             f"the first), got {short(self.pp_split)}"))
        plan = self.tp_plan
        if plan == "auto":
            return out
        if not isinstance(plan, dict) or not plan or not all(isinstance(k, (str, int)) for k in plan):
            return out + [("parallel.tp_plan", f"must be auto or a mapping of module name patterns (a * for any "
                                               f"one name) to styles, got {short(plan)}")]
        for name, style in plan.items():
            if style not in TP_STYLES:
                out.append((f"parallel.tp_plan.{name}", f"got {short(style)}; valid: {', '.join(TP_STYLES)}"))
        return out
