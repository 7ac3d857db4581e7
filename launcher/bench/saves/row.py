"""The checkpoint row of python -m launcher.bench (`--saves` prints it alone): how long a save holds the
training step, written synchronously and in the background (checkpoint.async_save), to a local folder and to
an object store, as each run logs it (`checkpoint/blocked_s` in metrics.jsonl: from the step's end to training
again, the wait for the save before it included).

The model is the quickstart's MLP made wide (`--saves-width`, 4 layers: 12.7M parameters at 2048), trained with
AdamW, so a checkpoint holds the weights and twice as many optimizer values. The object store is an S3 API
server that this process starts on loopback (moto's, in the `dev` extra): its figures are the client's and the
protocol's cost on one machine, not a cloud store's bandwidth. The final save of each run is synchronous in
both modes and is left out; sides alternate, each run a fresh process.

Then, on the same server, the S3 clients row (launcher/bench/saves/s3_clients.py): the checkpoint saved and loaded
through s3fs and through s3torchconnector, each format, where s3torchconnector is installed."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import statistics
import subprocess
from pathlib import Path

from launcher.bench.saves import s3_clients
from launcher.bench.runs import PY, REPO

BUCKET = "launcher-bench"


def saves(args) -> list[str]:
    width, every, steps = args.saves_width, args.saves_every, args.saves_every * (args.saves_count + 1)
    stores = {"local disk": lambda run: f"{run}/checkpoints"}
    server, env, note = _object_store()
    if server is not None:
        stores["S3 (moto, loopback)"] = lambda run: f"s3://{BUCKET}/{Path(run).name}"
    try:
        sides = {(store, mode): where for store, where in stores.items() for mode in ("sync", "async")}
        blocked = {side: [] for side in sides}
        size = 0
        for rep in range(args.reps):
            order = list(sides.items())
            for (store, mode), where in order if rep % 2 == 0 else reversed(order):
                run = Path(args.run_dir) / f"saves-{store.split()[0].lower()}-{mode}-{rep}"
                figures, size = _run(run, where(run), mode == "async", width, every, steps, env)
                blocked[(store, mode)].append(statistics.median(figures))
        clients = _clients(server, width, args.reps, env)
    finally:
        if server is not None:
            server.stop()
    params = 32 * width + 3 * width * width + 10 * width + 4 * width + 10
    lines = [f"checkpoint saves: MLP 32-{width}x4-10 ({params / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB a "
             f"checkpoint with AdamW's state), a save every {every} steps, {args.saves_count} saves a run; the step "
             f"blocked by a save (median over its saves, then over {args.reps} runs)",
             f"{'':24}{'sync':>10}{'async':>10}  async/sync"]
    for store in stores:
        sync, background = (statistics.median(blocked[(store, m)]) for m in ("sync", "async"))
        lines.append(f"{store:24}{sync * 1e3:8.0f}ms{background * 1e3:8.0f}ms  {background / sync:.3f}")
    if note:
        lines.append(note)
    lines += clients
    lines.append(f"command: python -m launcher.bench --saves --reps {args.reps} --saves-width {width} "
                 f"--saves-every {every} --saves-count {args.saves_count}")
    return lines


def _run(run: Path, where: str, background: bool, width: int, every: int, steps: int, env: dict):
    """One run; the blocked seconds of its saves but the final one, and the bytes of its last checkpoint's files."""
    command = [PY, "-m", "launcher", "recipes/quickstart.yaml", f"run_dir={run}", f"model.hidden={width}",
               "model.layers=4", f"trainer.max_steps={steps}", f"trainer.log_every={every}", "trainer.eval_every=null",
               f"checkpoint.every={every}", "checkpoint.keep=2", f"checkpoint.dir={where}",
               f"checkpoint.async_save={str(background).lower()}", "logging.jsonl=true", "logging.tensorboard=false",
               "logging.progress_bar=false", "logging.memory_plan=false"]  # no planner loading the CPU measured
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"benchmark run failed (exit {done.returncode}): {' '.join(command)}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    figures = [row["checkpoint/blocked_s"] for row in rows if "checkpoint/blocked_s" in row and row["step"] < steps]
    manifest = _manifest(where, steps, env)
    return figures, sum(entry["size"] for entry in manifest["files"].values())


def _clients(server, width: int, reps: int, env: dict) -> list[str]:
    """The S3 clients row on the server, or a line saying why not."""
    if server is None:
        return []
    if importlib.util.find_spec("s3torchconnector") is None:
        return ["S3 clients row skipped: s3torchconnector is not installed (pip install -c constraints.txt 'launcher[dev]')"]
    return s3_clients.compare(f"s3://{BUCKET}/clients", width, reps, env)


def _manifest(where: str, step: int, env: dict) -> dict:
    if where.startswith("s3://"):
        import boto3

        key = f"{where[len(f's3://{BUCKET}/'):]}/step_{step}/manifest.json"
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="bench",
                              aws_secret_access_key="bench", region_name="us-east-1")
        return json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    return json.loads((Path(where) / f"step_{step}" / "manifest.json").read_text())


def _object_store():
    """An S3 API server on a free loopback port with the bench's bucket, and the environment that points the runs
    at it; or (None, {}, why not)."""
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("s3fs") is None:
        return None, {}, "S3 rows skipped: moto and s3fs are not installed (pip install -c constraints.txt 'launcher[dev]')"
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="bench", aws_secret_access_key="bench",
                 region_name="us-east-1").create_bucket(Bucket=BUCKET)
    return server, env, ""
