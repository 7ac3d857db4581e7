"""Tensor-parallel plans: which of a model's layers split their matmuls over the tp ranks, and how.

A plan maps module name patterns (`*` stands for one name, as in `transformer.h.*.mlp.c_fc`) to a style:

    colwise             a Linear's output features (an Embedding's columns) split; its output stays split
    rowwise             a Linear's input features split: it takes a split input and sums the parts (one all-reduce)
    colwise_rep         colwise, its output gathered whole (an output head whose logits the loss reads)
    rowwise_rep         rowwise on a whole input (it takes its own part)
    embedding_rowwise   an Embedding's rows (the vocabulary) split; each rank looks up its own

and, for sequence parallelism (Megatron-SP: between the blocks each rank holds its part of the sequence,
so the norms and the residual stream are split too, and the all-reduces become all-gathers and
reduce-scatters):

    split_sequence      the module's input, whole on every rank, split along the sequence (dim 1)
    sequence_parallel   a norm (or dropout) run on the rank's part of the sequence; its weights whole
    gather_sequence     the module's input, split along the sequence, gathered whole (into attention, the MLP)
    rowwise_seq         rowwise, its summed output split along the sequence (out of attention, the MLP)

and for a norm over each attention head's features (Qwen3's q_norm and k_norm, after a colwise projection):

    heads_norm          the norm run on the rank's heads (its input's dim 2, [batch, sequence, heads, head_dim]);
                        its weights whole, their gradient summed over the tp ranks (each saw only its heads)

A norm left out of the plan there would run right and train wrong: each rank's gradient only its own heads'; so
`apply` adds such norms to a plan that leaves them out, and says so (launcher/parallel/heads.py).

The Megatron pattern pairs them: colwise into a block (attention's query/key/value, the MLP's first layer),
rowwise out of it, so the activations between stay split and one all-reduce ends each half. `auto` takes the
model's own plan: HF models carry one (`_tp_plan`, their config's `base_model_tp_plan`), in these names, less
what names no module of the model and what splits a mixture of experts' experts (transformers' packed and grouped
experts styles: the experts stay whole on each tp rank, or split by expert under parallel.ep); a
wrapper's (peft's PeftModel) is its wrapped model's, under the wrapper's prefix (`base_model.model.`).

A planned layer that peft wrapped in LoRA (its `base_layer`, and adapters `lora_A` then `lora_B`, added to its
output) is split as the layer and its adapters together: the base layer takes the layer's style; for a column
split the small `lora_B` is split alike (its rank-r input whole, its output the rank's columns, added to the
base's), `lora_A` whole; for a row split `lora_A` takes the split input and sums its parts, `lora_B` whole."""

from __future__ import annotations

import fnmatch
import inspect
from typing import Dict, List, Optional, Tuple

from torch import nn

from launcher.errors import UserError, short
from launcher.model.plain import tied_names

HF_NAMES = {"colwise_gather_output": "colwise_rep", "rowwise_split_input": "rowwise_rep",  # HF's, for the same
            "replicated_with_grad_allreduce": "heads_norm"}  # (HF's plans give it to the per-head q_norm, k_norm)
HEADS = ("num_attention_heads", "num_key_value_heads", "n_head")  # attributes that count attention heads


def styles() -> Dict[str, object]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    return {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
            "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
            "rowwise_rep": RowwiseParallel(input_layouts=Replicate()),
            "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
            "split_sequence": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                 use_local_output=True),
            "sequence_parallel": SequenceParallel(use_local_output=True),
            "heads_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "gather_sequence": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                  use_local_output=True),
            "rowwise_seq": RowwiseParallel(output_layouts=Shard(1))}


SPLITS = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "embedding_rowwise", "rowwise_seq")  # split weights
EMBEDDING_STYLES = ("colwise", "colwise_rep", "embedding_rowwise")  # an Embedding's columns, or its rows


def resolve(model: nn.Module, plan) -> Dict[str, str]:
    """The recipe's plan, or the model's own for `auto`, in this module's style names."""
    if plan != "auto":
        return {str(name): style for name, style in plan.items()}  # YAML reads a Sequential's 0: as a number
    prefix, own = _own_plan(model)
    if not own:
        raise UserError(f"parallel.tp_plan: auto, and the model ({type(model).__name__}) carries no plan of its own (HF "
                        f"models' _tp_plan); give one in the recipe, {{module name pattern: style}} (recipes/charlm.yaml)")
    known = styles()
    out = _dense({prefix + name: HF_NAMES.get(style, style) for name, style in own.items()}, model)
    other = {name: style for name, style in out.items() if style not in known}
    if other:
        listed = ", ".join(f"{style} ({name})" for name, style in list(other.items())[:3])
        raise UserError(f"parallel.tp_plan: auto: the model's plan uses styles this launcher does not apply: {listed}; "
                        f"give a plan in the recipe with {', '.join(known)}")
    return out


def _dense(plan: Dict[str, str], model: nn.Module) -> Dict[str, str]:
    """A model's own plan less what names none of its modules (an HF plan covers its config's variants: the dense
    MLPs of an MoE model's mlp_only_layers) and what splits its experts (left whole on each tp rank, or to ep)."""
    from launcher.parallel import experts

    names = [name for name, _ in model.named_modules() if name]
    held = [wrapper for name in experts.found(model) for wrapper in _wrappers(name)]

    def names_any(pattern: str, among: List[str]) -> bool:
        return any(fnmatch.fnmatchcase(n, pattern) and n.count(".") == pattern.count(".") for n in among)

    return {pattern: style for pattern, style in plan.items() if names_any(pattern, names)
            and not names_any(pattern, held) and not names_any(pattern.rpartition(".")[0], held)}


def _wrappers(name: str) -> List[str]:
    """An experts module's name, and those of the peft wrappers around it (LoRA on its weights: a ParamWrapper per
    adapted parameter, the module their innermost `base_layer`), which hold the plan's name for it."""
    out = [name]
    while out[-1].endswith(".base_layer"):
        out.append(out[-1][:-len(".base_layer")])
    return out


def _own_plan(model: nn.Module) -> Tuple[str, Optional[dict]]:
    """The plan the outermost module that carries one holds, and that module's name as a prefix. Looked up
    without __getattr__, through which a wrapper (peft's) answers with its wrapped model's plan, in the wrapped
    model's names."""
    for name, module in model.named_modules():
        for attr in ("tp_plan", "_tp_plan"):
            if inspect.getattr_static(module, attr, None) is not None and getattr(module, attr):
                return (f"{name}." if name else ""), getattr(module, attr)
    return "", None


def matched(model: nn.Module, plan: Dict[str, str]) -> Dict[str, str]:
    """Each module the plan names, with its style (a LoRA layer's base layer and adapters in its place); a
    pattern that names none is a mistake."""
    names = [name for name, _ in model.named_modules() if name]
    out: Dict[str, str] = {}
    for pattern, style in plan.items():
        found = [n for n in names if fnmatch.fnmatchcase(n, pattern) and n.count(".") == pattern.count(".")]
        if not found:
            raise UserError(f"parallel.tp_plan: {pattern!r} names no module of the model ({type(model).__name__}); its "
                            f"modules are named like {', '.join(names[:6])}")
        out.update({n: style for n in found})
    return _through_adapters(model, out)


COLUMNS, ROWS = ("colwise", "colwise_rep"), ("rowwise", "rowwise_rep")


def _through_adapters(model: nn.Module, modules: Dict[str, str]) -> Dict[str, str]:
    """`modules` with each split layer that peft wrapped in LoRA replaced by its base layer and the adapter
    that splits alike (see the module's docstring); what cannot be split so is one line each."""
    out: Dict[str, str] = {}
    wrong = []
    for name, style in modules.items():
        module = model.get_submodule(name)
        if style not in SPLITS or not isinstance(getattr(module, "base_layer", None), nn.Module):
            out[name] = style
            continue
        adapters = getattr(module, "lora_A", None)
        plain = (isinstance(adapters, nn.ModuleDict) and isinstance(module.base_layer, nn.Linear)
                 and not getattr(module, "lora_variant", None) and not len(getattr(module, "lora_magnitude_vector", ())))
        if not plain or style not in COLUMNS + ROWS:
            inner = type(module.base_layer).__name__
            what = f"{type(module).__module__}.{type(module).__name__} around {'an' if inner[0] in 'AEIOU' else 'a'} {inner}"
            wrong.append(f"parallel.tp_plan: {name} ({style}) is {what}, which tensor parallel does not split (it splits "
                         f"LoRA on a Linear, colwise or rowwise); leave {name} out of the plan or out of peft's "
                         f"target_modules")
            continue
        out[f"{name}.base_layer"] = style
        for key in adapters:
            out[f"{name}.lora_B.{key}" if style in COLUMNS else f"{name}.lora_A.{key}"] = style
    if wrong:
        raise UserError(*wrong)
    return out


def problems(model: nn.Module, modules: Dict[str, str], tp: int) -> List[str]:
    """What stops the plan splitting over `tp` ranks: a module it cannot split, a size that does not divide."""
    out = []
    holder = getattr(model, "config", model)
    for attr in HEADS:
        count = getattr(holder, attr, None)
        if isinstance(count, int) and count % tp:
            out.append(f"parallel.tp: the model's {count} attention heads ({attr}) do not split over tp={tp} ranks; "
                       f"use a tp that divides {count}")
    for name, style in modules.items():
        module = model.get_submodule(name)
        if style not in SPLITS:  # an input's or a norm's layout: nothing of the module is split
            continue
        takes = EMBEDDING_STYLES if isinstance(module, nn.Embedding) else () if not isinstance(module, nn.Linear) \
            else tuple(s for s in SPLITS if s != "embedding_rowwise")
        if style not in takes:
            want = ("an Embedding" if style == "embedding_rowwise" else "a Linear or an Embedding"
                    if style in EMBEDDING_STYLES else "a Linear")
            kind = type(module).__name__
            out.append(f"parallel.tp_plan: {name} is {'an' if kind[0] in 'AEIOU' else 'a'} {kind}, and {style} splits {want}")
            continue
        size, what = _split(module, style)
        if size % tp:
            out.append(f"parallel.tp: {name} ({style}) splits its {size} {what} over tp={tp} ranks, which does not "
                       f"divide; use a tp that divides {size}, or leave {name} out of the plan")
    return out


def _split(module: nn.Module, style: str):
    if isinstance(module, nn.Embedding):
        return (module.num_embeddings, "rows (the vocabulary)") if "rowwise" in style else (module.embedding_dim, "columns")
    return (module.out_features, "output features") if style.startswith("colwise") else (module.in_features, "input features")


def apply(model: nn.Module, mesh, plan) -> Tuple[Dict[str, str], Dict[str, str]]:
    """Split the model's planned layers over the tp `mesh` (their parameters become DTensors); returns the
    modules split, by name, and the per-head norms' patterns the plan left out and `apply` added (heads.py).
    Parameters tied before (an embedding shared with the output head) stay one."""
    from torch.distributed.tensor.parallel import parallelize_module

    from launcher.parallel import heads

    wanted = resolve(model, plan)
    added = heads.left_out(model, wanted)
    modules = matched(model, {**wanted, **added})
    found = problems(model, modules, mesh.size())
    if found:
        raise UserError(*found)
    ties = tied_names(model)
    known = styles()
    # torch's SequenceParallel (heads_norm, sequence_parallel) makes each parameter anew, trainable: a frozen norm
    # (a peft model's) would train under tp alone
    frozen = [name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad]
    parallelize_module(model, mesh, {name: known[style] for name, style in modules.items()})
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    for names in ties:
        _retie(model, names)
    return modules, added


def _retie(model: nn.Module, names: List[str]) -> None:
    """parallelize_module replaces each split module's parameters, so a tied one becomes two: one again when
    both uses are split alike (an embedding's rows and a colwise head's rows), a mistake otherwise."""
    params = [model.get_parameter(n) for n in names]
    if all(p is params[0] for p in params):
        return
    layouts = [(getattr(p, "device_mesh", None), tuple(getattr(p, "placements", ()))) for p in params]
    if any(layout != layouts[0] for layout in layouts):
        raise UserError(f"parallel.tp_plan: {' and '.join(names)} are one tied parameter, which the plan splits "
                        f"differently ({short([str(layout[1]) or 'whole' for layout in layouts])}); split both alike, "
                        f"or leave both out")
    for name in names[1:]:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, params[0])


def quiet_split_output(root: str) -> None:
    """FSDP2 warns, on every rank, when the module it wraps (`root`, its class's name) returns a view, lest an in-place
    op on it drop FSDP's pre-backward hook and skip an all-gather. Under tp the root's output is a split layer's: an
    HF model's logits are its head's (colwise_rep: gathered), which DTensor's `to_local()` returns as a view made
    inside an autograd Function. torch refuses any in-place op on such a view ("a view ... created inside a custom
    Function": a RuntimeError), so the silent failure warned of cannot happen, and the warning is left out. Returned
    as their own tensor, the logits would be copied: a language model's largest activation, twice. A test
    (tests/test_tp_norms.py) checks that torch still refuses."""
    import re
    import warnings

    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \({re.escape(root)}\) returned a view tensor",
                            category=UserWarning)
