"""The CUDA-only code paths on a CPU (issue #36): device selection and presets (hpctrain/runtime/device.py),
the pinned non-blocking transfers and the late read of the step's verdict, the step's device placement under
``FakeTensorMode`` with fake CUDA tensors (tests/fake_cuda.py), the CUDA profiler's set-up
(hpctrain/profiling/cuda_trace.py) and the sync-debug warning filter (hpctrain/profiling/host_reads.py)."""
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fake_cuda import FakeCuda, fake_cuda_tensors
from hpctrain.config import OptimConfig
from hpctrain.optim.flat import FlatOptimizer
from hpctrain.optim.loss_scale import DynamicLossScaler
from hpctrain.parallel.data_parallel import FlatParams
from hpctrain.parallel.slab import SlabSpec
from hpctrain.profiling import cuda_trace
from hpctrain.profiling.host_reads import sync_warnings
from hpctrain.runtime.device import DeviceError, configure_matmul, describe, peak_tflops, select_device
from hpctrain.runtime.launcher import RankInfo
from hpctrain.train.trainer import Trainer
from hpctrain.train.verdict import StepVerdict

CUDA = torch.device("cuda", 0)


def rank_info(local_rank=1, local_size=2):
    return RankInfo(rank=local_rank, size=local_size, local_rank=local_rank, local_size=local_size, node=0,
                    num_nodes=1, hostname="h", node_of_rank=[0] * local_size,
                    local_rank_of_rank=list(range(local_size)), launcher=None, mpi_library="test")


def test_select_device_binds_the_node_local_gpu_and_names_the_missing_one(monkeypatch):
    cuda = FakeCuda(count=4).install(monkeypatch)
    with pytest.warns(UserWarning, match="6 ranks share 4 visible GPU"):
        assert select_device("cuda", rank_info(local_rank=5, local_size=6)) == torch.device("cuda", 1)
    assert cuda.index == 1  # set_device: the rank's GPU (5 % 4)
    assert select_device("auto", rank_info(local_rank=2)) == torch.device("cuda", 2)
    assert select_device("cpu", rank_info()) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert select_device("auto", rank_info()) == torch.device("cpu")
    with pytest.raises(DeviceError, match=r"torch sees no CUDA device on .*CUDA_VISIBLE_DEVICES=<unset>"):
        select_device("cuda", rank_info())


def test_the_gpu_presets_matmul_flags_and_description(monkeypatch):
    FakeCuda(name="NVIDIA H100 80GB HBM3").install(monkeypatch)
    assert peak_tflops(CUDA, torch.bfloat16) == 989.0 and peak_tflops(CUDA, torch.float32) == 494.0
    assert peak_tflops(CUDA, torch.float32, allow_tf32=False) == 0.0
    assert describe(CUDA) == "cuda:0 (NVIDIA H100 80GB HBM3)" and describe(torch.device("cpu")) == "cpu"
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        configure_matmul(CUDA, True)
        configure_matmul(torch.device("cpu"), False)  # the host: untouched
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        configure_matmul(CUDA, False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_batches_go_to_the_gpu_from_pinned_memory_without_blocking():
    host = SimpleNamespace(device=torch.device("cpu"))
    batch = [torch.zeros(2, 8, dtype=torch.int64), torch.ones(2, 8, dtype=torch.int64)]
    assert Trainer._to_device(host, *batch) == batch  # the host: the same tensors
    with fake_cuda_tensors() as pinning:
        batch = [torch.zeros(2, 8, dtype=torch.int64), torch.ones(2, 8, dtype=torch.int64)]
        moved = Trainer._to_device(SimpleNamespace(device=CUDA), *batch)
        assert [t.device for t in moved] == [CUDA, CUDA]
    assert pinning.copies == [("to_device", True, True)] * 2  # (non-blocking, from pinned memory)


def fake_cuda_step(cuda, pinning, scaler_device=CUDA, step_tensor_on_host=False):
    """One float16 step's device side on fake CUDA tensors: the verdict's reduction and decision, the fused
    AdamW update with the device coefficient and skip flag, the loss scaler; then ``start_read``.
    Returns (the verdict, the optimizer, the scaler, the copies made before ``start_read``)."""
    params = []
    for spec in (SlabSpec("w", (16, 8)), SlabSpec("b", (16,))):
        p = nn.Parameter(torch.zeros(spec.local_shape, dtype=torch.float16, device=CUDA))
        p.spec = spec
        params.append(p)
    flat = FlatParams(params, None)
    opt = FlatOptimizer(flat, OptimConfig(weight_decay=0.1))
    if step_tensor_on_host:
        opt._step_tensor = torch.zeros(())
    scaler = DynamicLossScaler(device=scaler_device)
    sums = []
    world = SimpleNamespace(recurring_allreduce=lambda vector: lambda: sums.append(vector.device))
    verdict = StepVerdict(world, CUDA, clip=1.0, nonfinite="skip", max_skipped_steps=3, scaler_enabled=True)
    flat.grad_buffer.fill_(1.0)
    verdict.reduce(torch.zeros((), device=CUDA), opt.grad_norm_sq_tensor(), "", False)
    coef, skip = verdict.decide(scaler)
    assert coef.device == CUDA and skip.device == CUDA and sums == [CUDA]
    opt.step(1e-3, coef, found_inf=skip)
    copies = list(pinning.copies)
    verdict.start_read()
    return verdict, opt, scaler, copies


def test_the_step_keeps_every_tensor_on_the_gpu_and_reads_late_into_pinned_memory(monkeypatch):
    cuda = FakeCuda().install(monkeypatch, available=False)
    with fake_cuda_tensors() as pinning:
        verdict, opt, scaler, copies = fake_cuda_step(cuda, pinning)
        state = [verdict.vector, verdict.summary, verdict.stopped, verdict.skips, scaler.scale_tensor,
                 scaler.good_tensor, opt._step_tensor, opt.flat.param_buffer, opt.flat.grad_buffer]
        state += [t for s in opt.owned_slices for t in (s.master, s.exp_avg, s.exp_avg_sq)]
        assert all(t.device == CUDA for t in state)
        assert opt.owned_slices[0].master.dtype == torch.float32  # float16 parameters: float32 masters
    assert copies == []  # no transfer between host and GPU inside the step
    assert pinning.copies == [("to_host", True, True)]  # start_read: non-blocking, into pinned memory
    event = cuda.events[-1]
    assert cuda.log[-1] == ("record", event.id, "compute") and verdict.event is event and not event.synchronized


def test_the_fake_step_catches_a_tensor_left_on_the_host(monkeypatch):
    cuda = FakeCuda().install(monkeypatch, available=False)
    with fake_cuda_tensors() as pinning:  # a loss scaler on the host: a host-to-GPU copy in every step
        fake_cuda_step(cuda, pinning, scaler_device=None)
        assert ("to_device", False, False) in pinning.copies
    with fake_cuda_tensors() as pinning, pytest.raises(RuntimeError, match="expected one device"):
        fake_cuda_step(cuda, pinning, step_tensor_on_host=True)  # the fused kernel's step count on the host
    with fake_cuda_tensors(), pytest.raises(RuntimeError, match="found at least two devices"):
        torch.zeros(4, device=CUDA) + torch.zeros(4)


def test_the_late_read_waits_for_its_event_once(monkeypatch):
    cuda = FakeCuda().install(monkeypatch)
    world = SimpleNamespace(recurring_allreduce=lambda vector: lambda: None)
    verdict = StepVerdict(world, torch.device("cpu"), clip=0.0, nonfinite="skip", max_skipped_steps=3,
                          scaler_enabled=False)
    verdict.host.copy_(torch.tensor([2.5, 0.75, 0.0, 1.0] + [0.0] * (verdict.host.numel() - 4), dtype=torch.float64))
    verdict.event = event = torch.cuda.Event()
    reading = verdict.read()
    assert event.synchronized == 1 and verdict.event is None and (reading.loss, reading.grad_norm) == (2.5, 0.75)
    verdict.read()
    assert event.synchronized == 1 and cuda.log.count(("event_synchronize", event.id)) == 1


def test_the_cuda_profiler_records_kernels_into_the_run_directory(monkeypatch, tmp_path):
    made = []

    class Profile:
        def __init__(self, **kwargs):
            self.kwargs, self.started, self.exported = kwargs, False, []
            made.append(self)

        def start(self):
            self.started = True

        def export_chrome_trace(self, path):
            self.exported.append(path)

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    cfg = SimpleNamespace(trace=True, trace_steps=3, run_dir=str(tmp_path / "run"))
    assert cuda_trace.cuda_profiler(cfg, 3, torch.device("cpu")) is None
    assert cuda_trace.cuda_profiler(SimpleNamespace(trace=False), 3, CUDA) is None
    profiler = cuda_trace.cuda_profiler(cfg, 3, CUDA)
    assert profiler is made[0] and profiler.started
    activities = set(profiler.kwargs["activities"])
    assert activities == {torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA}
    assert os.path.isdir(tmp_path / "run" / "trace")  # kineto would only log a missing directory
    profiler.kwargs["on_trace_ready"](profiler)
    assert profiler.exported == [str(tmp_path / "run" / "trace" / "cuda-rank00003.json")]


def test_only_torchs_synchronizing_call_warnings_count_as_host_reads():
    notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
    sync = "called a synchronizing CUDA operation"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(notice, UserWarning)
        warnings.warn(sync, UserWarning)
        warnings.warn("some other warning about synchronization", UserWarning)
    assert sync_warnings(caught) == [sync]
    assert sync_warnings([notice, sync, sync]) == [sync, sync] and sync_warnings([notice]) == []
