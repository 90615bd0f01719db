"""The command line speaks to a newcomer: a mistake they can fix is one `offload-engine: error:` line and exit
status 2, never a traceback; a good run prints its output; the demo's greedy check against transformers passes."""
import shutil

import pytest

from offload_engine.cli import main
from offload_engine.demo import run_demo


def _user_error(capsys, argv: list[str]) -> str:
    """Runs the command, checks it failed the way a user's mistake should, and returns the one stderr line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offload-engine: error: "), err
    return lines[0]


def test_missing_model_directory_is_one_line(capsys):
    line = _user_error(capsys, ["generate", "--model", "/nonexistent", "--prompt", "hi"])
    assert "/nonexistent" in line


def test_unsupported_architecture_is_one_line(text_model_dir, tmp_path, capsys):
    model_dir = tmp_path / "gpt2"
    shutil.copytree(text_model_dir, model_dir)
    config = (model_dir / "config.json").read_text().replace("Qwen3ForCausalLM", "GPT2LMHeadModel")
    (model_dir / "config.json").write_text(config.replace('"qwen3"', '"gpt2"'))
    line = _user_error(capsys, ["generate", "--model", str(model_dir), "--prompt", "hi", "--device", "cpu"])
    assert "Qwen3ForCausalLM" in line  # names what is supported


def test_pickled_weights_are_one_line(text_model_dir, tmp_path, capsys):
    model_dir = tmp_path / "pickled"
    model_dir.mkdir()
    shutil.copy(f"{text_model_dir}/config.json", model_dir)
    (model_dir / "pytorch_model.bin").write_bytes(b"not even read")
    line = _user_error(capsys, ["generate", "--model", str(model_dir), "--prompt", "hi", "--device", "cpu"])
    assert "safetensors" in line


def test_negative_temperature_is_one_line(text_model_dir, capsys):
    line = _user_error(capsys, ["generate", "--model", text_model_dir, "--prompt", "hi", "--temperature", "-1"])
    assert "temperature" in line


def test_demo_sizes_are_checked(capsys):
    line = _user_error(capsys, ["demo", "--requests", "0"])
    assert "--requests" in line


def test_unknown_flag_is_one_line(text_model_dir, capsys):
    line = _user_error(capsys, ["generate", "--model", text_model_dir, "--prompt", "hi", "--no-such-flag"])
    assert "--no-such-flag" in line and "--help" in line


def test_truncated_weights_are_one_line(text_model_dir, tmp_path, capsys):
    model_dir = tmp_path / "truncated"
    shutil.copytree(text_model_dir, model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    line = _user_error(capsys, ["generate", "--model", str(model_dir), "--prompt", "hi", "--device", "cpu"])
    assert str(weights) in line and "re-download" in line


def test_config_that_is_not_json_is_one_line(text_model_dir, tmp_path, capsys):
    model_dir = tmp_path / "bad-json"
    shutil.copytree(text_model_dir, model_dir)
    (model_dir / "config.json").write_text('{"vocab_size": ')
    line = _user_error(capsys, ["generate", "--model", str(model_dir), "--prompt", "hi", "--device", "cpu"])
    assert "config.json is not valid JSON" in line


def test_demo_prompt_longer_than_the_model_names_the_demo_flag(text_model_dir, monkeypatch, capsys):
    from offload_engine import demo

    monkeypatch.setattr(demo, "default_model_dir", lambda: text_model_dir)
    line = _user_error(capsys, ["demo", "--prompt-len", "5000", "--device", "cpu"])
    assert "use --prompt-len 511 or less" in line  # a flag the demo has (it has no --max-model-len)


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    from offload_engine import demo

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_demo", interrupted)
    try:
        main(["demo"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left the command as a traceback")
    except SystemExit as exit_info:
        assert exit_info.code == 130
    else:
        pytest.fail("the command ended normally after Ctrl-C")
    assert capsys.readouterr().err == "offload-engine: interrupted\n"


def test_kv_placement_choices_match_the_engine():
    """The CLI spells the choices out so that parsing imports no torch; they must stay the engine's."""
    from offload_engine import cli, config

    assert cli.KV_PLACEMENTS == config.KV_PLACEMENTS


def test_generate_prints_each_prompt(text_model_dir, capsys):
    main(["generate", "--model", text_model_dir, "--prompt", "The quick", "--prompt", "offload",
          "--max-tokens", "4", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "--- 'The quick'" in out and "--- 'offload'" in out


def test_generate_json_is_vllms_request_output_with_the_first_completion_on_top(text_model_dir, capsys):
    import json

    main(["generate", "--model", text_model_dir, "--prompt", "The quick", "--max-tokens", "4", "--device", "cpu",
          "--json"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    first = record["outputs"][0]
    assert (record["text"], record["token_ids"], record["finish_reason"]) == (
        first["text"], first["token_ids"], first["finish_reason"])
    assert record["prompt"] == "The quick" and record["kv_location"] == "gpu" and len(first["token_ids"]) <= 4


def test_demo_greedy_check_matches_transformers(text_model_dir, capsys):
    summary = run_demo(num_requests=4, prompt_len=40, max_tokens=8, device="cpu", model_dir=text_model_dir)
    assert summary["greedy_requests"] == 4
    assert summary["greedy_matches"] == summary["greedy_requests"]
    assert summary["greedy_kv_location"] == {"gpu": 2, "cpu": 2}
    assert "4/4 requests match transformers" in capsys.readouterr().out


def test_demo_exits_1_and_says_where_a_request_differs(text_model_dir, monkeypatch, capsys):
    from offload_engine import demo

    real_reference = demo._transformers_greedy

    def wrong_for_request_1(model_dir, prompts, max_tokens):
        reference = real_reference(model_dir, prompts, max_tokens)
        return [[t + 1 for t in ids] if i == 1 else ids for i, ids in enumerate(reference)]

    monkeypatch.setattr(demo, "_transformers_greedy", wrong_for_request_1)
    monkeypatch.setattr(demo, "default_model_dir", lambda: text_model_dir)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--requests", "2", "--prompt-len", "20", "--max-tokens", "4", "--device", "cpu"])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "3/4 requests match" in out
    assert "request 1 " in out and "first differs at new token 0" in out


def test_bench_runs_the_suite_of_the_checkout_as_its_own_program(monkeypatch, tmp_path):
    """`bench` runs benchmarks/bench_throughput.py from the source checkout in a process of its own (the package does
    not import benchmarks/), with the out dir made absolute, and exits 1 when the suite fails."""
    import subprocess
    from pathlib import Path

    calls = []

    def fake_run(command, env):
        calls.append((command, env))
        return subprocess.CompletedProcess(command, returncode=len(calls) - 1)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    main(["bench", "--workloads", "a", "--out-dir", "out"])
    with pytest.raises(SystemExit) as exit_info:
        main(["bench"])
    assert exit_info.value.code == 1
    command, env = calls[0]
    root = Path(__file__).resolve().parent.parent
    assert command[1:] == ["-m", "benchmarks.bench_throughput", "suite", "--profile", "small", "--workloads", "a",
                           "--out-dir", str(tmp_path / "out")]
    assert str(root) in env["PYTHONPATH"].split(":")


def test_bench_without_a_source_checkout_is_one_line(monkeypatch, capsys, tmp_path):
    from offload_engine import cli

    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "offload_engine" / "cli.py"))
    line = _user_error(capsys, ["bench"])
    assert "source checkout" in line
