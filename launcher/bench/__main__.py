"""python -m launcher.bench [--steps 2000] [--reps 5] [--hf-steps 200] [--fsdp-steps 100] [--no-workload]
                          [--no-ddp] [--no-peers] [--no-hf] [--no-fsdp] [--no-loggers] [--no-scaling] [--loggers]
                          [--no-startup] [--startup [--startup-reps 9]] [--no-defaults] [--defaults [--epoch-steps 128]]
                          [--no-pretrained] [--pretrained [--pretrained-layers 11 --pretrained-width 2048]]
                          [--layouts all|two] [--sft [--sft-steps 60 --sft-size small|tiny]]
                          [--saves [--saves-width 2048 --saves-every 40 --saves-count 3]]
                          [--ft [--ft-steps 150 --ft-every 40 --ft-widths 128,1024]] [--moe [--moe-steps 100]]
                          [--dpo [--dpo-steps 300] [--dpo-pairs strings]]

The reference workload of shared/bench (MLP 32-128-128-10, Adam, batch 64, in-memory data, one thread
per process) run through recipes/bench.yaml and through a hand-written loop (launcher/bench/loop/raw.py),
alternating, each run in a fresh process, for one process and for DDP with 2 processes (torchrun,
gloo). Every side times its steps the same way (launcher/bench/workload.py).

Per configuration it prints the median per-step time of each side, and their ratio as the median
over repetitions of (ours / raw) of runs made next to each other, with its range; the same ratio
when the launcher fetches the data item by item as the hand-written loop does (`per-item`: the
loop's own cost, without the gain of batched fetching); seconds from process start to the end of the
first step, and peak RSS of rank 0. Accelerate and Lightning (launcher/bench/peer_*.py) run as peers
when installed. Then scaling: a compute-bound size of the workload from 1 to 2 DDP processes, as
efficiency (samples/s with 2 / twice samples/s with 1), for both loops, both fetching item by item.

The HF row: recipes/hf_causal_lm.yaml (a transformers GPT2LMHeadModel on padded variable-length
passages, the model's own loss) through the launcher against the loop an HF user writes by hand
(launcher/bench/loop/raw_hf.py: the same model, batches and optimizer, read from the same recipe), one
process, one thread; run when transformers is installed.

The layouts row (launcher/bench/layouts/row.py): charlm at a CPU size under ddp x2, fsdp x2, tp x2, fsdp x2 by
tp x2 and HSDP 2x2 (torchrun, gloo): the bytes one rank holds in parameters, gradients and optimizer state
at the end (of a shard, its local part; fsdp x2's target is half the full model's plus 5%), and the
two-process layouts' step time against ddp x2, reported and not judged: gloo's collectives are slow, and
sharding's and splitting's worth is memory.

The loggers row: the reference workload with TensorBoard alone and with TensorBoard, MLflow (a local
file store) and metrics.jsonl at once (and a profiler window set beyond the last step), against the hand-written loop, as the mean step (log steps
included) and the median; `--loggers` runs this row alone.

The start-up row: a one-step run of the reference workload, `python -m launcher recipes/bench.yaml
trainer.max_steps=1` as a user types it (recipe, run folder, the final checkpoint and model.pt), with
TensorBoard off and on, against the hand-written loop's whole process for one step: wall time from
start to exit, alternating, as the median over repetitions of (ours / raw); `--startup` runs this row
alone.

The defaults row: each default the launcher picks for its users (the optimizer's fused implementation,
persistent loader workers, torch's prefetch factor), the run at the default against the same run
without it, as the mean step (launcher/bench/loop/defaults.py); `--defaults` runs this row alone.

The pretrained row: rank 0's peak host memory to load a 416M-parameter Llama-shaped model from an HF
folder under fsdp x2, built on the meta device and read slice by slice, against built whole on every
rank (launcher/bench/layouts/pretrained.py); `--pretrained` runs this row alone.

The SFT row (launcher/bench/sft/row.py): chat fine-tuning by recipes/hf_sft.yaml of a small random Llama on
generated conversations whose lengths have a long tail (lognormal, 22 to 512 tokens, max_len 512), padded against
packed, as real (non-pad) tokens a second, and TRL's SFTTrainer packing the same samples (launcher/bench/sft/peer.py,
when trl is installed): the step and the final loss, over seeds. Only `--sft` runs it, alone: TRL's step is
seconds on a CPU, and the row takes about 15 minutes at --reps 3.

The checkpoint row (launcher/bench/saves/row.py): the time a save holds the training step, written synchronously
and in the background (checkpoint.async_save), to a local folder and to an S3 API server on loopback (moto's),
for a 12.7M-parameter MLP with AdamW; then the S3 clients row (launcher/bench/saves/s3_clients.py): the same
checkpoint saved (blocked, written) and loaded through s3fs and through s3torchconnector, sharded and full;
only `--saves` runs them, alone.

The fault tolerance row (launcher/bench/ft/row.py): two replica groups (python -m launcher.ft) against ddp x2, with
no failure, and with a process killed mid-step against ddp restarted from its checkpoint; only `--ft` runs it.

The MoE row (launcher/bench/moe/row.py): a Qwen3-MoE built from its config under ep x2 against fsdp x2 (torchrun, gloo):
the step ratio and the bytes a rank holds, read from the runs' metrics.jsonl and lines; only `--moe` runs it.

The DPO row (launcher/bench/dpo/row.py): preference tuning by recipes/hf_dpo.yaml against TRL's DPOTrainer
(launcher/bench/dpo/peer.py) on the same folder and conversational pairs, the reference precomputed, SGD, fp32:
the loss after N steps (issue 53: within 1%) and the step as each run's median step, wall and CPU, over rounds of
one run a side; only `--dpo` runs it.

Of --loggers, --startup, --defaults, --pretrained, --sft, --saves, --ft, --moe and --dpo, several given run each of
those rows, in one invocation (the start-up row's first, page-cache-warming run is left out where an earlier row's
runs warmed it).

Machines are noisy: compare ratios measured in one run, not absolute times across runs.

Docs: docs/performance.md (in the source tree).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile

from launcher.bench.loop.defaults import defaults
from launcher.bench.dpo.row import dpo, dpo_options
from launcher.bench.ft.row import ft, ft_options
from launcher.bench.layouts.row import layouts
from launcher.bench.moe.row import moe, moe_options
from launcher.bench.layouts.pipeline import SCHEDULES, pipeline
from launcher.bench.loop.rows import hf, loggers, scaling, workload
from launcher.bench.runs import PY, aborted_at_exit, alternate
from launcher.bench.saves.row import saves
from launcher.bench.layouts.pretrained import pretrained
from launcher.bench.sft.row import sft
from launcher.bench.loop.startup import startup


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launcher.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000, help="steps per run of the reference workload (default 2000)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each pair of runs; ratios are their "
                                                            "median and range (default 5)")
    parser.add_argument("--scaling-steps", type=int, default=100, help="steps per run of the scaling rows (default 100)")
    parser.add_argument("--hf-steps", type=int, default=200, help="steps per run of the HF row (default 200)")
    parser.add_argument("--no-workload", dest="workload", action="store_false",
                        help="skip the reference workload's rows (1 process, DDP x2)")
    parser.add_argument("--no-ddp", dest="ddp", action="store_false", help="skip the DDP x2 rows")
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="skip the Accelerate and Lightning peers")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF row")
    parser.add_argument("--fsdp-steps", type=int, default=100, help="steps per run of the layouts row (default 100)")
    parser.add_argument("--no-scaling", dest="scaling", action="store_false", help="skip the scaling rows")
    parser.add_argument("--no-fsdp", dest="fsdp", action="store_false", help="skip the layouts row (fsdp, tp, hsdp)")
    parser.add_argument("--layouts", choices=("all", "two"), default="all",
                        help="the layouts row's layouts: all, or the two-process ones alone (no fsdp x tp, HSDP 2x2)")
    parser.add_argument("--no-loggers", dest="loggers", action="store_false", help="skip the loggers row")
    parser.add_argument("--loggers", dest="loggers_only", action="store_true", help="the loggers row alone")
    parser.add_argument("--no-startup", dest="startup", action="store_false", help="skip the start-up row")
    parser.add_argument("--startup", dest="startup_only", action="store_true", help="the start-up row alone")
    parser.add_argument("--startup-reps", type=int, default=9, help="repetitions of the start-up row (default 9)")
    parser.add_argument("--no-defaults", dest="defaults", action="store_false", help="skip the defaults row")
    parser.add_argument("--defaults", dest="defaults_only", action="store_true",
                        help="the defaults row alone: each default the launcher picks, on against off")
    parser.add_argument("--epoch-steps", type=_positive, help="the defaults row's epoch on the quickstart recipe, in steps "
                        "(default: the recipe's, 128; fewer, e.g. 16, makes a short run cross epochs, where persistent "
                        "workers differ)")
    parser.add_argument("--no-pretrained", dest="pretrained", action="store_false", help="skip the pretrained row")
    parser.add_argument("--pretrained", dest="pretrained_only", action="store_true",
                        help="the pretrained row alone: host memory to load an HF folder under fsdp x2")
    parser.add_argument("--pretrained-layers", type=int, default=11, help="the pretrained row's layers (default 11)")
    parser.add_argument("--pretrained-width", type=int, default=2048, help="its hidden size (default 2048: 416M parameters)")
    parser.add_argument("--sft", dest="sft_only", action="store_true",
                        help="the SFT row alone: padded against packed chat fine-tuning, and TRL's SFTTrainer")
    parser.add_argument("--sft-steps", type=int, default=60, help="steps per run of the SFT row (default 60)")
    parser.add_argument("--sft-size", choices=("small", "tiny"), default="small",
                        help="the SFT row's data and model: small (1024 samples, max_len 512) or tiny (a smoke test)")
    parser.add_argument("--saves", dest="saves_only", action="store_true",
                        help="the checkpoint rows alone: the step blocked by a save, sync and async, local and S3; "
                        "the S3 clients compared")
    parser.add_argument("--pipeline", dest="pipeline_only", action="store_true",
                        help="the pipeline row alone: pp x2 under each schedule against one process, and its bubble")
    parser.add_argument("--pipeline-steps", type=int, default=30, help="steps per run of the pipeline row (default 30)")
    parser.add_argument("--pipeline-schedules", default=",".join(SCHEDULES),
                        help=f"the pipeline row's schedules, comma-separated (default all: {','.join(SCHEDULES)})")
    parser.add_argument("--saves-width", type=int, default=2048, help="the checkpoint row's MLP width (default 2048)")
    parser.add_argument("--saves-every", type=int, default=40, help="its steps between saves (default 40: more "
                        "than an upload to the loopback store takes on 2 cores)")
    parser.add_argument("--saves-count", type=int, default=3, help="its saves a run, the final one aside (default 3)")
    ft_options(parser)
    moe_options(parser)
    dpo_options(parser)
    return parser


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of steps, a positive integer")
    return int(text)


def sft_row(args) -> list[str]:
    """The SFT row on the CPU, or one line saying why not."""
    if importlib.util.find_spec("transformers") is None:
        return ["SFT row skipped: transformers is not installed (pip install -c constraints.txt 'launcher[dev]')"]
    command = f"python -m launcher.bench --sft --sft-steps {args.sft_steps} --sft-size {args.sft_size} --reps {args.reps}"
    return sft(args, args.sft_size, "cpu", command)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Run folders of this benchmark's own: two benchmarks at once do not meet on one folder's lock.
    with tempfile.TemporaryDirectory(prefix="launcher-bench-") as args.run_dir:
        # --loggers, --startup, --defaults, --pretrained, --sft, --saves, --pipeline, --ft, --moe, --dpo: those rows alone, in this order (several
        # given: each of them, in one invocation)
        only = {"loggers": lambda: loggers(args), "startup": lambda: startup(args),
                "defaults": lambda: defaults(args, alternate, PY), "pretrained": lambda: pretrained(args),
                "sft": lambda: sft_row(args), "saves": lambda: saves(args), "pipeline": lambda: pipeline(args),
                "ft": lambda: ft(args), "moe": lambda: moe(args),
                "dpo": lambda: dpo(args)}
        chosen = [name for name in only if getattr(args, f"{name}_only")]
        for name in chosen:
            print("\n".join(only[name]()), flush=True)
        if chosen:
            return 0
        if args.workload:
            print("\n".join(workload(args)), flush=True)
        if args.loggers:
            print("\n".join(loggers(args)), flush=True)
        if args.startup:
            print("\n".join(startup(args)), flush=True)
        if args.hf:
            print("\n".join(hf(args)), flush=True)
        if args.defaults:
            print("\n".join(defaults(args, alternate, PY)), flush=True)
        if args.fsdp:
            print("\n".join(layouts(args)), flush=True)
        if args.pretrained:
            print("\n".join(pretrained(args)), flush=True)
        if args.scaling:
            print("\n".join(scaling(args)))
    if aborted_at_exit:
        print(f"({len(aborted_at_exit)} runs aborted in gloo at exit, after printing their figures: "
              f"{'; '.join(aborted_at_exit)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
