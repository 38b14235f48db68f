"""The benchmark's arithmetic on synthetic results: medians, ratios, targets, the table and the results page.

Nothing here is timed: the numbers are made up so that each target's verdict is known in advance.
"""

from __future__ import annotations

import pytest

bench = pytest.importorskip("benchmarks.__main__", reason="the benchmarks package sits at the repository root")


def result(impl: str, step_ms: float, *, init_s: float = 1.0, rss: float = 1000.0, stage: str = "0") -> dict:
    return {"impl": impl, "stage": stage, "precision": "fp32", "shape": "comm", "step_s": step_ms / 1e3,
            "init_s": init_s, "peak_rss_mib": rss}  # fmt: skip


def report_of(results: list[dict], cold_convert: list[float] | None = None) -> dict:
    report = bench.aggregate(results)
    if cold_convert is not None:
        report["cold_start"] = {"torsh-migrate convert": bench._summary(cold_convert)}
    report.update(date="2026-01-01", machine="test machine", command="python -m benchmarks --quick", repeats=3,
                  steps=10)  # fmt: skip
    report["targets"] = bench.check_targets(report)
    return report


def test_ratios_are_taken_between_medians_of_the_repeats():
    results = [result("native", ms) for ms in (100, 110, 400)] + [result("torsh", ms) for ms in (101, 99, 102)] \
        + [result("deepspeed", ms) for ms in (200, 500, 150)]  # fmt: skip
    (row,) = bench.aggregate(results)["rows"]
    assert row["native.step_s"]["median"] == pytest.approx(0.110)  # one slow outlier does not move a median
    assert row["native.step_s"]["min"] == pytest.approx(0.100) and row["native.step_s"]["max"] == pytest.approx(0.4)
    assert row["step torsh/native"] == pytest.approx(101 / 110)
    assert row["step torsh/deepspeed"] == pytest.approx(101 / 200)


def paired(native_ms: float, torsh_ms: float) -> dict:
    return {"stage": "0", "precision": "fp32", "shape": "comm",
            "paired": {"native": {"step_s": native_ms / 1e3}, "torsh": {"step_s": torsh_ms / 1e3}}}  # fmt: skip


def test_torsh_over_native_comes_from_the_launches_running_both_when_there_are_any():
    # Separate launches disagree by 20% (a busy machine); the launches alternating both jobs' steps agree.
    results = [result("native", 100), result("torsh", 120), result("deepspeed", 150),
               paired(100, 101), paired(80, 80), paired(90, 91)]  # fmt: skip
    (row,) = bench.aggregate(results)["rows"]
    assert row["step torsh/native"] == pytest.approx(101 / 100)  # the median of the per-launch ratios
    assert row["step torsh/deepspeed"] == pytest.approx(120 / 150)  # torsh's own launch against DeepSpeed's
    assert row["native (paired).step_s"]["median"] == pytest.approx(0.090)
    assert row["peak memory torsh/native"] == pytest.approx(1.0)  # memory only from the single launches


def test_a_launch_running_both_jobs_compares_them_round_by_round():
    # the machine slows down for good in round 2, between native's step and torsh's: the step medians differ
    # twofold (0.1 against 0.2) while three rounds of five compare equal steps
    both = paired(100, 200)
    both["paired"]["native"]["step_times"] = [0.1, 0.1, 0.1, 0.2, 0.2]
    both["paired"]["torsh"]["step_times"] = [0.1, 0.2, 0.2, 0.2, 0.2]
    (row,) = bench.aggregate([both])["rows"]
    assert row["step torsh/native"] == pytest.approx(1.0)


def test_failed_runs_are_left_out_of_the_medians():
    results = [result("native", 100), result("torsh", 100), {**result("torsh", 1), "error": "rank 1 died"}]
    (row,) = bench.aggregate(results)["rows"]
    assert row["torsh.step_s"]["n"] == 1 and row["step torsh/native"] == pytest.approx(1.0)


def test_each_target_is_judged_on_its_worst_case():
    results = [result("native", 100, init_s=1.0, rss=1000), result("torsh", 101, init_s=1.2, rss=1020),
               result("deepspeed", 200),
               result("native", 100, stage="3", init_s=1.0, rss=1000),
               result("torsh", 105, stage="3", init_s=1.5, rss=1040),
               result("deepspeed", 110, stage="3")]  # fmt: skip
    verdicts = dict(line.split(":", 1) for line in report_of(results, [0.25, 0.28, 0.40])["targets"])
    assert verdicts["step torsh/native ≤ 1.02"].startswith(" MISSED (worst 1.050)")  # stage 3
    assert verdicts["step torsh/deepspeed ≤ 0.9"].startswith(" MISSED (worst 0.955)")  # stage 3: 105/110
    assert verdicts["peak memory torsh/native ≤ 1.03"].startswith(" MISSED (worst 1.040)")
    assert verdicts["initialize torsh - native (s) ≤ 0.3"].startswith(" MISSED (worst 0.500)")
    assert verdicts["convert cold start (s) ≤ 0.3"].startswith(" holds (worst 0.280)")  # the median of three


def test_targets_that_hold_and_targets_not_measured_are_said_so():
    results = [result("native", 100), result("torsh", 101, init_s=1.1, rss=1010)]
    verdicts = report_of(results)["targets"]
    assert "step torsh/native ≤ 1.02: holds (worst 1.010)" in verdicts
    assert "step torsh/deepspeed ≤ 0.9: not measured" in verdicts  # DeepSpeed not installed
    assert "convert cold start (s) ≤ 0.3: not measured" in verdicts


def test_markdown_table_names_the_run_and_every_case():
    results = [result("native", ms) for ms in (100, 120)] + [result("torsh", ms) for ms in (101, 103)]
    text = bench.markdown(report_of(results, [0.2, 0.3]))
    assert "Measured 2026-01-01 on test machine with `python -m benchmarks --quick`" in text
    assert "| comm | 0 | fp32 | – / – | 0.93 | 102.0 (101.0–103.0) / – | – | – | 1.00 | +0.00 | – | – |" in text
    assert "| peak RSS torsh/DeepSpeed | peak RSS torsh/native |" in text
    assert "2 ranks, gloo" in text and "peak RSS torsh/native" in text and "no --peak-tflops" in text
    assert "| `torsh-migrate convert` | 0.250 | 0.200–0.300 |" in text
    assert "- convert cold start (s) ≤ 0.3: holds (worst 0.250)" in text


def test_results_page_includes_the_table_every_run_writes(tmp_path):
    message = bench.check_results_page()  # the real page: docs/benchmarks.md includes latest.md
    assert message.startswith("docs/benchmarks.md includes benchmarks/results/latest.md")
    assert "<!-- benchmarks:start -->" not in (bench.ROOT / "README.md").read_text()  # no copy of the numbers
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmark results\n\n| old |\n")
    with pytest.raises(SystemExit, match="does not include the results"):
        bench.check_results_page(page)


# ---- the transformer shape, tokens/s, MFU and GPU memory ------------------------------------------------


def lm_result(impl: str, step_ms: float, *, cuda_mib: float | None = None, rss: float = 1000.0) -> dict:
    """A launch of the transformer shape: 4.2M parameters, 512 tokens per step over 2 ranks."""
    r = {**result(impl, step_ms, rss=rss), "shape": "transformer", "params": 4_224_512, "tokens_per_step": 512,
         "world_size": 2, "device": "cpu"}  # fmt: skip
    if cuda_mib is not None:
        r.update(device="cuda", cuda_max_allocated_mib=cuda_mib)
    return r


def test_flops_per_step_is_six_times_parameters_times_tokens():
    assert bench.flops_per_step(4_224_512, 512) == 6 * 4_224_512 * 512


def test_throughput_gives_tokens_per_second_and_mfu_against_the_peak():
    r = lm_result("torsh", 250)
    assert bench.throughput(r, None) == {"tokens_per_s": pytest.approx(2048.0)}  # 512 tokens / 0.25 s
    mfu = bench.throughput(r, peak_tflops=0.1)["mfu"]
    assert mfu == pytest.approx(6 * 4_224_512 * 512 / 0.25 / (0.1e12 * 2))  # per-device peak x 2 ranks
    assert bench.throughput(result("torsh", 100), 0.1) == {}  # an older result without token counts


def test_transformer_rows_carry_tokens_per_second_and_mfu():
    results = [lm_result("native", 200)] + [lm_result("torsh", ms) for ms in (250, 240, 260)]
    (row,) = bench.aggregate(results, peak_tflops=0.1)["rows"]
    assert row["shape"] == "transformer" and row["memory"] == "RSS"
    assert row["torsh.tokens_per_s"]["median"] == pytest.approx(512 / 0.25)
    assert row["torsh.mfu"]["median"] == pytest.approx(6 * 4_224_512 * 512 / 0.25 / 0.2e12)
    report = bench.aggregate(results, peak_tflops=0.1)
    report.update(date="2026-01-01", machine="m", command="python -m benchmarks", repeats=3, steps=10, nproc=2,
                  peak_tflops=0.1)  # fmt: skip
    report["targets"] = bench.check_targets(report)
    text = bench.markdown(report)
    assert "| transformer | 0 | fp32 |" in text and "| 2048 | 26.0% |" in text
    assert "(0.1 TFLOP/s x ranks)" in text


def test_on_a_gpu_the_memory_compared_is_cudas_max_allocated():
    results = [lm_result("native", 100, cuda_mib=1000, rss=3000), lm_result("torsh", 100, cuda_mib=1020, rss=9000)]
    report = bench.aggregate(results)
    (row,) = report["rows"]
    assert row["memory"] == "CUDA max allocated"
    assert row["peak memory torsh/native"] == pytest.approx(1.02)  # not the RSS ratio of 3
    report.update(date="d", machine="m", command="c", repeats=1, steps=1, nproc=8)
    report["targets"] = bench.check_targets(report)
    text = bench.markdown(report)
    assert "8 ranks, nccl" in text and "peak CUDA memory torsh/native" in text


def test_the_driver_knows_every_shape_without_importing_torch():
    cases = pytest.importorskip("benchmarks.cases")
    assert set(bench.SHAPE_NAMES) == set(cases.SHAPES) and set(bench.IMPL_NAMES) == set(cases.IMPLS)


@pytest.mark.parametrize("argv,message", [(["--shapes", "comm,big"], "--shapes: unknown shape(s) big"),
                                          (["--peak-tflops", "0"], "--peak-tflops must be a positive"),
                                          (["--impls", "torsh,fsdp"], "--impls: unknown implementation(s) fsdp")])
def test_bad_flags_are_named_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_transformer_ties_its_embedding_and_predicts_next_tokens():
    import torch

    cases = pytest.importorskip("benchmarks.cases")
    shape = cases.SHAPES["transformer"]
    model = cases.build(shape)
    assert model.head.weight is model.embed.weight  # one parameter at both ends
    assert cases.num_params(model) == sum(p.numel() for p in set(model.parameters()))
    assert cases.unit_class(model) == "Block"
    x, y = cases.make_batch(shape, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (shape.batch, shape.seq) and torch.equal(x[:, 1:], y[:, :-1])
    loss = cases.loss_of(model(x), y)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(float(shape.vocab))).item(), rel=0.2)
    loss.backward()
    assert model.embed.weight.grad is not None  # the head's gradient lands on the shared weight


def test_memory_against_deepspeed_is_a_target_and_per_layer_has_its_own_table():
    results = [result("native", 100, rss=1000), result("torsh", 90, rss=1100), result("deepspeed", 100, rss=1000),
               result("torsh-per-layer", 120, rss=900)]  # fmt: skip
    report = report_of(results)
    (row,) = report["rows"]
    assert row["peak memory torsh/deepspeed"] == pytest.approx(1.1)
    assert row["step torsh-per-layer/deepspeed"] == pytest.approx(1.2)
    assert row["peak memory torsh-per-layer/deepspeed"] == pytest.approx(0.9)
    main_table = bench.markdown({**report, "date": "d", "machine": "m", "command": "c", "repeats": 1, "steps": 1})
    assert "| 0.90 | 1.10 | 1.10 | +0.00 |" in main_table  # step, then memory against DeepSpeed and native
    assert "peak memory torsh/deepspeed ≤ 1.0: MISSED (worst 1.100)" in report["targets"]
    text = bench.markdown(report)
    assert "| comm | 0 | fp32 | 120.0 / 100.0 | 1.20 | 0.90 |" in text  # the memory-first row


def test_recorded_cases_keep_no_temporary_path_of_the_machine(monkeypatch):
    """The worker's result names the temporary file it wrote to; the results files keep the case, not the path."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    def worker(command, **_):
        spec = json.loads(command[-1])
        Path(spec["out"]).write_text(json.dumps({**spec, "step_s": 0.1}))
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", worker)
    done = bench.run_case(["torsh"], "2", "fp32", "comm", steps=1, warmup=0, nproc=2)
    assert "out" not in done and done["step_s"] == 0.1 and done["stage"] == "2"

    def failing(command, **_):
        return SimpleNamespace(returncode=1, stdout="", stderr="boom")

    monkeypatch.setattr(bench.subprocess, "run", failing)
    assert "out" not in bench.run_case(["torsh"], "2", "fp32", "comm", steps=1, warmup=0, nproc=2)
