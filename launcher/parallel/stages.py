"""A model cut into pipeline stages without touching its code.

The stages are cut at the model's repeated blocks (the ModuleList that holds its layers: an HF model's decoder
layers, charlm's blocks): stage s keeps a contiguous run of blocks, the modules the model registers before its
blocks (the embeddings) go with the first stage and those after them (the final norm, the head) with the last.
A stage is the model itself with the rest taken out, as torchtitan cuts its models: the blocks it does not hold
are removed from their list (which then runs only the stage's own, under their own names), the embeddings of a
later stage become stand-ins of no weight that give zeros of their shape, the modules after the blocks of an
earlier stage are never reached. So every parameter keeps the name it has in the whole model, and a stage's
state_dict is the whole model's, restricted: checkpoints are keyed as one process keys them.

A stage runs the model's own forward on the batch (every stage of a pipeline reads the same batch, as the
ranks of a tp group do): its first block takes the activation the stage before sent in place of what the
stand-ins computed, and the forward stops at its last block, whose output goes to the next stage; the last
stage runs on to the loss, through the launcher's step, as one process does."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from launcher.errors import UserError
from launcher.model.plain import tied_names


class StageDone(Exception):
    """Raised by a stage's last block with its output: the rest of the model's forward belongs to later stages."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value


def repeated_blocks(model: nn.Module) -> Tuple[str, nn.ModuleList]:
    """The name and ModuleList of the model's repeated blocks: the longest list of two or more modules of one class."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1
             and len({type(layer) for layer in m}) == 1]
    if not found:
        raise UserError(f"parallel.pp: the model ({type(model).__name__}) has no repeated blocks (a ModuleList of "
                        f"layers of one class) to cut into stages; pipeline parallelism cuts a model between such "
                        f"blocks, so train this one with parallel.pp=1")
    return max(found, key=lambda item: len(item[1]))


def cut(count: int, stages: int, names: List[str], split: Optional[Sequence[str]]) -> List[range]:
    """The blocks of each stage: `count` blocks split evenly, or where `split` names the first block of each
    stage after the first (names as `names`, the blocks' full names)."""
    if split is None:
        if count % stages:
            raise UserError(f"parallel.pp: the model's {count} blocks do not split evenly into {stages} stages; use a "
                            f"pp (x stages_per_rank) that divides {count}, or name the blocks that begin each stage in "
                            f"parallel.pp_split")
        size = count // stages
        return [range(s * size, (s + 1) * size) for s in range(stages)]
    if len(split) != stages - 1:
        raise UserError(f"parallel.pp_split: names {len(split)} blocks, and {stages} stages need {stages - 1} (the "
                        f"first block of each stage after the first)")
    unknown = [n for n in split if n not in names]
    if unknown:
        raise UserError(f"parallel.pp_split: {unknown[0]} is not one of the model's blocks ({names[0]} ... "
                        f"{names[-1]})")
    starts = [0] + [names.index(n) for n in split] + [count]
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise UserError(f"parallel.pp_split: {', '.join(split)} must name blocks in order, each stage holding at "
                        f"least one ({names[0]} is the first stage's first)")
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def placed(model: nn.Module, blocks_name: str) -> Tuple[List[str], List[str]]:
    """The names of the largest modules holding parameters registered before the blocks (the embeddings) and
    after them (the final norm, the head), the blocks' ancestors left out."""
    before: List[str] = []
    after: List[str] = []
    seen_blocks = [False]

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if full == blocks_name:
                seen_blocks[0] = True
            elif blocks_name.startswith(full + "."):
                walk(full + ".", child)
            elif any(True for _ in child.parameters()):
                (after if seen_blocks[0] else before).append(full)

    walk("", model)
    return before, after


class Zeros(nn.Module):
    """An embedding (or a projection of the input) of a later stage: zeros of the shape it would give, no weight."""

    def __init__(self, width: int, dtype: torch.dtype):
        super().__init__()
        self.width, self.dtype = width, dtype

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*x.shape[:-1], self.width, dtype=self.dtype, device=x.device) if x.is_floating_point() \
            else torch.zeros(*x.shape, self.width, dtype=self.dtype, device=x.device)


class Passing(nn.Module):
    """A module with weights that a later stage's forward runs before its blocks and that keeps its input's shape
    (a norm, a dropout): its input passed on (the first block's input is the activation received anyway)."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


class Unreached(nn.Module):
    """A module after the blocks, on a stage that is not the last: its forward ends before it."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline stage ran past its last block (launcher/parallel/stages.py)")


def stand_in(module: nn.Module) -> Optional[nn.Module]:
    """What a later stage runs in place of `module`, registered before the blocks; None where nothing can."""
    if isinstance(module, nn.Embedding):
        return Zeros(module.embedding_dim, module.weight.dtype)
    if isinstance(module, nn.Linear):
        return Zeros(module.out_features, module.weight.dtype)
    if all(p.dim() <= 1 for p in module.parameters()):  # norms: weights and biases of the features
        return Passing()
    return None


def refuse_unstandable(model: nn.Module, before: List[str]) -> None:
    """A module before the blocks that no later stage can stand in for: one line, on every rank alike (checked
    on the whole model before it is cut, not by the later stages alone, which would leave the first stage waiting
    for them in its first send while they stop)."""
    for name in before:
        module = model.get_submodule(name)
        if stand_in(module) is None:
            raise UserError(f"parallel.pp: {name} ({type(module).__name__}) comes before the model's blocks and is "
                            f"not an embedding, a Linear or a norm, which a later stage stands in for; cut this model "
                            f"with parallel.pp=1")


def prune(model: nn.Module, blocks_name: str, keep: range, first: bool, last: bool,
          before: List[str], after: List[str]) -> List[nn.Module]:
    """Cut `model` in place down to one stage: the blocks in `keep`, the embeddings if `first`, the head if
    `last`; returns the stage's blocks, in order."""
    blocks = model.get_submodule(blocks_name)
    for i in [i for i in range(len(blocks)) if i not in keep]:
        del blocks._modules[str(i)]  # not del blocks[i], which would renumber the others (and rename them)
    for name in ([] if first else before) + ([] if last else after):
        owner, _, attr = name.rpartition(".")
        parent = model.get_submodule(owner) if owner else model
        old = getattr(parent, attr)
        setattr(parent, attr, stand_in(old) if name in before else Unreached())
    return list(blocks)


def refuse_split_ties(model: nn.Module, before: List[str], after: List[str]) -> None:
    """A weight tied between the embeddings and the head (one matrix, two uses) would live on the first and the
    last stage, each updating its own copy: one line."""
    for names in tied_names(model):
        first = [n for n in names if any(n.startswith(b + ".") for b in before)]
        end = [n for n in names if any(n.startswith(a + ".") for a in after)]
        if first and end:
            raise UserError(f"parallel.pp: {first[0]} and {end[0]} are one tied weight, which the first and the last "
                            f"stage would each hold; untie them (an input embedding tied to the output head: an HF "
                            f"config's tie_word_embeddings: false, charlm's model.tie_weights: false), or train this "
                            f"model with parallel.pp=1")


class Stage(nn.Module):
    """One stage, as torch.distributed.pipelining runs it: `forward(*received, **batch)` runs the launcher's
    step on the model cut to this stage, the first block taking `received`; returns the activation to send
    on, or on the last stage the loss to backward (`weigh(result)`), keeping each micro-batch's result."""

    def __init__(self, model: nn.Module, blocks: List[nn.Module], index: int, count: int):
        super().__init__()
        self.model = model
        self.index = index
        self.first, self.last = index == 0, index == count - 1
        self.blocks = blocks
        self.inbox: Optional[torch.Tensor] = None
        self.step: Optional[Callable] = None  # set before each schedule step: the launcher's step
        self.weigh: Callable[[Any], torch.Tensor] = lambda out: out.loss
        self.unpack: Callable[[Dict[str, Any]], Any] = lambda kw: kw
        self.results: List[Tuple[Any, Any]] = []  # this step's micro-batches' (result, part of the batch): last stage
        self.inferring = False  # torch's pipelining runs each stage once on empty tensors, for their shapes

    def hook(self) -> None:
        """After FSDP wrapped the blocks (its hooks first: the last block's output is resharded and hooked for
        the backward before the forward stops at it). Once."""
        if not self.first:
            self.blocks[0].register_forward_pre_hook(self._received, with_kwargs=True)
        if not self.last:
            self.blocks[-1].register_forward_hook(self._done)

    def _received(self, module: nn.Module, args: tuple, kwargs: dict):
        if args:
            return (self.inbox,) + tuple(args[1:]), kwargs
        key = next(iter(kwargs))  # the hidden states passed by name
        return args, {**kwargs, key: self.inbox}

    @staticmethod
    def _done(module: nn.Module, args: tuple, output: Any):
        raise StageDone(output if isinstance(output, torch.Tensor) else output[0])

    def forward(self, *received: torch.Tensor, **batch: Any) -> torch.Tensor:
        from launcher.model.step import result

        self.inbox = received[0] if received else None
        part = self.unpack(batch)
        try:
            out = result(self.step(self.model, part))
        except StageDone as done:
            return done.value
        finally:
            self.inbox = None
        if not self.inferring:
            self.results.append((out, part))
        return self.weigh(out)


def copies(model: nn.Module, count: int) -> List[nn.Module]:
    """`count` models: the model itself and deep copies (a rank holding several stages cuts each its own)."""
    return [model] + [copy.deepcopy(model) for _ in range(count - 1)]


def runtime(stage: Stage, total: int, device: torch.device, group: Any):
    """torch's PipelineStage for `stage`. Where it infers the shapes of what stages send each other (at the first
    batch of each shape) it runs the stage on empty tensors: that run is not one of the step's micro-batches, and
    draws no random numbers of the run's (the RNG is put back after it)."""
    from torch.distributed.pipelining import PipelineStage

    class Runtime(PipelineStage):
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            return _aside(stage, lambda: super(Runtime, self)._forward_metadata_inference(*args, **kwargs))

        def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            return _aside(stage, lambda: super(Runtime, self)._backward_metadata_inference(*args, **kwargs))

    return Runtime(stage, stage.index, total, device, group=group)


def _aside(stage: Stage, fn: Callable[[], Any]) -> Any:
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    stage.inferring = True
    try:
        return fn()
    finally:
        stage.inferring = False
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def under_whole_names(models: List[nn.Module]) -> nn.Module:
    """One module holding the modules of several stages' models under the names they have in the whole model
    (a rank's stages hold disjoint parameters: its blocks, and the embeddings or the head on the ends)."""
    if len(models) == 1:
        return models[0]
    root = nn.Module()
    for model in models:
        for path, module in model.named_modules():
            own = next(module.parameters(recurse=False), None) is not None or \
                next(module.buffers(recurse=False), None) is not None
            if not path or not own or _has(root, path):
                continue
            parent = root
            *ancestors, leaf = path.split(".")
            for part in ancestors:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]
            parent.add_module(leaf, module)
    return root


def _has(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
        return True
    except AttributeError:
        return False
