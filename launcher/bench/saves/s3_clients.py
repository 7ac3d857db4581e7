"""The S3 clients row of python -m launcher.bench --saves: the same checkpoint saved and loaded through s3fs
(fsspec: DCP's FsspecWriter and FsspecReader, s3fs's files) and through s3torchconnector (its DCP storage and
its client's streams), to the S3 API server on loopback that the checkpoint row starts (moto's), in both
formats: sharded (DCP's shards, as fsdp writes them) and full (model.pt and state.pt, as one process writes
them). Each measurement is a fresh process (`python -m launcher.bench.saves.s3_clients CLIENT FORMAT URL WIDTH`),
the clients alternating; a ratio is s3fs's time over s3torchconnector's in runs made next to each other.

A process builds the checkpoint row's MLP (32-WIDTH x4-10) and AdamW's state after one step, then through the
checkpoint package's own functions, on a Remote whose `client` is the one measured:
    save    a synchronous save, manifest included: what the step waits for without checkpoint.async_save
    blocked the background save's staging: what the step waits for with it
    written that save's wall time, staging to sealed manifest
    load    reading the newest checkpoint back into the model's and optimizer's tensors (checksums checked
            by ETag, as a resume does)
    memory  the process's peak resident memory during the synchronous save over its size before it"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

from launcher.bench.runs import PY, measure

CLIENTS = ("s3fs", "s3torchconnector")
FORMATS = ("sharded", "full")


def compare(url: str, width: int, reps: int, env: dict) -> list[str]:
    """The row's lines: per format, each client's medians over `reps` processes, and s3fs / s3torchconnector."""
    results = {(fmt, client): [] for fmt in FORMATS for client in CLIENTS}
    for rep in range(reps):
        order = [(fmt, client) for fmt in FORMATS for client in CLIENTS]
        for fmt, client in order if rep % 2 == 0 else reversed(order):
            command = [PY, "-m", "launcher.bench.saves.s3_clients", client, fmt, f"{url}/{fmt}-{client}-{rep}", str(width)]
            results[(fmt, client)].append(measure(command, env))
    size = results[(FORMATS[0], CLIENTS[0])][0]["bytes"]
    lines = [f"S3 clients (moto, loopback): one {size / 2**20:.0f} MiB checkpoint saved and loaded through each client; "
             f"median over {reps} processes each; s3fs/s3tc: the ratio of runs made next to each other",
             f"{'':34}{'save':>9}{'blocked':>9}{'written':>9}{'load':>9}{'memory':>10}"]
    keys = ("save", "blocked", "written", "load")
    for fmt in FORMATS:
        for client in CLIENTS:
            runs = results[(fmt, client)]
            times = "".join(f"{statistics.median(r[k] for r in runs):8.2f}s" for k in keys)
            memory = statistics.median(r["memory"] for r in runs) / 2**20
            lines.append(f"{fmt + ' / ' + client:34}{times}{memory:6.0f} MiB")
        pairs = list(zip(results[(fmt, "s3fs")], results[(fmt, "s3torchconnector")]))
        ratios = "".join(f"{statistics.median(a[k] / b[k] for a, b in pairs):8.2f}x" for k in keys)
        memory = statistics.median(a["memory"] / max(b["memory"], 1) for a, b in pairs)
        lines.append(f"{fmt + ' / s3fs over s3tc':34}{ratios}{memory:8.2f}x")
    return lines


def run(client: str, fmt: str, url: str, width: int) -> dict:
    """One process's figures (see the module's docstring)."""
    import torch
    import torch.distributed as dist

    from launcher.checkpoint import files, layout, manifest, sharded, storage
    from launcher.checkpoint.staging import Staging
    from recipes.components.mlp import MLP

    torch.manual_seed(0)
    model = MLP(hidden=width, layers=4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 32)).sum().backward()
    optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {names[id(p)]: dict(s) for p, s in optimizer.state.items()}
    state = {"model": model.state_dict(), "optimizer": moments}
    folder = storage.location(url, client)
    storage.reachable(folder)
    if fmt == "sharded":  # DCP's collectives on a world of one, as fsdp's on each rank
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='launcher-bench-gloo-')}", rank=0,
                                world_size=1)
    before = _resident(reset=True)

    began = time.perf_counter()
    if fmt == "sharded":
        partial = layout.prepare(folder, 1)
        sharded.write(partial, state, dist.group.WORLD)
        layout.seal(folder, 1, sharded.own_files(partial, 0), keep=2, sharded=True, world_size=1)
    else:
        partial = layout.prepare(folder, 1)
        layout.seal(folder, 1, {"model.pt": files.save(partial / "model.pt", state["model"]),
                                "state.pt": files.save(partial / "state.pt", state["optimizer"])}, keep=2)
    saved = time.perf_counter() - began
    memory = max(0, _resident(peak=True) - before)

    began = time.perf_counter()
    if fmt == "sharded":
        partial = layout.prepare(folder, 2)
        future = sharded.start(partial, state, dist.group.WORLD)
        blocked = time.perf_counter() - began
        future.result()
        layout.seal(folder, 2, sharded.own_files(partial, 0), keep=2, sharded=True, world_size=1)
    else:
        staged = Staging().copy(state)
        blocked = time.perf_counter() - began
        partial = layout.prepare(folder, 2)
        layout.seal(folder, 2, {"model.pt": files.save(partial / "model.pt", staged["model"]),
                                "state.pt": files.save(partial / "state.pt", staged["optimizer"])}, keep=2)
    written = time.perf_counter() - began

    newest = layout.choose(folder, "auto")[0]  # checked against its manifest's ETags, as a resume checks it
    began = time.perf_counter()
    if fmt == "sharded":
        into = {"model": model.state_dict(), "optimizer": moments}
        sharded.read(newest, into)
    else:
        files.load(newest / "model.pt"), files.load(newest / "state.pt")
    loaded = time.perf_counter() - began
    size = sum(entry["size"] for entry in manifest.read(newest).values())
    storage.removed(folder)
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"save": saved, "blocked": blocked, "written": written, "load": loaded, "memory": memory, "bytes": size}


def _resident(peak: bool = False, reset: bool = False) -> int:
    """Bytes resident in this process now (with `reset`, the peak starts again from here), or at the peak since."""
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: the peak resident size (VmHWM) is reset to the current one
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["VmHWM" if peak else "VmRSS"].split()[0]) * 1024


if __name__ == "__main__":
    from launcher.bench.workload import finish

    client, fmt, url, width = sys.argv[1:5]
    print("BENCH " + json.dumps(run(client, fmt, url, int(width))), flush=True)
    finish()
