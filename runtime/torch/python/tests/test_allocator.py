"""steppool's Python package over its C ABI, on the simulated device, without PyTorch."""

import pickle
import sys
import threading
import urllib.request
import warnings
from typing import List

import pytest

import steppool
import steppool.torch as sp

MIB = 1 << 20


def used(phase: str) -> int:
    return sum(p.used_bytes for p in sp.phases() if p.phase == phase)


def test_allocations_land_in_the_phase_entered():
    assert sp.current_phase() == "untagged"
    with sp.phase("py_basic"):
        assert sp.current_phase() == "py_basic"
        ptr = sp.alloc(3 * MIB)
        assert ptr != 0
        assert used("py_basic") == 3 * MIB
        usage = next(p for p in sp.phases() if p.phase == "py_basic")
        assert (usage.scope, usage.device) == ("persistent", 0)
        assert usage.reserved_bytes >= usage.used_bytes
        assert 0.0 <= usage.fragmentation_ratio < 1.0
        sp.free(ptr, 3 * MIB)
    assert used("py_basic") == 0
    assert sp.current_phase() == "untagged"
    assert sp.telemetry()["driver"] == "simulated"


def test_bad_sizes_raise_with_their_numbers():
    with pytest.raises(steppool.InvalidArgumentError) as error:
        sp.alloc(-3)
    assert (error.value.kind, error.value.details["size"]) == ("bad_size", -3)
    assert sp.alloc(0) == 0
    with pytest.raises(steppool.InvalidArgumentError) as error:
        sp.alloc(MIB, device=9)
    assert error.value.details["device"] == 9
    with sp.phase("py_sizes"):
        ptr = sp.alloc(2 * MIB)
        with pytest.raises(steppool.InvalidArgumentError) as error:
            sp.free(ptr, MIB)
        assert error.value.kind == "size_mismatch"
        assert error.value.details["allocated_bytes"] == 2 * MIB
        assert used("py_sizes") == 2 * MIB, "a refused free frees nothing"
        sp.free(ptr, 2 * MIB)


def test_null_and_unknown_pointers():
    sp.free(0, 0)
    with pytest.raises(steppool.UnknownPointerError) as error:
        sp.free(0xDEAD0000, 64)
    assert error.value.ptr == 0xDEAD0000
    assert sp.telemetry()["counters"]["null_frees"] >= 1


def test_out_of_memory_has_a_verdict():
    total = sp.telemetry()["devices"][0]["total_bytes"]
    held: List[int] = []
    piece = total // 4
    with sp.phase("py_oom"):
        with pytest.raises(steppool.OutOfMemoryError) as error:
            for _ in range(8):
                held.append(sp.alloc(piece))
        for ptr in held:
            sp.free(ptr, piece)
    assert error.value.requested_bytes == piece
    assert error.value.verdict == "demand"
    assert error.value.oom is not None and error.value.oom["device_total_bytes"] == total
    failure = sp.last_failure()
    assert failure is not None
    assert (failure.phase, failure.verdict, failure.requested_bytes) == ("py_oom", "demand", piece)


def test_a_step_releases_its_phases_and_late_frees_are_caught():
    first = sp.step()
    with sp.phase("py_step", scope="step"):
        ptr = sp.alloc(4 * MIB)
    assert used("py_step") == 4 * MIB
    second = sp.step()
    assert second.index == first.index + 1
    report = sp.last_step_report()
    assert report is not None
    phase = next(p for p in report["phases"] if p["phase"] == "py_step")
    assert phase["released_bytes"] == 4 * MIB
    assert used("py_step") == 0
    with pytest.raises(steppool.UseAfterReleaseError) as error:
        sp.free(ptr, 4 * MIB)
    assert (error.value.step, error.value.phase) == (first.index, "py_step")
    with sp.step() as third:
        assert sp.telemetry()["active_step"] == third.index
    assert sp.telemetry()["active_step"] is None


def test_a_carrying_phase_keeps_what_a_step_leaves_for_the_next():
    # Gradients made in one step's backward pass and set to None in the next step.
    with pytest.raises(steppool.InvalidArgumentError, match="only a step-scoped phase carries"):
        sp.phase("py_carry", carry=True)
    sp.step()
    with sp.phase("py_carry", scope="step", carry=True):
        gradient = sp.alloc(4 * MIB)
    sp.step()
    report = sp.last_step_report()
    assert next(p for p in report["phases"] if p["phase"] == "py_carry")["released_bytes"] == 0
    assert used("py_carry") == 4 * MIB
    sp.free(gradient, 4 * MIB)
    assert used("py_carry") == 0


def test_a_phase_for_all_threads_routes_a_thread_without_its_own():
    # As autograd's backward thread allocates while loss.backward() runs inside the phase.
    def on_a_thread():
        seen = {}

        def body():
            ptr = sp.alloc(MIB)
            seen["phase"], seen["used"] = sp.current_phase(), used("py_all_threads")
            sp.free(ptr, MIB)

        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        return seen

    with sp.step():
        assert on_a_thread()["phase"] == "untagged"
        with sp.phase("py_all_threads", scope="step", threads="all"):
            assert on_a_thread() == {"phase": "py_all_threads", "used": MIB}
            with sp.phase("py_main_only", scope="step"):
                assert on_a_thread()["phase"] == "py_all_threads", "a thread-only phase inside routes nobody else"
        assert on_a_thread()["phase"] == "untagged"
    with pytest.raises(steppool.InvalidArgumentError):
        sp.phase("py_bad", threads="some")


def test_scopes_and_strategies_are_checked():
    with pytest.raises(steppool.InvalidArgumentError):
        sp.phase("py_bad", scope="epoch")
    with pytest.raises(steppool.InvalidArgumentError):
        sp.phase("py_bad", strategy="buddy")
    with sp.phase("py_scoped", scope="persistent"):
        pass
    with pytest.raises(steppool.InvalidArgumentError) as error:
        with sp.phase("py_scoped", scope="step"):
            pass
    assert "persistent" in error.value.message
    assert sp.current_phase() == "untagged"


def test_each_thread_has_its_own_phase():
    barrier = threading.Barrier(3)
    seen = {}
    errors: List[BaseException] = []

    def work(index: int) -> None:
        try:
            with sp.phase(f"py_thread_{index}"):
                ptr = sp.alloc((index + 1) * MIB)
                barrier.wait()  # all three threads hold their allocation now
                seen[index] = sp.current_phase()
                barrier.wait()
                sp.free(ptr, (index + 1) * MIB, stream=2)  # freed on another stream
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    barrier.wait()
    live = {i: used(f"py_thread_{i}") for i in range(2)}
    barrier.wait()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert live == {0: MIB, 1: 2 * MIB}, "both threads' allocations were live at once"
    assert seen == {0: "py_thread_0", 1: "py_thread_1"}
    assert sp.telemetry()["counters"]["other_stream_frees"] >= 2


def test_snapshot_and_metrics(tmp_path):
    sp.start_recording(10_000)
    with sp.phase("py_recorded"):
        ptr = sp.alloc(MIB)
        sp.free(ptr, MIB)
    path = tmp_path / "snapshot.pickle"
    sp.snapshot(str(path))
    with open(path, "rb") as file:
        snapshot = pickle.load(file)
    assert "segments" in snapshot and "device_traces" in snapshot
    port = sp.serve_metrics("127.0.0.1:0")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            body = response.read().decode()
        assert "py_recorded" in body
    finally:
        sp.stop_metrics()


def test_memory_readers_and_empty_cache():
    with sp.phase("py_readers"):
        ptr = sp.alloc(8 * MIB)
        assert sp.memory_allocated() >= 8 * MIB
        assert sp.max_memory_reserved() >= sp.memory_reserved() >= 8 * MIB
        sp.free(ptr, 8 * MIB)
    assert sp.empty_cache() >= 0
    with pytest.raises(steppool.InvalidArgumentError):
        sp.set_memory_fraction(2.0)


def test_init_runs_once():
    with pytest.raises(steppool.AlreadyInitialisedError) as error:
        sp.init()
    assert "planned" in error.value.message


class _FakeCuda:
    @staticmethod
    def is_available() -> bool:
        return True


class _FakeTorch:
    """A loaded PyTorch with a GPU, as the package sees it through ``sys.modules``."""

    cuda = _FakeCuda()


def test_step_phases_stay_steppools_own_on_the_simulated_device_even_with_torch_loaded(monkeypatch):
    # A CUDA build of PyTorch in the process does not turn a simulated runtime's phases into
    # torch.cuda.MemPool phases (only persistent ones): its memory cannot back tensors.
    monkeypatch.setitem(sys.modules, "torch", _FakeTorch())
    monkeypatch.setattr(sp._State, "on_gpu", None)
    sp.step()
    with sp.phase("py_step_with_torch", scope="step"):
        ptr = sp.alloc(MIB)
        sp.free(ptr, MIB)
    assert sp._State.on_gpu is False


def test_a_step_that_released_memory_pytorch_held_warns_once_per_phase(monkeypatch):
    # As PyTorch's allocator: every tensor PyTorch drops is freed, so memory a step end still
    # finds live in a step-scoped phase is memory PyTorch holds.
    monkeypatch.setattr(sp._State, "allocator", object())
    monkeypatch.setattr(sp._State, "warned", set())
    monkeypatch.setattr(sp, "_make_blas_workspace", lambda backward=False: None)
    sp.step()
    with sp.phase("py_outlives", scope="step"):
        sp.alloc(2 * MIB)
    with pytest.warns(sp.StepScopeWarning, match=r"2097152 bytes of the step-scoped phase 'py_outlives'"):
        sp.step()
    with sp.phase("py_outlives", scope="step"):
        ptr = sp.alloc(MIB)
        sp.free(ptr, MIB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sp.step()  # nothing held: no warning
        with sp.phase("py_outlives", scope="step"):
            sp.alloc(MIB)
        sp.step()  # held again, but this phase was warned about already
