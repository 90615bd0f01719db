"""bench_backends runs a case per backend and gives auto's rate over the faster of the others."""
import json

from benchmarks import bench_backends


def test_each_backend_runs_the_case_and_auto_is_compared_with_the_best(tmp_path):
    out = tmp_path / "backends.json"
    bench_backends.main(["--cases", "tiny-auto-half", "--backends", "torch,auto", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(r["case"], r["backend"]) for r in result["runs"]] == [("tiny-auto-half", "torch"),
                                                                     ("tiny-auto-half", "auto")]
    assert all(r["output_tok_per_s"] > 0 and "error" not in r for r in result["runs"])
    rates = {r["backend"]: r["total_tok_per_s"] for r in result["runs"]}
    assert result["ratios"]["tiny-auto-half"]["auto_over_best"] == rates["auto"] / rates["torch"]


def test_ratios_skip_a_backend_that_failed():
    runs = [{"case": "x", "backend": "triton", "total_tok_per_s": 10.0},
            {"case": "x", "backend": "flash-attn", "error": "ImportError"},
            {"case": "x", "backend": "auto", "total_tok_per_s": 9.0}]
    assert bench_backends.ratios(runs) == {"x": {"auto_over_triton": 0.9, "auto_over_best": 0.9}}
