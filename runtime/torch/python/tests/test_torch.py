"""The PyTorch side: what runs without torch here, and what needs a CUDA build of torch (skipped,
with the reason, where it is absent)."""

import importlib.util
import subprocess
import sys
import textwrap

import pytest

import steppool
import steppool.torch as sp

HAS_TORCH = importlib.util.find_spec("torch") is not None


def torch_cuda() -> bool:
    if not HAS_TORCH:
        return False
    import torch

    return bool(torch.cuda.is_available())


def test_use_refuses_the_simulated_device():
    with pytest.raises(steppool.InvalidArgumentError) as error:
        sp.use(device="sim")
    assert "sim" in error.value.message


@pytest.mark.skipif(HAS_TORCH, reason="checks the error raised when PyTorch is not installed")
def test_use_without_torch_says_so():
    with pytest.raises(steppool.TorchUnavailableError) as error:
        sp.use()
    assert "pip install torch" in error.value.message
    assert isinstance(error.value, ImportError)


@pytest.mark.skipif(not torch_cuda(), reason="needs a CUDA build of PyTorch and a GPU")
def test_use_makes_steppool_pytorchs_allocator():
    # A fresh process: use() must run before CUDA is initialised.
    script = textwrap.dedent(
        """
        import torch, steppool.torch as sp
        sp.use(strategy="planned", device="cuda")
        weights = torch.ones(1 << 20, device="cuda")
        sp.step()
        with sp.phase("activations", scope="step"):
            x = weights * 2
            assert float(x.sum()) == 2 * (1 << 20)
            del x
        sp.step()
        names = {p.phase for p in sp.phases()}
        assert {"untagged", "activations"} <= names, names
        assert sp.memory_allocated() >= 4 << 20
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True)


@pytest.mark.skipif(not torch_cuda(), reason="needs a CUDA build of PyTorch and a GPU")
def test_use_after_cuda_started_is_refused():
    script = textwrap.dedent(
        """
        import torch, steppool, steppool.torch as sp
        torch.ones(1, device="cuda")
        try:
            sp.use(device="cuda")
        except steppool.CudaAlreadyInitialisedError as error:
            print("refused:", error)
        else:
            raise SystemExit("use() after CUDA started was accepted")
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True)


@pytest.mark.skipif(not torch_cuda(), reason="needs a CUDA build of PyTorch and a GPU")
def test_a_persistent_phase_through_a_mempool():
    script = textwrap.dedent(
        """
        import torch, steppool.torch as sp
        with sp.phase("kv_cache"):
            cache = torch.zeros(4 << 20, device="cuda")
        assert any(p.phase == "kv_cache" and p.used_bytes >= 16 << 20 for p in sp.phases())
        try:
            with sp.phase("activations", scope="step"):
                pass
        except Exception as error:
            assert "persistent" in str(error)
        else:
            raise SystemExit("a step scope under MemPool was accepted")
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True)
