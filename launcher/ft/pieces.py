"""torchft's pieces as the groups use them: its logging kept off the console, the lighthouse's address checked,
the process group across the groups for a device, the HTTP transfer of a live copy. torchft is imported here,
by replicas.py (its Manager) and by lighthouse.py alone."""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import urllib.parse
import warnings
from typing import Any, Optional

from launcher.errors import UserError, first_line

REPLICA_ID = "group_{:05d}"  # torchft sorts groups by it (lowest first) and reads its trailing digits
CONNECT = 10  # seconds a group waits for the lighthouse's port to answer at its start


def quiet(log: Optional[str] = None) -> None:
    """torchft says every quorum and commit at INFO (its Rust side on stderr, a few lines a step), and each error a
    group meets when a peer dies with its traceback: none of it reaches the console (the strategy says what
    happened, one line each). Its Python side's warnings and errors go to `log`, a file, where given; its Rust
    side's warnings stay on stderr, unless RUST_LOG says otherwise. Called before torchft is imported."""
    if not os.environ.get("RUST_LOG"):  # unset or empty (an empty one is torchft's INFO on the console)
        os.environ["RUST_LOG"] = "warn"
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        logger.propagate = False
        if not logger.handlers:
            logger.addHandler(logging.FileHandler(log) if log else logging.NullHandler())
    # torch's, once per process, about the bytes torchft's HTTP transfer hands it (read-only, and copied)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def reason(e: BaseException) -> str:
    """A collective's error in a few words: gloo's start with its source file and end with advice."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", first_line(e))
    return text.split(". This is typically")[0][:160]


def answers(lighthouse: str) -> None:
    """Something listens at the lighthouse's address (a mistyped one is one line now, not torchft's wait)."""
    found = urllib.parse.urlsplit(lighthouse)
    try:
        socket.create_connection((found.hostname, found.port or 80), timeout=CONNECT).close()
    except OSError as e:
        raise UserError(f"fault_tolerance.lighthouse: nothing answers at {lighthouse} ({e.strerror or e}); start the "
                        f"lighthouse first (python -m launcher.ft starts one and gives its address), or fix the "
                        f"address") from None


def process_group(device: str) -> type:
    """torchft's process group across the groups for gradients on `device`: its NCCL one on CUDA (abortable: a
    dead group's collective errors out after timeouts.pg rather than hanging), gloo on the CPU."""
    import torchft

    return torchft.ProcessGroupNCCL if device == "cuda" else torchft.ProcessGroupGloo


def transport(timeout: datetime.timedelta) -> Any:
    """torchft's HTTP transfer of a live group's state (its default), without a line on stderr per request."""
    from torchft.checkpointing import HTTPTransport

    transport = HTTPTransport(timeout=timeout, num_chunks=0)
    server = transport._server  # its handler class is made inside __init__: quieted where the server holds it
    server.RequestHandlerClass = type("Quiet", (server.RequestHandlerClass,), {"log_message": lambda *args: None})
    return transport
