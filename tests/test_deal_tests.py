"""benchmarks/deal_tests.py: test files dealt to shards by last run's seconds, heaviest first to the lightest."""
import json
import os

from benchmarks import deal_tests


def write(path, size):
    path.write_text("x" * size)
    return str(path)


def test_every_file_lands_in_one_shard_and_the_heavy_ones_apart(tmp_path):
    files = [write(tmp_path / f"test_{i}.py", 10) for i in range(7)]
    seconds = {files[0]: 100.0, files[1]: 90.0, files[2]: 10.0, files[3]: 10.0, files[4]: 5.0, files[5]: 5.0,
               files[6]: 1.0}
    shards = deal_tests.deal(files, 3, seconds)
    assert sorted(f for shard in shards for f in shard) == sorted(files)
    loads = [sum(seconds[f] for f in shard) for shard in shards]
    assert max(loads) == 100.0  # the heaviest file alone; the rest share the other two shards
    assert not any(files[0] in shard and files[1] in shard for shard in shards)


def test_a_file_without_seconds_weighs_its_size_at_the_median_rate(tmp_path):
    known = [write(tmp_path / "test_a.py", 100), write(tmp_path / "test_b.py", 100)]
    new = write(tmp_path / "test_new.py", 1000)
    weight = deal_tests.weights(known + [new], {known[0]: 1.0, known[1]: 3.0})
    assert weight[new] == 1000 * 0.02


def test_junit_cases_sum_into_their_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("tests/engine")
    write(tmp_path / "tests/engine/test_load.py", 1)
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite>'
                     '<testcase classname="tests.engine.test_load" name="a" time="1.5"/>'
                     '<testcase classname="tests.engine.test_load.TestX" name="b" time="2.0"/>'
                     '<testcase classname="gone.module" name="c" time="9"/>'
                     '</testsuite></testsuites>')
    assert deal_tests.seconds_by_file([str(junit)]) == {os.path.join("tests", "engine", "test_load.py"): 3.5}


def test_main_prints_one_line_per_shard(tmp_path, capsys):
    files = [write(tmp_path / f"test_{i}.py", 10 * (i + 1)) for i in range(4)]
    seconds = tmp_path / "seconds.json"
    seconds.write_text(json.dumps({}))
    assert deal_tests.main(["2", str(seconds)] + files) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and sorted(" ".join(lines).split()) == sorted(files)
