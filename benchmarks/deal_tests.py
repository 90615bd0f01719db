"""Deal test files out to N pytest processes so that they finish together (`run_on_device.sh test-gpu-shards`).

    python -m benchmarks.deal_tests N SECONDS_JSON FILE...   # prints N lines, each a shard's files
    python -m benchmarks.deal_tests --seconds JUNIT_XML... > SECONDS_JSON

Each file weighs the seconds its tests took in the last run (SECONDS_JSON: {path: seconds}, written by the second
form from pytest's --junitxml files); a file that is not there weighs its size times the median seconds per byte of
the files that are. Files go heaviest first to the lightest shard (longest processing time first), so the slowest
shard ends within one file's time of the mean; sizes alone say little of a file's time (numba's compiles, engines
started per test). No torch: it runs before the tests, on any host.
"""
import json
import os
import statistics
import sys
import xml.etree.ElementTree as ET


def file_of(classname: str) -> str | None:
    """The test file of a junit classname ("tests.engine.test_load" or "tests.engine.test_load.TestX")."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = os.path.join(*parts[:end]) + ".py"
        if os.path.exists(path):
            return path
    return None


def seconds_by_file(junit_paths: list[str]) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for path in junit_paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            test_file = file_of(case.get("classname", ""))
            if test_file is not None:
                seconds[test_file] = seconds.get(test_file, 0.0) + float(case.get("time", 0.0))
    return {f: round(s, 2) for f, s in sorted(seconds.items())}


def weights(files: list[str], seconds: dict[str, float]) -> dict[str, float]:
    known = [seconds[f] / os.path.getsize(f) for f in files if f in seconds and os.path.getsize(f) > 0]
    per_byte = statistics.median(known) if known else 1.0
    return {f: seconds.get(f, os.path.getsize(f) * per_byte) for f in files}


def deal(files: list[str], shards: int, seconds: dict[str, float]) -> list[list[str]]:
    weight = weights(files, seconds)
    loads, dealt = [0.0] * shards, [[] for _ in range(shards)]
    for f in sorted(files, key=lambda f: -weight[f]):
        lightest = loads.index(min(loads))
        dealt[lightest].append(f)
        loads[lightest] += weight[f]
    return dealt


def main(argv: list[str]) -> int:
    if argv[:1] == ["--seconds"]:
        print(json.dumps(seconds_by_file(argv[1:]), indent=1))
        return 0
    if len(argv) < 3 or not argv[0].isdigit() or int(argv[0]) < 1:
        raise SystemExit("usage: deal_tests N SECONDS_JSON FILE... | deal_tests --seconds JUNIT_XML...")
    seconds = json.load(open(argv[1])) if os.path.exists(argv[1]) else {}
    for shard in deal(argv[2:], int(argv[0]), seconds):
        print(" ".join(shard))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
