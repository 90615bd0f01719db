"""The host lane's whole-step graphs capture their matrix products on a few SMs (engine/graphs/host_step_graphs.py)."""
import pytest
import torch

from offload_engine.engine.graphs.host_step_graphs import SM_SHARE, few_sms
from tests.conftest import requires_cuda


@requires_cuda
def test_few_sms_targets_a_share_of_the_sms_and_restores_both_settings():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    library, carveout = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    with pytest.raises(KeyError):  # restored on the way out of a failure too
        with few_sms(torch.device("cuda", 0)):
            assert torch._C._get_sm_carveout_experimental() == sms - max(1, sms // SM_SHARE)
            assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
            a = torch.randn(24, 512, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(a @ w.T, (a.double() @ w.double().T).to(a.dtype), rtol=2e-2, atol=2e-1)
            raise KeyError
    assert torch.backends.cuda.preferred_blas_library() == library
    assert torch._C._get_sm_carveout_experimental() == carveout
