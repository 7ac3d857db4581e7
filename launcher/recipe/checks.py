"""Value checks the schema's sections share: each returns (key, problem) pairs, never raises."""

from __future__ import annotations

import math
import re
from dataclasses import fields
from typing import Any, Dict, List, Optional

from launcher.errors import short

INT64 = (-2**63, 2**63 - 1)  # torch takes integers (seeds, sizes, counts) in 64 bits; OmegaConf's are unbounded


def devices_valid(devices: Any) -> bool:
    if isinstance(devices, str):
        return bool(re.fullmatch(r"auto|cpu|cuda|cuda:\d+|auto:[1-9]\d*", devices))
    if isinstance(devices, (list, tuple)) and devices:
        return all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)
    return False


def at_least(key: str, value: Optional[int], low: int) -> List[tuple[str, str]]:
    if value is None or value >= low:
        return []
    return [(key, f"must be {low} or more, got {value}")]


def int64_problems(prefix: str, section: Any) -> List[tuple[str, str]]:
    out = []
    for f in fields(section):
        value = getattr(section, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
            out.append((prefix + f.name, f"must fit in 64 bits ({INT64[0]} to {INT64[1]}), got {short(value)}"))
    return out


def positive(x: float) -> bool:
    return math.isfinite(x) and x > 0  # nan and inf are numbers to OmegaConf, not a norm or a rate


def target_problems(key: str, spec: Optional[Dict[str, Any]]) -> List[tuple[str, str]]:
    if spec is None:
        return []
    if not isinstance(spec, dict) or not isinstance(spec.get("_target_"), str):
        return [(key, "needs a _target_ naming an importable callable, e.g. {_target_: torch.nn.CrossEntropyLoss}")]
    return partial_problems(key, spec)


def partial_problems(key: str, spec: Any) -> List[tuple[str, str]]:
    """`_partial_`, here or in a nested spec, is true or false, beside a `_target_`."""
    out = []
    if isinstance(spec, dict):
        if "_partial_" in spec:
            flag = spec["_partial_"]
            if not isinstance(flag, bool):
                out.append((f"{key}._partial_", f"must be true or false, got {short(flag)}"))
            elif "_target_" not in spec:
                out.append((f"{key}._partial_", "only means something beside a _target_ (it makes the target "
                                                "a functools.partial instead of calling it)"))
        for k, v in spec.items():
            if k not in ("_target_", "_partial_"):
                out += partial_problems(f"{key}.{k}", v)
    elif isinstance(spec, list):
        for i, v in enumerate(spec):
            out += partial_problems(f"{key}.{i}", v)
    return out
