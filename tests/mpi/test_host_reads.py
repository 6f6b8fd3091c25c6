"""The sync-free step (issue #26): no host read of a device value inside ``train_step(defer=True)``.

On a GPU such a read (``.item()``, ``bool(t)``, a data-shaped op, a blocking copy to the host) makes the
host wait for the device in the middle of the step; HostReadAudit (hpctrain/profiling/host_reads.py)
finds the same calls on the CPU, so this machine proves the step has none, in the layouts and features
that change the step's code: pipeline + ZeRO-1 + float16's device loss scale, tensor + sequence parallel,
context parallel (ring attention), a compressed dp reduction in float16, LoRA.
"""
import os

import torch

from hpctrain.profiling.host_reads import HostReadAudit
from mpirun import run_mpi

HERE = os.path.dirname(os.path.abspath(__file__))


def test_the_audit_names_each_read_and_its_line_and_passes_device_side_work():
    x = torch.arange(6.0)
    with HostReadAudit(package=HERE) as audit:
        y = (x * 2).sum()  # device-side: no read
        torch.where(x > 2, x, 0.0).clamp_(max=4)
        total = y.item()  # a read
        if bool(x.max() > 3):  # a read
            pass
        index = torch.nonzero(x > 3)  # a data-shaped op
        x.repeat_interleave(2, output_size=12)  # its size given: no read
        x[0] = 1.5  # a Python number stored: a host-to-device copy on a GPU
        x[1].fill_(2.5)  # filled on the device: no copy
        x[2] = x[3]  # a device-to-device copy
        picked = x[x > 4]  # a boolean mask: the device counts the elements for the host
        x.index_select(0, torch.tensor([0, 5]))  # an index tensor: no read
    assert total == 30.0 and index.shape == (2, 1) and picked.numel() == 1
    ops = sorted(op for op, _ in audit.sites)
    assert ops == ["_local_scalar_dense", "_local_scalar_dense", "copy_ of a Python number", "index", "nonzero"], \
        audit.lines()
    assert all(site.startswith("mpi/test_host_reads.py:") for _, site in audit.sites), audit.lines()
    assert len(audit.lines()) == 5 and audit.lines()[0].startswith("1 x ")


def test_deferred_steps_read_nothing_from_the_device_in_any_layout():
    cases = ["dp=2 pp=2:parallel.zero=1 parallel.microbatches=2 train.dtype=float16",
             "pp=2 tp=2",  # float32: the loss share of a rank that does not count it is the number 0.0
             "dp=2 tp=2:parallel.sequence_parallel=true lora.rank=4",
             "dp=2 cp=2",
             "dp=4:compression.method=powersgd train.dtype=float16"]  # its overflow check stays on the device
    result = run_mpi(4, "check_host_reads.py", *cases, timeout=240)
    assert "HOST READS OK" in result.stdout, result.stdout
    assert result.stdout.count(": 0 host read site(s)") == len(cases), result.stdout
