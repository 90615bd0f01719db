"""benchmarks/report.py: parts of a suite run merge into one result, and the headline table shows its ratios."""
import json

from benchmarks.report import headline, merge, plot


def _run(placement, budget, rate):
    return {"placement": placement, "budget_blocks": budget, "budget_fraction": 0.25, "output_tok_per_s": rate,
            "device_pool_gib": budget / 1000}


def test_parts_merge_and_the_table_gives_auto_over_gpu_and_over_hf(tmp_path):
    common = {"profile": "full", "device": "gpu-x", "host_cores": 16, "platform": "linux", "torch": "2.x",
              "date": "2026-11-22"}
    spec = {"model": "m", "num_seqs": 8, "prompt_len": 100, "output_len": 10}
    b = {"spec": spec, "batch_kv_gib": 1.0, "peers": {"hf_offloaded": {"output_tok_per_s": 50.0}},
         "runs": [_run("gpu", 400, 300.0), _run("auto", 400, 330.0), _run("cpu", 400, 90.0)]}
    c = {"model": "m", "context": 4096, "device_pool_gib": 0.1, "decode_tok_per_s": 7.0, "fraction_of_bound": 0.7,
         "bound_tok_per_s": 10.0, "host_read_gbps": 90.0}
    (tmp_path / "offload_full_b-m.json").write_text(json.dumps({**common, "host_read_gbps": 80.0, "b": [b]}))
    (tmp_path / "offload_full_a-c.json").write_text(json.dumps({**common, "host_read_gbps": 90.0, "c": c}))
    result = merge(str(tmp_path), "full")
    assert len(result["b"]) == 1 and result["c"] == c and len(result["parts"]) == 2
    table = headline(result)
    assert "| 0.40 | 300 | 330 | 90 | 1.10x | 6.60x |" in table
    assert "0.70 of the host-read bound" in table and "2026-11-22" in table
    plot(result, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 0
