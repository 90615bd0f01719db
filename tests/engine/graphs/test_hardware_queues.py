"""CUDA_DEVICE_MAX_CONNECTIONS: set on import unless the user chose it or CUDA is already up; warned about if narrow."""
import os
import subprocess
import sys
import warnings

import pytest

from offload_engine.engine.graphs import hardware_queues


def imported_value(env: dict, before: str = "") -> str:
    """CUDA_DEVICE_MAX_CONNECTIONS as a fresh interpreter sees it after `before` and importing offload_engine."""
    code = f"{before}\nimport offload_engine, os\nprint(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'))"
    clean = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    done = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          check=True)
    return done.stdout.strip().splitlines()[-1]


def test_import_sets_32_unless_the_user_chose():
    assert imported_value({}) == "32"
    assert imported_value({"CUDA_DEVICE_MAX_CONNECTIONS": "4"}) == "4"


def test_narrow_or_missing_setting_warns(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    with pytest.warns(UserWarning, match="fewer than 32"):
        hardware_queues.warn_if_narrow()
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    with pytest.warns(UserWarning, match="Import offload_engine first"):
        hardware_queues.warn_if_narrow()
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hardware_queues.warn_if_narrow()
