"""The MoE rows of the benchmark: ep x2 against fsdp x2 on the CPU (python -m launcher.bench --moe) and the GPU row
(python -m launcher.bench.gpu --moe), whose trace reading and rank count are checked here on made-up traces and
run whole at the CPU size on 2 gloo processes. The figures themselves are for docs/performance.md, not asserted."""

import argparse
import math
import re

import pytest

from launcher.bench.moe import gpu as moe_gpu, row as moe
from launcher.observe import holdings
from tests.test_bench import bench, gpu, plausible

MIB = 2**20


@pytest.mark.parametrize("device, gpus, experts, n", [
    ("cpu", 0, 8, 2),  # the smoke test: 2 gloo processes
    ("cuda", 0, 128, None), ("cuda", 1, 128, None),  # nothing to split the experts over
    ("cuda", 2, 128, 2), ("cuda", 8, 128, 8),
    ("cuda", 6, 128, 4), ("cuda", 3, 8, 2),  # the most GPUs that divide the experts
])
def test_the_gpu_row_runs_on_the_most_gpus_that_divide_the_experts(device, gpus, experts, n):
    got, said = moe_gpu.ranks(device, gpus, experts)
    assert got == n
    if n is None:
        assert said.startswith("MoE row skipped: ") and "needs 2 or more" in said
    elif device == "cuda" and n < gpus:
        assert f"{n} GPUs (nccl) of the {gpus} here" in said


def test_the_gpu_row_says_it_is_skipped_with_fewer_than_two_gpus(capsys):
    args = argparse.Namespace(device="cuda", size="124M", steps=100, reps=2, run_dir="unused")
    assert moe_gpu.measure(args, "heading") == 0  # torch.cuda.device_count() is 0 on a CPU machine, 1 on one GPU
    out = capsys.readouterr().out
    assert re.fullmatch(r"MoE row skipped: [01] GPU here; ep x N against fsdp x N needs 2 or more .*\n", out), out


def test_the_union_of_intervals_counts_overlaps_once():
    assert moe_gpu.union([]) == 0
    assert moe_gpu.union([(0, 2), (5, 6)]) == 3
    assert moe_gpu.union([(0, 4), (1, 2), (3, 6), (8, 9)]) == 7  # nested, overlapping, apart
    assert moe_gpu.union([(3, 6), (0, 4)]) == 6  # in any order


def _event(name, ts, dur, cat="cpu_op", **args):
    return {"name": name, "cat": cat, "ts": ts, "dur": dur, "ph": "X", **({"args": args} if args else {})}


def test_the_share_on_the_cpu_is_gloo_s_all_to_all_ranges_over_the_steps():
    trace = {"traceEvents": [
        _event("ProfilerStep#9", 0, 100, "user_annotation"), _event("ProfilerStep#10", 100, 100, "user_annotation"),
        _event("gloo:all_to_all", 10, 20, "user_annotation"), _event("gloo:all_to_all", 20, 20, "user_annotation"),
        _event("gloo:all_to_all", 150, 10, "user_annotation"),  # on gloo's second thread, overlapping: once
        _event("gloo:all_gather", 60, 30, "user_annotation"),  # fsdp's: not an all-to-all
        _event("_c10d_functional::all_to_all_single", 0, 200),  # the op that starts it, not the transfer
        _event("gloo:all_to_all", 190, 50, "user_annotation"),  # past the window: its part inside counts
        {"name": "process_name", "ph": "M"}]}
    assert moe_gpu.share(trace) == pytest.approx((30 + 10 + 10) / 200)


def test_the_share_on_a_gpu_is_nccl_s_send_receive_kernels_over_the_gpu_s_steps():
    trace = {"traceEvents": [
        _event("ProfilerStep#9", 0, 100, "user_annotation"),  # the host's ranges, ahead of the GPU
        _event("ProfilerStep#9", 50, 100, "gpu_user_annotation"), _event("ProfilerStep#10", 150, 150, "gpu_user_annotation"),
        _event("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 60, 20, "kernel"),
        _event("ncclKernel_AllToAll_RING_LL_Sum_bf16", 100, 20, "kernel"),
        _event("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", 200, 40, "kernel",
               **{"Collective name": "all_to_allv"}),  # named by its collective, where the trace says it
        _event("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 120, 50, "kernel",
               **{"Collective name": "_allgather_base"}),
        _event("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 250, 20, "kernel"),
        _event("void at::native::vectorized_elementwise_kernel<4>", 60, 200, "kernel")]}
    assert moe_gpu.share(trace) == pytest.approx((20 + 20 + 40) / 250)


def test_a_trace_without_steps_is_refused():
    with pytest.raises(SystemExit, match="no ProfilerStep range"):
        moe_gpu.share({"traceEvents": [_event("gloo:all_to_all", 0, 10, "user_annotation")]})


def test_the_steady_step_leaves_out_the_first_quarter_and_the_profiled_steps():
    rows = {s: {"step": s, "train/samples_per_s": 16 / t, "train/tokens_per_s": 1024 / t}
            for s, t in ((10, 9.0), (20, 0.1), (30, 0.2), (40, 0.25), (50, 0.3), (60, 0.4), (70, 5.0))}
    got = moe.steady(rows, 16, before=70)  # 10 (warm-up: a quarter of 6, rounded down) and 70 (profiled) left out
    assert got["step_s"] == pytest.approx(0.25) and got["tokens_per_s"] == pytest.approx(1024 / 0.25)
    rows[80] = {"step": 80, "memory/peak_bytes": 1.0}  # a row of other figures: not an interval
    assert moe.steady(rows, 16)["step_s"] == pytest.approx(0.275)  # 20 to 70: a quarter of 7 is 1
    with pytest.raises(SystemExit, match="no interval"):
        moe.steady(rows, 16, before=10)


@pytest.mark.parametrize("held", [
    {"parameters": 1.82 * MIB, "gradients": 1.82 * MIB, "optimizer state": 3.64 * MIB},
    {"parameters": 0.5 * MIB, "gradients": 0.0, "optimizer state": 1200 * MIB},  # small figures have 4 decimals
])
def test_the_held_bytes_are_read_from_the_line_a_run_ends_with(held):
    said = f"step 20/20 | loss 2.5\n{holdings.line(0, {k: int(v) for k, v in held.items()})}\ndone: step 20\n"
    got = moe.held(said)
    assert got == pytest.approx({k: v / MIB for k, v in held.items()}, abs=1e-2)


def test_the_step_count_must_leave_intervals_to_measure():
    parser = argparse.ArgumentParser()
    moe.moe_options(parser)
    assert parser.parse_args(["--moe", "--moe-steps", "20"]).moe_steps == 20
    for bad in ("19", "0", "-5", "ten", "20.5"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--moe-steps", bad])


NUMBER = r"(\d+\.\d+)"


@pytest.mark.slow
@pytest.mark.measuring
def test_the_moe_row_sets_ep_against_fsdp_on_two_processes():
    pytest.importorskip("transformers")
    out = bench("--moe", "--moe-steps", "20")
    rows = {}
    for name in ("fsdp x2", "ep x2"):
        row = re.search(rf"^{name} +{NUMBER}ms +([\d,]+) +{NUMBER}MiB +{NUMBER}MiB +{NUMBER}MiB +{NUMBER}MiB +"
                        rf"{NUMBER}MiB  (.*)$", out, re.M)
        assert row, out
        rows[name] = row
        step, parameters, gradients, optimizer, total, peak = map(float, row.group(1, 3, 4, 5, 6, 7))
        tokens = float(row.group(2).replace(",", ""))
        assert all(math.isfinite(x) and x > 0 for x in (step, tokens, parameters, gradients, optimizer, total, peak))
        assert total == pytest.approx(parameters + gradients + optimizer, abs=0.02), row.group(0)
        assert peak > total, row.group(0)  # the step's activations and gathered layers on top of what is held
        # tokens/s and the step are read from the same intervals: the batch's 16 x 64 tokens over the step
        assert plausible(tokens * step / 1e3 / 1024), row.group(0)
    assert rows["fsdp x2"].group(8) == "1"
    ratio = re.fullmatch(rf"{NUMBER} \({NUMBER}-{NUMBER}\)", rows["ep x2"].group(8))
    assert ratio and plausible(float(ratio.group(1))), out  # a sanity bound on what was measured, not a target
    # at rest ep holds what fsdp holds: the experts split by expert instead of by row, the rest sharded alike
    assert rows["ep x2"].group(6) == rows["fsdp x2"].group(6), out
    load = re.search(rf"^expert load at the end .*: the most loaded expert's share {NUMBER}, the least's {NUMBER} "
                     rf"\(even: 0\.250\)$", out, re.M)
    assert load and 1 >= float(load.group(1)) >= 0.25 >= float(load.group(2)) >= 0, out
    assert "(python -m launcher.bench --moe --moe-steps 20 --reps 1)" in out, out


@pytest.mark.slow
@pytest.mark.measuring
def test_the_gpu_moe_row_runs_tiny_on_the_cpu():
    pytest.importorskip("transformers")
    out = gpu("--moe", "--device", "cpu", "--size", "tiny", "--steps", "30", "--reps", "1")
    assert "MoE on 2 processes on the CPU (gloo)" in out and "ep's steps 29-30 profiled" in out, out
    fsdp = re.search(rf"^fsdp x2 +{NUMBER}ms +([\d,]+) +{NUMBER}MiB +- +- +1$", out, re.M)
    ep = re.search(rf"^ep x2 +{NUMBER}ms +([\d,]+) +{NUMBER}MiB +- +{NUMBER} \({NUMBER}-{NUMBER}\) +"
                   rf"{NUMBER} \(\S+\)$", out, re.M)
    assert fsdp and ep, out
    for row in (fsdp, ep):
        assert float(row.group(1)) > 0 and float(row.group(2).replace(",", "")) > 0 and float(row.group(3)) > 0, out
    share, low, high, ratio = map(float, ep.group(4, 5, 6, 7))
    assert 0 < low <= share <= high <= 1, out  # every rank's all-to-alls found in its trace, within its steps
    assert plausible(ratio), out  # a sanity bound on what was measured, not a target
