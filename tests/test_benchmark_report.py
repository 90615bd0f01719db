"""benchmarks/report.py and the suite's arithmetic: parts of a suite run merge into one result, the ideal and the
ratios are what their definitions say, and the headline table and the plot show them."""
import json

import pytest

from benchmarks.bench_throughput import b_ratios, ideal_tok_per_s, part_name
from benchmarks.report import _plot_ratios, headline, merge, plot, results_md
from benchmarks.workloads import PROFILES, BeyondVram, blocks_beside_weights

COMMON = {"profile": "full", "device": "gpu-x", "host_cores": 16, "platform": "linux", "torch": "2.x",
          "date": "2026-11-22"}


def _run(placement, budget, rate, fraction=0.25, **moves):
    return {"placement": placement, "budget_blocks": budget, "budget_fraction": fraction, "output_tok_per_s": rate,
            "device_pool_gib": budget / 1000, **moves}


def test_the_ideal_is_gpu_plus_host_read_bandwidth_over_a_host_rows_kv_per_token_step():
    # mean context 100 + 200 / 2 = 200 tokens x 250,000 bytes = 5e7 bytes a token-step; 10 GB/s / 5e7 = 200 tok/s
    assert ideal_tok_per_s(300.0, 10.0, 100, 200, 250_000) == 500.0
    assert ideal_tok_per_s(0.0, 10.0, 100, 200, 250_000) == 200.0  # the host term alone


def test_ratios_put_auto_over_gpu_cpu_hf_and_the_ideal_at_each_budget():
    runs = [_run("gpu", 400, 300.0), _run("auto", 400, 330.0), _run("gpu", 200, 100.0), _run("auto", 200, 150.0),
            _run("cpu", 200, 90.0)]
    ratios = b_ratios(runs, {"hf_offloaded": {"output_tok_per_s": 50.0}}, {"400": 500.0, "200": 300.0})
    assert ratios.keys() == {f"auto/{other}@{budget}" for other in ("gpu", "cpu", "hf_offloaded", "ideal")
                             for budget in (400, 200)}
    assert ratios == pytest.approx({
        "auto/gpu@400": 1.1, "auto/cpu@400": 330 / 90, "auto/hf_offloaded@400": 6.6, "auto/ideal@400": 0.66,
        "auto/gpu@200": 1.5, "auto/cpu@200": 150 / 90, "auto/hf_offloaded@200": 3.0, "auto/ideal@200": 0.5})


def test_a_failed_run_gives_no_ratio():
    runs = [{"placement": "gpu", "budget_blocks": 400, "error": "OutOfMemoryError"}, _run("auto", 400, 330.0)]
    assert b_ratios(runs, {}, {}) == {}


def test_budgets_are_fractions_of_the_batch_and_absolute_blocks_largest_first():
    spec = BeyondVram("m", 4, 100, 100, (1 / 4, 1 / 8), peer_batch=1, budget_blocks=(40, 25))
    assert spec.budgets(100) == [40, 25, 12]


def test_the_24_gib_card_budget_for_the_8b_shape_is_the_commented_arithmetic():
    weights = 2 * 8_190_735_360  # bf16 bytes of qwen3-8b's parameters
    block = 16 * 2 * 36 * 8 * 128 * 2
    assert blocks_beside_weights("qwen3-8b", card_gib=24) == int((22.5 * 2**30 - weights) // block) == 3296


def test_decode_heavy_workloads_are_named_and_their_parts_have_their_own_files():
    full = PROFILES["full"]
    dh = [s for s in full.b if s.name == "dh"]
    assert {s.model for s in dh} == {"qwen3-0.6b", "qwen3-8b"} and all(s.output_len >= 1024 for s in dh)
    assert part_name(full, "b", [s for s in full.b if s.name == "b" and s.model == "qwen3-0.6b"]) == "_b-qwen3-0.6b"
    assert part_name(full, "b", [s for s in dh if s.model == "qwen3-8b"]) == "_dh-qwen3-8b"
    assert part_name(full, "ac", list(full.b)) == "_a-c"
    assert part_name(full, "abc", list(full.b)) == ""


def _b(name="b", ideal=None, peers=True):
    spec = {"model": "m", "num_seqs": 8, "prompt_len": 100, "output_len": 10, "name": name}
    runs = [_run("gpu", 400, 300.0), _run("auto", 400, 330.0, promotions=3, demotions=2, preemptions=1),
            _run("cpu", 400, 90.0)]
    found = {"hf_offloaded": {"output_tok_per_s": 50.0}} if peers else {}
    ideal = ideal or {}
    return {"name": name, "spec": spec, "batch_kv_gib": 1.0, "peers": found, "runs": runs,
            "ideal_tok_per_s": ideal, "ratios": b_ratios(runs, found, ideal)}


def test_parts_merge_and_the_table_gives_auto_over_gpu_the_ideal_and_hf(tmp_path):
    b, dh = _b(ideal={"400": 500.0}), _b("dh", ideal={"400": 440.0}, peers=False)
    old = _b()  # a part from before the ideal was recorded
    del old["ideal_tok_per_s"], old["spec"]["name"]
    c = {"model": "m", "context": 4096, "device_pool_gib": 0.1, "decode_tok_per_s": 7.0, "fraction_of_bound": 0.7,
         "bound_tok_per_s": 10.0, "host_read_gbps": 90.0}
    (tmp_path / "offload_full_b-m.json").write_text(json.dumps({**COMMON, "host_read_gbps": 80.0, "b": [b]}))
    (tmp_path / "offload_full_dh-m.json").write_text(json.dumps({**COMMON, "host_read_gbps": 80.0, "b": [dh]}))
    (tmp_path / "offload_full_a-c.json").write_text(json.dumps({**COMMON, "host_read_gbps": 90.0, "c": c}))
    (tmp_path / "offload_full_x-old.json").write_text(json.dumps({**COMMON, "host_read_gbps": 80.0, "b": [old]}))
    result = merge(str(tmp_path), "full")
    assert [x["spec"].get("name") for x in result["b"]] == ["b", "dh", None]
    assert result["c"] == c and len(result["parts"]) == 4
    table = headline(result)
    # gpu 300, auto 330, cpu 90, ideal 500: auto/gpu 1.10, auto/ideal 0.66, auto/HF offloaded 330 / 50 = 6.60
    assert "| b. m, 8 x (100 + 10) | 0.40 (0.25) | 300 | 330 | 90 | 500 | 1.10x | 0.66x | 6.60x | 3 / 2 / 1 |" in table
    assert "| dh. m, 8 x (100 + 10) | 0.40 (0.25) | 300 | 330 | 90 | 440 | 1.10x | 0.75x | - | 3 / 2 / 1 |" in table
    assert "| b. m, 8 x (100 + 10) | 0.40 (0.25) | 300 | 330 | 90 | - | 1.10x | - | 6.60x |" in table  # the old part
    assert "| b. m, 8 x (100 + 10): transformers generate |" in table
    assert "dh. m, 8 x (100 + 10): transformers" not in table  # dh ran no peers
    assert "0.70 of the host-read bound" in table and "2026-11-22" in table
    plot(result, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_results_md_names_each_rows_file_date_and_commit_and_renders_a_c_and_the_step_grid(tmp_path):
    b = _b(ideal={"400": 500.0})
    b["peers"]["hf_dynamic"] = {"output_tok_per_s": 120.0}
    runs = {"262144:auto": {"placement": "auto", "context": 262144, "kv_device_tokens": 32768, "kv_host_tokens": 229376,
                            "decode_tok_per_s": 3.0, "bound_tok_per_s": 4.0, "fraction_of_bound": 0.75,
                            "prefill_tok_per_s": 9500.0},
            "262144:gpu": {"placement": "gpu", "context": 262144, "kv_device_tokens": 262144, "kv_host_tokens": 0,
                           "decode_tok_per_s": 90.0, "bound_tok_per_s": 100.0, "fraction_of_bound": 0.9,
                           "prefill_tok_per_s": 10000.0}}
    c = {"model": "m", "budget_tokens": 32768, "host_read_gbps": 95.0, "hbm_gbps": 3000.0, "runs": runs}
    a = {"model": "m", "num_seqs": 256, "range": [100, 1024], "output_tok_per_s": 7800.0}
    (tmp_path / "offload_full_b-m.json").write_text(json.dumps({**COMMON, "host_read_gbps": 80.0, "b": [b]}))
    (tmp_path / "offload_full_a-c.json").write_text(json.dumps({**COMMON, "date": "2026-11-20", "host_read_gbps": 90.0,
                                                                "a": a, "c": {"stale": True}}))
    (tmp_path / "offload_full_c.json").write_text(json.dumps({**COMMON, "date": "2026-11-24", "host_read_gbps": 95.0,
                                                              "c": c}))
    steps = [{"batch": 1, "context": 512, "wall_over_gpu": 1.014, "gpu_over_bound": 3.39},
             {"batch": 256, "context": 512, "wall_over_gpu": 1.001, "gpu_over_bound": 1.24}]
    throughput = {"num_prompts": 256, "prompt_range": [100, 1024], "output_len": 512, "tok_s": 23867.0,
                  "bound_tok_s": 30159.0, "of_bound": 0.79, "tok_s_async_off": 20962.0, "hf_cb_tok_s": 777.0}
    (tmp_path / "engine_step.json").write_text(json.dumps({"model": "m", "date": "2026-11-24", "hbm_gbps": 2981.0,
                                                           "steps": steps, "throughput": throughput}))
    md = results_md(str(tmp_path), "full", {"offload_full_b-m.json": "abc1234", "engine_step.json": "776ca96"})
    # gpu 300, auto 330 (1.10x), ideal 500 (0.66), cpu 90, transformers offloaded 50 / dynamic 120; budget 0.40 GiB, 1/4
    assert ("| b. m, 8 x (100 + 10) | 0.40 (1/4) | 300 | 330 | **1.10x** | 500 | 0.66 | 90 | 50 / 120 | "
            "`offload_full_b-m.json` (2026-11-22, abc1234) |") in md
    assert "**7,800 output tok/s**; `offload_full_a-c.json` (2026-11-20, ?)" in md  # no commit given: "?"
    assert "`offload_full_c.json` (2026-11-24, ?)" in md  # c from the later part, not a-c's stale one
    assert "| 262,144 | split | 32,768 + 229,376 | 3.00 | 4.00 | **0.75** | 9,500 | 0.95 |" in md
    assert "`engine_step.json` (2026-11-24, 776ca96)" in md
    assert "| 1 | 1.01x, 3.39x |" in md and "| 256 | 1.00x, 1.24x |" in md
    assert "**23,867 output tok/s = 0.79 of the HBM bound** (30,159)" in md


def test_the_ratio_panel_plots_auto_over_gpu_and_over_the_ideal_at_each_budgets_device_pool():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    _plot_ratios(ax, _b(ideal={"400": 500.0}))
    lines = {line.get_label(): line.get_xydata().tolist() for line in ax.get_lines()}
    assert lines["auto / gpu"] == [pytest.approx([0.4, 1.1])]
    assert lines["auto / ideal"] == [pytest.approx([0.4, 0.66])]
    plt.close(fig)


def test_placement_constants_are_set_by_name_and_checked_before_any_work(monkeypatch):
    from benchmarks.bench_throughput import set_placement_constants
    from offload_engine.engine.sched import placement

    monkeypatch.setattr(placement, "PROMOTION_HOLD_STEPS", placement.PROMOTION_HOLD_STEPS)  # restored afterwards
    monkeypatch.setattr(placement, "HOST_PROBE_STEPS", placement.HOST_PROBE_STEPS)
    assert set_placement_constants(["PROMOTION_HOLD_STEPS=0", "HOST_PROBE_STEPS=8"]) == {
        "PROMOTION_HOLD_STEPS": 0, "HOST_PROBE_STEPS": 8}
    assert placement.PROMOTION_HOLD_STEPS == 0 and placement.HOST_PROBE_STEPS == 8
    for bad, says in (("PROMOTION_HOLD=3", "PROMOTION_HOLD_STEPS"), ("GPU=1", "not one of"),
                      ("PROMOTION_HOLD_STEPS=1.5", "takes a int"), ("PROMOTION_HOLD_STEPS", "NAME=VALUE")):
        with pytest.raises(ValueError, match=says):
            set_placement_constants(["HOST_PROBE_STEPS=4", bad])
        assert placement.HOST_PROBE_STEPS == 8  # nothing set when one assignment is bad


def test_rounds_run_gpu_and_auto_in_turns_and_each_keeps_its_fastest(monkeypatch):
    from benchmarks import bench_throughput
    from benchmarks.workloads import PROFILES, BeyondVram

    order, rates = [], iter([10.0, 9.0, 8.0, 12.0, 5.0])  # gpu, auto, then auto, gpu; then cpu
    def fake_measure(path, prompts, output_lens, kv_placement, num_gpu_blocks, **kwargs):
        order.append(kv_placement)
        return {"output_tok_per_s": next(rates)}
    monkeypatch.setattr(bench_throughput, "measure", fake_measure)
    monkeypatch.setattr(bench_throughput, "model_dir", lambda name, cache: "unused")
    monkeypatch.setattr(bench_throughput, "_kv_bytes_per_token", lambda path: 1024)
    spec = BeyondVram(model="tiny", num_seqs=2, prompt_len=32, output_len=8, budget_fractions=(0.5,), peer_batch=1,
                      peers=False)
    b = bench_throughput.workload_b(PROFILES["small"], spec, "unused", read_gbps=1.0, rounds=2)
    assert order == ["gpu", "auto", "auto", "gpu", "cpu"]
    at = {run["placement"]: run for run in b["runs"]}
    assert at["gpu"]["output_tok_per_s"] == 12.0 and at["gpu"]["rounds_output_tok_per_s"] == [10.0, 12.0]
    assert at["auto"]["output_tok_per_s"] == 9.0 and at["auto"]["rounds_output_tok_per_s"] == [9.0, 8.0]
    assert b["ratios"]["auto/gpu@" + str(at["gpu"]["budget_blocks"])] == 9.0 / 12.0
