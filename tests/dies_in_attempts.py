"""A component for tests/test_faults.py: one torchrun launch in which a worker dies in several attempts in a row,
so that one launch checks several kills, each followed by torchrun's restart and a resume."""

from recipes.components.mlp import MLP


class DiesInAttempts(MLP):
    """An MLP whose process dies at its `at[k]`-th training forward in torchrun's attempt k (k counted by
    TORCHELASTIC_RESTART_COUNT), in rank `rank`; the attempts past the list run through. `how` is "kill"
    (SIGKILL, as the OOM killer does), "exit" (os._exit) or "raise" (an exception), as tests.components.DiesOnce.
    A resumed attempt counts its forwards from its resume: the test gives `at[k]` as the step to die at less
    the step attempt k resumes from."""

    def __init__(self, at: list, rank: int = 1, how: str = "kill", **kwargs):
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
                    raise RuntimeError(f"rank {self.rank} broke at forward {self.calls} of attempt {attempt}")
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(9)
        return super().forward(x)
