"""benchmarks/bench_long_context.py and platform_ceilings.py: the tiny workload end to end on the CPU writes every key
of an entry and merges by workload; a peer attempt that fails is recorded with its reason and a smaller batch tried;
the bound is decode tokens over the slower of the two tiers' reads, against a plain loop over rows and steps."""
import json
import time

import pytest
import torch

from benchmarks import bench_long_context as bench
from benchmarks.platform_ceilings import measure_ceilings, together
from cpu_attention.executor import CpuAttentionExecutor
from offload_engine.config import EngineConfig

ENTRY_KEYS = {"workload", "model", "num_seqs", "prompt_len", "output_len", "ceilings", "decode_tok_per_s",
              "bound_tok_per_s", "fraction_of_bound", "streamed_share", "decode_tok_per_s_cpu_path_only",
              "stream_on_over_off", "cpu_placement_tok_per_s", "hf_offloaded_tok_per_s", "hf_offloaded_batch",
              "hf_offloaded_failures", "prefill_tok_per_s", "output_tok_per_s", "vs_hf_offloaded", "runs", "skipped",
              "hf_offloaded_decode_tok_per_s", "vs_hf_offloaded_decode", "combined_over_kernel_alone"}
CEILING_KEYS = {"host_kernel_gbps", "stream_gbps", "pinned_copy_gbps", "together", "combined_over_kernel_alone",
                "hbm_gbps"}


@pytest.mark.skipif("stream_host_kv" not in EngineConfig.__dataclass_fields__,
                    reason="the engine has no stream_host_kv option yet (offload_engine/config.py): the workload's "
                           "A/B run needs it")
def test_the_tiny_workload_writes_every_key_and_replaces_only_its_own_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_TQDM", "0")
    other, stale = {"workload": "c", "decode_tok_per_s": 3.0}, {"workload": "tiny", "stale": True}
    (tmp_path / "long_context.json").write_text(json.dumps({"device": "x", "entries": [other, stale]}))
    bench.main(["--workload", "tiny", "--out-dir", str(tmp_path)])
    document = json.loads((tmp_path / "long_context.json").read_text())
    assert {"device", "date", "commit", "entries"} <= document.keys()
    assert [e["workload"] for e in document["entries"]] == ["c", "tiny"]
    assert document["entries"][0] == other
    entry = document["entries"][1]
    assert ENTRY_KEYS <= entry.keys() and "stale" not in entry
    assert CEILING_KEYS <= entry["ceilings"].keys() and entry["ceilings"]["host_kernel_gbps"] > 0
    if not torch.cuda.is_available():
        assert entry["ceilings"]["stream_gbps"] is None and entry["ceilings"]["together"] is None
    runs = entry["runs"]
    assert [(runs[k]["kv_placement"], runs[k]["stream_host_kv"]) for k in ("stream_on", "stream_off", "cpu")] == \
        [("auto", True), ("auto", False), ("cpu", True)]
    assert all("error" not in run for run in runs.values())
    assert entry["decode_tok_per_s"] > 0 and entry["decode_tok_per_s_cpu_path_only"] > 0
    assert entry["stream_on_over_off"] == pytest.approx(entry["decode_tok_per_s"]
                                                        / entry["decode_tok_per_s_cpu_path_only"])
    assert 0 <= entry["streamed_share"] <= 1 and entry["fraction_of_bound"] > 0
    # The peer either ran (a rate and its batch) or every attempt says why not (transformers' offloaded cache
    # needs CUDA); it is never left out.
    if entry["hf_offloaded_tok_per_s"] is None:
        assert [f["batch"] for f in entry["hf_offloaded_failures"]] == list(bench.WORKLOADS["tiny"].peer_batches)
        assert all(f["reason"] for f in entry["hf_offloaded_failures"])
    else:
        assert entry["hf_offloaded_batch"] in bench.WORKLOADS["tiny"].peer_batches


def test_merging_replaces_the_entry_of_its_workload_in_place_and_keeps_the_others(tmp_path):
    path = str(tmp_path / "sub" / "long_context.json")
    bench.merge_entry(path, {"workload": "c", "v": 1}, {"device": "d", "date": "x", "commit": "a"})
    bench.merge_entry(path, {"workload": "batch8b", "v": 2}, {"device": "d", "date": "x", "commit": "a"})
    document = bench.merge_entry(path, {"workload": "c", "v": 3}, {"device": "d", "date": "y", "commit": "b"})
    assert document == json.loads(open(path).read())
    assert document == {"device": "d", "date": "y", "commit": "b",
                        "entries": [{"workload": "c", "v": 3}, {"workload": "batch8b", "v": 2}]}


def _fake_runner(outcomes: dict, calls: list):
    def run(request, timeout_s):
        calls.append((request, timeout_s))
        return outcomes[request["batch_size"]]
    return run


def test_a_failed_peer_attempt_is_recorded_with_its_reason_and_a_smaller_batch_tried(monkeypatch):
    calls = []
    ran = {"output_tok_per_s": 5.0, "output_tokens": 16, "batch_size": 1}
    monkeypatch.setattr(bench, "run_peer_attempt", _fake_runner(
        {2: {"error": "killed by SIGKILL (the OOM killer's signal: host memory?)"}, 1: ran}, calls))
    spec = bench.WORKLOADS["tiny"]
    found = bench.hf_offloaded(spec, "/model", bench.Deadline(1000))
    assert found["hf_offloaded_tok_per_s"] == 5.0 and found["hf_offloaded_batch"] == 1 and found["hf_offloaded"] == ran
    assert [(f["batch"], f["reason"]) for f in found["hf_offloaded_failures"]] == \
        [(2, "killed by SIGKILL (the OOM killer's signal: host memory?)")]
    assert [request["batch_size"] for request, _ in calls] == [2, 1]
    for request, timeout_s in calls:  # the same prompts each time, and a bounded subprocess
        assert request["lengths"] == [spec.prompt_len] * spec.num_seqs and request["seconds"] == spec.peer_seconds
        assert timeout_s == spec.peer_seconds + bench.PEER_LOAD_S


def test_when_every_peer_attempt_fails_each_reason_is_kept_and_no_rate_given(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "run_peer_attempt", _fake_runner(
        {2: {"error": "killed at its time limit of 100 s"}, 1: {"output_tok_per_s": 0.0, "output_tokens": 0}}, calls))
    found = bench.hf_offloaded(bench.WORKLOADS["tiny"], "/model", bench.Deadline(1000))
    assert found["hf_offloaded_tok_per_s"] is None and found["hf_offloaded_batch"] is None
    assert [(f["batch"], f["reason"]) for f in found["hf_offloaded_failures"]] == \
        [(2, "killed at its time limit of 100 s"), (1, "no tokens within its budget")]


def test_a_peer_attempt_with_no_time_left_is_recorded_as_not_attempted(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "run_peer_attempt", _fake_runner({}, calls))
    found = bench.hf_offloaded(bench.WORKLOADS["batch8b"], "/model", bench.Deadline(30))
    assert not calls
    assert [f["batch"] for f in found["hf_offloaded_failures"]] == [8, 4, 2, 1]
    assert all(f["reason"].startswith("not attempted") for f in found["hf_offloaded_failures"])


def test_the_peer_alone_completes_an_entry_measured_without_it_and_keeps_the_rest(tmp_path, monkeypatch):
    """--peer-only: a workload whose peer needs a call of its own (c512) gets it added to its --skip-peer entry."""
    measured = {"workload": "tiny", "device": bench.device_slug(), "date": "d", "commit": "a", "output_tok_per_s": 6.0,
                "decode_tok_per_s": 9.0, "skipped": {"hf_offloaded": "--skip-peer"}, "runs": {"stream_on": {}}}
    other = {"workload": "c", "device": "x"}
    entry_path = tmp_path / "measured.json"
    entry_path.write_text(json.dumps({"device": "x", "entries": [other, measured]}))
    calls = []
    ran = {"output_tok_per_s": 2.0, "decode_tok_per_s": 3.0, "output_tokens": 16, "batch_size": 2}
    monkeypatch.setattr(bench, "run_peer_attempt", _fake_runner({2: ran}, calls))
    monkeypatch.setattr(bench, "model_dir", lambda model, cache: "/model")
    out_dir = tmp_path / "out"
    bench.main(["--workload", "tiny", "--peer-only", str(entry_path), "--out-dir", str(out_dir)])
    [entry] = json.loads((out_dir / "long_context.json").read_text())["entries"]
    assert {k: entry[k] for k in measured if k != "skipped"} == {k: measured[k] for k in measured if k != "skipped"}
    assert entry["skipped"] == {} and entry["hf_offloaded_batch"] == 2 and entry["hf_offloaded"] == ran
    assert entry["vs_hf_offloaded"] == 3.0 and entry["vs_hf_offloaded_decode"] == 3.0
    assert entry["hf_offloaded_call"]["device"] == bench.device_slug() and len(calls) == 1


def test_the_peer_alone_refuses_a_file_without_the_entry_or_from_another_machine(tmp_path):
    path = tmp_path / "long_context.json"
    path.write_text(json.dumps({"entries": [{"workload": "c", "device": bench.device_slug()}]}))
    with pytest.raises(ValueError, match="no entry of workload 'tiny'.*--skip-peer"):
        bench.main(["--workload", "tiny", "--peer-only", str(path), "--out-dir", str(tmp_path)])
    path.write_text(json.dumps({"entries": [{"workload": "tiny", "device": "another-gpu"}]}))
    with pytest.raises(ValueError, match="ran on another-gpu"):
        bench.main(["--workload", "tiny", "--peer-only", str(path), "--out-dir", str(tmp_path)])
    with pytest.raises(OSError):
        bench.main(["--workload", "tiny", "--peer-only", str(tmp_path / "missing.json"), "--out-dir", str(tmp_path)])


def test_a_peer_killed_by_a_signal_is_described_by_the_signal():
    assert "SIGKILL" in bench.describe_exit(-9) and bench.describe_exit(3) == "exit status 3"


def test_the_bound_is_decode_tokens_over_the_slower_of_device_and_host_reads():
    rows, prompt, output, per_token, host_bytes = 3, 100, 9, 1000, 1_500_000
    weights, steps = 50_000, 11  # every decode step of either lane reads the weights on the device
    read = 0
    for _ in range(rows):
        for step in range(1, output):  # the prefill made token 0; decode step j attends prompt + j tokens
            read += (prompt + step) * per_token
    device_bytes = read - host_bytes + weights * steps
    for hbm, host in ((1.0, 1.0), (100.0, 0.001), (0.0001, 100.0), (1.6, 1.0)):
        seconds = max(device_bytes / (hbm * 1e9), host_bytes / (host * 1e9))
        bound = bench.decode_bound(rows, prompt, output, per_token, host_bytes, rows * (output - 1), hbm, host,
                                   weights, steps)
        assert bound["device_kv_bytes"] + bound["device_weight_bytes"] == device_bytes
        assert bound["host_kv_bytes"] == host_bytes
        assert bound["bound_tok_per_s"] == pytest.approx(rows * (output - 1) / seconds)
        assert bound["bound_limited_by"] == ("host" if host_bytes / host >= device_bytes / hbm else "device")


def test_host_step_parts_are_shares_of_the_timed_calls_host_step_seconds():
    parts = lambda steps, s, k, w: {"host_step_parts": {"steps": steps, "seconds": s, "kernel_seconds": k,
                                                         "device_wait_seconds": w}}
    run = {"lane_stats_before": parts(2, 1.0, 0.5, 0.25), "lane_stats": parts(6, 3.0, 2.0, 0.5)}
    got = bench.host_step_parts(run)
    assert got["steps"] == 4 and got["ms_per_step"] == pytest.approx(500.0)
    assert (got["kernel_share"], got["device_wait_share"], got["rest_share"]) == pytest.approx((0.75, 0.125, 0.125))
    assert bench.host_step_parts({"lane_stats": parts(0, 0.0, 0.0, 0.0)}) is None  # no host step in the call


def test_host_reads_are_the_lane_stats_deltas_over_the_timed_call():
    run = {"lane_stats_before": {"stream_bytes": 100, "host_kernel_bytes": 1000},
           "lane_stats": {"stream_bytes": 400, "host_kernel_bytes": 1900}}
    assert bench.host_reads(run) == {"stream_bytes": 300, "host_kernel_bytes": 900, "streamed_share": 0.25}
    assert bench.host_reads({"lane_stats": {}})["streamed_share"] is None  # an engine without the counters


@pytest.mark.skipif(torch.cuda.is_available(), reason="off CUDA only: on CUDA the stream parts are measured")
def test_off_cuda_the_ceilings_measure_the_host_kernel_alone():
    ceilings = measure_ceilings(seconds=0.05, batch=1, tokens=256)
    assert ceilings["host_kernel_gbps"] > 0 and ceilings["kv_bytes_per_call"] == 2 * 256 * 8 * 128 * 2
    assert all(ceilings[key] is None for key in CEILING_KEYS - {"host_kernel_gbps"})


def test_together_times_both_paths_in_one_window_and_sums_their_rates():
    running, overlapped = set(), []

    def path(name, seconds):
        def call():
            running.add(name)
            overlapped.append(len(running) == 2)
            time.sleep(seconds)
            running.discard(name)
        return call

    with CpuAttentionExecutor(num_threads=1, warm=False) as executor:
        found = together(executor, path("kernel", 0.01), path("stream", 0.005), 10**7, 0.2)
    assert found["sum_gbps"] == found["kernel_gbps"] + found["stream_gbps"]
    assert 0.2 < found["kernel_gbps"] <= 1.0 and 0.4 < found["stream_gbps"] <= 2.0  # 1e7 bytes a 10 / 5 ms call
    assert any(overlapped)  # some call of one path began while the other's was running


def test_the_peer_sets_its_prefill_apart_from_its_decode():
    from benchmarks.peers import FirstToken, hf_generate
    from offload_engine.tiny_model import default_model_dir

    first = FirstToken()
    first.put("the prompt")
    assert first.seconds() is None  # the prompt's put is not a token
    first.put("token 0")
    assert first.seconds() >= 0
    prompts = bench.random_prompts([24] * 3, 400, seed=1)
    found = hf_generate(default_model_dir(), prompts, 6, None, 2, 60.0)
    assert "error" not in found, found
    assert found["output_tokens"] == 18 and found["batches_run"] == 2
    assert 0 < found["prefill_seconds"] < found["seconds"]
    # Tokens after each batch's first, over the time after it.
    assert found["decode_tok_per_s"] == pytest.approx((18 - 3) / (found["seconds"] - found["prefill_seconds"]))


def test_an_ab_run_takes_the_values_in_turn_and_restores_the_switch(tmp_path, monkeypatch):
    from benchmarks import ab_long_context as ab

    monkeypatch.setenv("BENCH_TQDM", "0")
    monkeypatch.delenv("OFFLOAD_ENGINE_PROMOTE_IN_PARTS", raising=False)
    seen, real = [], ab.engine_run
    monkeypatch.setattr(ab, "engine_run", lambda *a: seen.append(ab.os.environ["OFFLOAD_ENGINE_PROMOTE_IN_PARTS"])
                        or real(*a))
    out = tmp_path / "ab.json"
    ab.main(["--workload", "tiny", "--env", "OFFLOAD_ENGINE_PROMOTE_IN_PARTS", "--values", "0,1", "--rounds", "1",
             "--out", str(out)])
    result = json.loads(out.read_text())
    assert seen == ["0", "1"] and [r["value"] for r in result["runs"]] == seen
    assert all(r["decode_tok_per_s"] > 0 and r["error"] is None for r in result["runs"])
    assert {v: m["runs"] for v, m in result["medians"].items()} == {"0": 1, "1": 1}
    assert result["last_over_first"] > 0 and "OFFLOAD_ENGINE_PROMOTE_IN_PARTS" not in ab.os.environ
    with pytest.raises(ValueError, match="--values"):
        ab.main(["--env", "X", "--values", "1", "--out", str(out)])
