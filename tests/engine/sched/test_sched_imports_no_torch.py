"""The policy modules of engine/sched/ import neither torch nor numpy: each is imported alone in a fresh interpreter."""
import pkgutil
import subprocess
import sys

import pytest

import offload_engine.engine.sched as sched

MODULES = sorted(info.name for info in pkgutil.iter_modules(sched.__path__))


def test_every_module_of_sched_is_checked():
    assert {"scheduler", "placement", "plan", "host_stay", "lane_stats", "block_manager"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_a_sched_module_imports_no_torch_and_no_numpy(module):
    check = (f"import sys, offload_engine.engine.sched.{module}\n"
             "print(sorted(name for name in ('torch', 'numpy') if name in sys.modules))")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"offload_engine.engine.sched.{module} imports {out.strip()}"
