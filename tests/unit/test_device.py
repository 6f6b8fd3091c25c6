"""train.device: auto picks the CPU without CUDA, cuda without CUDA is a clear error; peak presets."""
import pytest
import torch

from hpctrain.runtime.device import DeviceError, gpu_peak_tflops, peak_tflops, select_device
from hpctrain.runtime.launcher import RankInfo


def rank_info():
    return RankInfo(rank=0, size=1, local_rank=0, local_size=1, node=0, num_nodes=1, hostname="h",
                    node_of_rank=[0], local_rank_of_rank=[0], launcher=None, mpi_library="test")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_auto_is_cpu_and_cuda_is_an_error_without_cuda(monkeypatch):
    assert select_device("auto", rank_info()) == torch.device("cpu")
    assert select_device("cpu", rank_info()) == torch.device("cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(DeviceError, match=r"train.device='cuda' but torch sees no CUDA device.*"
                                          r"CUDA_VISIBLE_DEVICES=3"):
        select_device("cuda", rank_info())


def test_unknown_choice_is_named():
    with pytest.raises(DeviceError, match="train.device='tpu'"):
        select_device("tpu", rank_info())


@pytest.mark.parametrize("name,dtype,expected", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0), ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0), ("NVIDIA A100-SXM4-80GB", torch.float32, 156.0),
    ("NVIDIA H200", torch.float16, 989.0), ("Tesla V100-SXM2-32GB", torch.bfloat16, 0.0),
    ("AMD Instinct MI250X", torch.bfloat16, 383.0), ("Some Future GPU", torch.bfloat16, 0.0)])
def test_peak_presets_by_device_name(name, dtype, expected):
    assert gpu_peak_tflops(name, dtype) == expected


def test_peak_is_unknown_on_cpu_and_for_plain_fp32():
    assert peak_tflops(torch.device("cpu"), torch.bfloat16) == 0.0
    assert peak_tflops(torch.device("cuda", 0), torch.float32, allow_tf32=False) == 0.0
