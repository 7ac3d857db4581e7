"""Components only the tests use, named by `_target_` in test recipes."""

import torch


from recipes.components.mlp import MLP


class DivergesAt(MLP):
    """An MLP whose output turns to NaN from its `at`-th forward pass in training mode on."""

    def __init__(self, at: int, **kwargs):
        super().__init__(**kwargs)
        self.at, self.calls = at, 0

    def forward(self, x):
        out = super().forward(x)
        if self.training:
            self.calls += 1
            if self.calls >= self.at:
                out = out * float("nan")
        return out


class NotAModule:
    def __init__(self, **kwargs):
        pass


class DiesInAttempts(MLP):
    """An MLP whose process dies at its `at[k]`-th training forward in torchrun's attempt k (k counted by
    TORCHELASTIC_RESTART_COUNT), in rank `rank`; the attempts past the list run through. `how` is "exit"
    (os._exit), "kill" (SIGKILL, as the OOM killer does) or "raise" (an exception). A resumed attempt counts its
    forwards from its resume: a test gives `at[k]` as the step to die at less the step attempt k resumes from,
    so that one launch checks several kills, each followed by torchrun's restart and a resume."""

    def __init__(self, at: list, rank: int = 1, how: str = "exit", **kwargs):
        super().__init__(**kwargs)
        self.at, self.rank, self.how, self.calls = list(at), rank, how, 0

    def forward(self, x):
        import os
        import signal

        if self.training:
            self.calls += 1
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if attempt < len(self.at) and os.environ.get("RANK") == str(self.rank) and self.calls == self.at[attempt]:
                if self.how == "raise":
                    later = f" of attempt {attempt}" if attempt else ""
                    raise RuntimeError(f"rank {self.rank} broke at forward {self.calls}{later}")
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(9)
        return super().forward(x)


class DiesOnce(DiesInAttempts):
    """An MLP whose process dies at its `at`-th training forward, in rank `rank`'s first attempt only:
    `how` is "exit" (os._exit), "kill" (SIGKILL, as the OOM killer does) or "raise" (an exception)."""

    def __init__(self, at: int, rank: int = 1, how: str = "exit", **kwargs):
        super().__init__([at], rank, how, **kwargs)


class KilledOnce(MLP):
    """An MLP whose process SIGKILLs itself at its `at`-th training forward, unless `marker` exists (it is
    made first): the first attempt dies as under the OOM killer, a rerun goes through."""

    def __init__(self, at: int, marker: str, **kwargs):
        super().__init__(**kwargs)
        self.at, self.marker, self.calls = at, marker, 0

    def forward(self, x):
        import os
        import signal
        from pathlib import Path

        if self.training:
            self.calls += 1
            if self.calls == self.at and not Path(self.marker).exists():
                Path(self.marker).touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


class Slow(MLP):
    """An MLP that takes `seconds` per training forward, so a test can signal it mid-run."""

    def __init__(self, seconds: float = 0.01, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def forward(self, x):
        import time

        if self.training:
            time.sleep(self.seconds)
        return super().forward(x)


class Singles(torch.utils.data.Dataset):
    """Items that are bare tensors, not (input, target) pairs."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        return torch.zeros(32)


class Frozen(MLP):
    """An MLP with every parameter frozen: nothing to train."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.requires_grad_(False)


class NoParameters(torch.nn.Module):
    """The first 10 features as logits: a model without parameters."""

    def forward(self, x):
        return x[:, :10]


class Sized(torch.utils.data.Dataset):
    """Whatever `length` is, `__len__` returns it (a negative, a float, more than an index holds)."""

    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return torch.zeros(32), 0


class BadLoss:
    """Cross-entropy, returned wrongly: `as_` is float, per_item, tuple, detached or count."""

    def __init__(self, as_: str):
        self.as_ = as_

    def __call__(self, output, target):
        per_item = torch.nn.functional.cross_entropy(output, target, reduction="none")
        return {"float": lambda: float(per_item.detach().mean()), "per_item": lambda: per_item,
                "tuple": lambda: (per_item.mean(), per_item), "detached": lambda: per_item.mean().detach(),
                "count": lambda: (output.argmax(-1) != target).sum()}[self.as_]()


class BadMetric:
    """Per-item accuracy, returned wrongly: `as_` is float, scalar (0-d) or transposed (classes first)."""

    def __init__(self, as_: str):
        self.as_ = as_

    def __call__(self, output, target):
        right = (output.argmax(-1) == target).float()
        return {"float": lambda: 0.5, "scalar": lambda: right.mean(), "transposed": lambda: output.t()}[self.as_]()


class Raises(MLP):
    """An MLP whose constructor raises the builtin exception named `error`: a bug in a component."""

    def __init__(self, error: str, **kwargs):
        import builtins

        super().__init__(**kwargs)
        raise getattr(builtins, error)("broken component")


class Exits(MLP):
    """An MLP that calls sys.exit(0) while being built (`when: build`) or in a training forward
    (`when: forward`): a component that ends the process, as a script's code might."""

    def __init__(self, when: str = "build", **kwargs):
        import sys

        super().__init__(**kwargs)
        if when == "build":
            sys.exit(0)
        self.when = when

    def forward(self, x):
        import sys

        if self.training and self.when == "forward":
            sys.exit(0)
        return super().forward(x)


class Stream(torch.utils.data.IterableDataset):
    """A stream of (input, target) pairs: no length, no indexing."""

    def __init__(self, n: int = 256):
        self.n = n

    def __iter__(self):
        return ((torch.zeros(32), 0) for _ in range(self.n))


class SizedStream(Stream):
    """A stream that also says its length: it looks map-style (Dataset's __getitem__ and a __len__)."""

    def __len__(self):
        return self.n


def mean_error(output, target, scale: float = 1.0):
    """A plain function as a metric (`_partial_: true`): per-item misclassification, times `scale`."""
    return (output.argmax(-1) != target).float() * scale


class OutOfMemoryAt(MLP):
    """An MLP whose `at`-th forward pass in training asks the allocator for far more than any machine has
    (16 TiB): a real out-of-memory error, of the CPU's allocator here and CUDA's on a GPU."""

    def __init__(self, at: int, **kwargs):
        super().__init__(**kwargs)
        self.at, self.calls = at, 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                torch.empty(2**44, dtype=torch.uint8, device=x.device)
        return super().forward(x)


class JustIterable:
    """Iterates items but is no torch Dataset of either kind."""

    def __init__(self, n: int = 8, **kwargs):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class Augmented(torch.utils.data.Dataset):
    """Blobs with random augmentation made in `__getitem__`: noise from torch, a flip from `random`, a
    scale from numpy's global generator."""

    def __init__(self, n: int = 1024, spread: float = 1.0, **blobs):
        from recipes.components.synthetic import Blobs

        self.points = Blobs(n=n, spread=spread, **blobs)

    def __len__(self):
        return len(self.points)

    def __getitem__(self, i):
        import random

        import numpy as np

        x = self.points.x[i] + 0.3 * torch.randn(self.points.x.shape[1])
        if random.random() < 0.5:
            x = x.flip(0)
        return x * float(np.random.uniform(0.8, 1.2)), self.points.y[i]


class AugmentedStream(torch.utils.data.IterableDataset):
    """Augmented's items as a stream: each one's draws happen between two yields."""

    def __init__(self, n: int = 1024, spread: float = 1.0, **blobs):
        self.items = Augmented(n, spread, **blobs)

    def __iter__(self):
        for i in range(len(self.items)):
            yield self.items[i]


def masked(items):
    """A collate function that draws: about a tenth of each input's values set to zero (as an MLM collator masks)."""
    x, y = torch.utils.data.default_collate(items)
    return x * (torch.rand(x.shape) > 0.1), y


class Dropout(MLP):
    """MLP with dropout on its input: the training process's own generator draws at every step."""

    def forward(self, x):
        return super().forward(torch.nn.functional.dropout(x, 0.2, self.training))


class Deletes(MLP):
    """An MLP that deletes a folder (a run's tensorboard/, as a user tidying up would) at its `at`-th
    forward pass in training mode."""

    def __init__(self, path: str, at: int, **mlp):
        super().__init__(**mlp)
        self.path, self.at, self.calls = path, at, 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                import shutil

                shutil.rmtree(self.path, ignore_errors=True)
        return super().forward(x)


class BreaksAt:
    """A metric (`metric(output, target)`) with a bug that shows at its `at`-th call: at an evaluation mid-run."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, output, target):
        self.calls += 1
        if self.calls == self.at:
            raise ZeroDivisionError("a metric's bug at an evaluation")
        return (output.argmax(1) == target).float()


class WritesAtExit(MLP):
    """An MLP whose process writes `marker` from an exit handler (atexit), as a library's would."""

    def __init__(self, marker: str, **kwargs):
        super().__init__(**kwargs)
        import atexit
        from pathlib import Path

        atexit.register(Path(marker).write_text, "exit handlers ran")


class GPTDiesOnce:
    """charlm's GPT (its head untied, as pipeline stages need it) whose process is SIGKILLed at its `at`-th
    training forward in rank `rank`'s first attempt: under parallel.pp a forward is one micro-batch's, so the
    kill lands inside a step, between two stages' work."""

    def __new__(cls, at: int, rank: int = 1, **kwargs):
        import os
        import signal

        from recipes.components.gpt import GPT

        class Dying(GPT):
            calls = 0

            def forward(self, idx):
                if self.training:
                    Dying.calls += 1
                    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
                    if first and os.environ.get("RANK") == str(rank) and Dying.calls == at:
                        os.kill(os.getpid(), signal.SIGKILL)
                return super().forward(idx)

        return Dying(**{**kwargs, "tie_weights": False})
