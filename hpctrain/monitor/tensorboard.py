"""The TensorBoard sink (rank 0 only, ``monitor.tensorboard``): the same samples as Prometheus, as scalars in
event files under ``<run_dir>/tensorboard/`` (PyTorch's ``SummaryWriter`` on the ``tensorboard`` package,
whose writer thread does the file I/O). A sample ``(name, labels, value)`` is the tag ``name`` (with labels:
``name/label=value,...``) at the step; liveness and wall-clock timestamps (``SKIPPED``) are left out. The
curves (``EVERY_STEP``) are written at every step; the breakdowns (phases, ranks, bytes, checkpoints) at
each monitor interval, their latest values (a scalar costs the writer tens of microseconds: on an
oversubscribed node every one is taken from a rank's step)."""
from __future__ import annotations

from hpctrain.errors import HpcTrainError


SKIPPED = ("hpctrain_up", "hpctrain_last_step_timestamp_seconds", "hpctrain_last_checkpoint_timestamp_seconds")
EVERY_STEP = ("hpctrain_loss", "hpctrain_val_loss", "hpctrain_learning_rate", "hpctrain_grad_norm",
              "hpctrain_tokens_per_second", "hpctrain_mfu_ratio")  # the rest: their latest value at each flush


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, log_dir: str):
        try:
            import tensorboard  # noqa: F401 - torch.utils.tensorboard needs it; say so by its name
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise HpcTrainError("monitor.tensorboard: needs the tensorboard package (pip install tensorboard, or the "
                                "hpctrain[monitor] extra)") from None
        try:
            self.writer = SummaryWriter(log_dir=log_dir)
        except OSError as exc:
            raise HpcTrainError(f"monitor.tensorboard: cannot write {log_dir}: {exc.strerror or exc}") from None
        self.log_dir, self.last_step = log_dir, 0
        self.pending: dict[str, float] = {}  # tag -> the value to write at the next flush

    def start(self) -> None:
        pass

    def set(self, name: str, labels: dict, value: float, step: int) -> None:
        if name in SKIPPED:
            return
        self.last_step = max(self.last_step, step)
        tag = name + ("/" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) if labels else "")
        if name in EVERY_STEP:
            self.writer.add_scalar(tag, value, step)
        else:
            self.pending[tag] = value

    def clear(self, name: str) -> None:
        pass

    def flush(self, step: int) -> None:
        for tag, value in self.pending.items():
            self.writer.add_scalar(tag, value, step)
        self.pending.clear()
        self.writer.flush()

    def close(self) -> None:
        self.flush(self.last_step)
        self.writer.close()
