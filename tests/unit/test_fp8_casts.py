"""train.fp8's float8 linear (hpctrain/parallel/fp8.py) without MPI: torchao's own Float8Linear bit for bit, the
scales of each recipe, which casts are max-reduced over the tp group (and that a column-parallel slab pair then
computes what one process computes, bit for bit), the bad inputs, and a short run against bfloat16. The layouts
on real ranks: tests/mpi/test_fp8.py."""
import copy
import importlib.metadata
import math
import subprocess
import sys
import threading

import pytest
import torch

from hpctrain.config import ConfigError, load_config, validate

torchao = pytest.importorskip("torchao", reason="the fp8 extra (pip install -e '.[fp8]')")

from hpctrain.models.fp8 import check_fp8  # noqa: E402
from hpctrain.parallel.fp8 import Fp8Linear, Fp8Stats, _Cast, _casts, fp8_linear, load_recipe  # noqa: E402


def weighted(y):
    return (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_float8_linear_is_torchaos_float8_linear_bit_for_bit(recipe, dtype):
    from torchao.float8.float8_linear import Float8Linear

    r = load_recipe(recipe, emulate=True)
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=False).to(dtype)
    theirs = Float8Linear.from_float(copy.deepcopy(linear), config=r.config)
    x = torch.randn(3, 5, 64, dtype=dtype) * 4
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = theirs(x1)
    weighted(y1).backward()
    y2 = fp8_linear(x2, linear.weight, Fp8Linear(r, None, None))
    weighted(y2).backward()
    assert y2.dtype == dtype and torch.equal(y1, y2)
    assert torch.equal(x1.grad, x2.grad) and torch.equal(theirs.weight.grad, linear.weight.grad)
    assert not torch.equal(y2, torch.nn.functional.linear(x, linear.weight))  # it did round to float8


def test_tensorwise_is_one_scale_rowwise_one_power_of_two_per_row():
    t = torch.tensor([[1.0, -3.0, 0.5], [0.25, 0.125, 0.0], [0.0, 0.0, 0.0]])
    for name in ("tensorwise", "rowwise"):
        r = load_recipe(name, emulate=True)
        stats = Fp8Stats()
        f = Fp8Linear(r, None, None, stats)
        (q, scale), = _casts(f, [_Cast(t, r.config.cast_config_input, r.tensor.GemmInputRole.INPUT, -1, None)])
        top = torch.finfo(torch.float8_e4m3fn).max  # 448
        if name == "tensorwise":
            assert scale.shape == () and float(scale) == pytest.approx(top / 3.0, rel=1e-7)
        else:
            row_amax = torch.tensor([3.0, 0.25])
            assert scale.shape == (3, 1)
            assert all(math.log2(float(s)) == int(math.log2(float(s))) for s in scale[:2, 0])  # powers of 2
            assert torch.all(scale[:2, 0] <= top / row_amax) and torch.all(scale[:2, 0] > top / row_amax / 2)
        back = q._data.float() / q._scale  # torchao's dequantisation
        assert torch.allclose(back, t, rtol=0.07, atol=0) and back[2].eq(0).all()
        values = stats.collect(_NoComm())
        assert values["fp8_amax_max"] == 3.0 and values["fp8_overflows"] == 0
        used = scale.reshape(-1)[:2] if scale.dim() else scale.reshape(1)  # the all-zero row left out
        assert values["fp8_scale_min"] == pytest.approx(float(used.min()))
        assert values["fp8_scale_max"] == pytest.approx(float(used.max()))
    inf = Fp8Stats()
    inf.record(torch.tensor(float("inf")), torch.tensor(0.0))
    assert inf.collect(_NoComm())["fp8_overflows"] == 1


def test_the_stats_count_the_gradients_casts_and_not_a_recomputed_forward():
    r = load_recipe("tensorwise", emulate=True)
    stats = Fp8Stats()
    f = Fp8Linear(r, None, None, stats)
    x, w = torch.randn(4, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    fp8_linear(x, w, f).backward(torch.full((4, 16), 1000.0))
    assert stats.collect(_NoComm())["fp8_amax_max"] == 1000.0  # the output gradient's cast
    y = torch.utils.checkpoint.checkpoint(fp8_linear, x, w, f, use_reentrant=False)
    assert stats.collect(_NoComm())["fp8_amax_max"] == pytest.approx(float(max(x.abs().max(), w.abs().max()).detach()))
    y.backward(torch.zeros(4, 16))  # recomputes the forward (not counted); x and W's scales reused
    after = stats.collect(_NoComm())
    assert after["fp8_amax_max"] == 0.0 and after["fp8_scale_min"] is None
    with torch.no_grad():  # an evaluation: not counted either
        fp8_linear(x, w, f)
    assert stats.collect(_NoComm())["fp8_amax_max"] == 0.0


class _NoComm:
    size = 1

    def allreduce(self, tensor, op="sum"):
        pass


class _Recording:
    """A tp group of 2 that records what is all-reduced (the values stay this rank's)."""

    size, rank = 2, 0

    def __init__(self):
        self.calls = []

    def allreduce(self, tensor, op="sum"):
        assert op == "max"
        self.calls.append(tensor.numel())


@pytest.mark.parametrize("recipe, split, forward, backward", [
    ("tensorwise", 0, [1], [1]),  # column: W^T; dy (W^T's scale reused for grad_input, dy's for grad_weight)
    ("tensorwise", 1, [2], []),   # row: x and W^T; dy is whole, both scales reused
    ("rowwise", 0, [], [6 + 64]),  # column: dy's rows [T] and W^T's along out [in]
    ("rowwise", 1, [6 + 48], []),  # row: x's rows [T] and W^T's along in [out]
])
def test_the_casts_of_a_split_tensor_are_reduced_over_the_group_once_per_pass(recipe, split, forward, backward):
    comm = _Recording()
    x = torch.randn(6, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    y = fp8_linear(x, w, Fp8Linear(load_recipe(recipe, emulate=True), comm, split))
    assert comm.calls == forward
    comm.calls.clear()
    y.sum().backward()
    assert comm.calls == backward


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_no_tokens_with_cp_peers_still_takes_part_in_their_reductions(recipe):
    """An expert with no rows on this cp rank: amax 0 into the cp all-reduces its peers make (none with no peers)."""
    cp = _Recording()
    x, w = torch.zeros(0, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    y = fp8_linear(x, w, Fp8Linear(load_recipe(recipe, emulate=True), None, None, Fp8Stats(), cp))
    assert y.shape == (0, 16) and len(cp.calls) == (1 if recipe == "tensorwise" else 0)
    y.sum().backward()
    assert w.grad is not None and not w.grad.any() and len(cp.calls) == (2 if recipe == "tensorwise" else 1)
    alone = fp8_linear(x, w, Fp8Linear(load_recipe(recipe, emulate=True), None, None, None, None))
    assert alone.shape == (0, 16)


class _Pair:
    """Two threads as the two ranks of a tp group: allreduce(max) through a barrier."""

    def __init__(self):
        self.barrier, self.slots = threading.Barrier(2), [None, None]

    def member(self, rank):
        pair = self

        class Member:
            size = 2

            def allreduce(self, tensor, op="sum"):
                pair.slots[rank] = tensor.clone()
                pair.barrier.wait()
                tensor.copy_(torch.maximum(pair.slots[0], pair.slots[1]))
                pair.barrier.wait()

        return Member()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_column_parallel_pair_computes_what_one_process_computes_bit_for_bit(recipe):
    """W [out, in] split on out over 2 ranks: each rank's outputs, its slab's weight gradient and the sum of the
    input gradients equal the unsplit float8 linear's (float64 sums of two float32 partial products aside: the
    input gradient within float32 rounding); with the amaxes left unreduced the outputs differ."""
    r = load_recipe(recipe, emulate=True)
    torch.manual_seed(1)
    x, w = torch.randn(8, 32) * 3, torch.randn(64, 32)
    w[40:, 5] = 9.0  # rank 1's slab holds the largest weights: rank 0 alone would scale differently
    gy = torch.randn(8, 64)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    whole = fp8_linear(xr, wr, Fp8Linear(r, None, None))
    whole.backward(gy)

    def run(comm_of, results):
        def rank(i):
            xi, wi = x.clone().requires_grad_(), w[32 * i:32 * (i + 1)].clone().requires_grad_()
            yi = fp8_linear(xi, wi, Fp8Linear(r, comm_of(i), 0))
            yi.backward(gy[:, 32 * i:32 * (i + 1)])
            results[i] = (yi.detach(), xi.grad, wi.grad)
        threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    pair, got = _Pair(), [None, None]
    run(pair.member, got)
    assert torch.equal(torch.cat([got[0][0], got[1][0]], 1), whole)
    assert torch.equal(torch.cat([got[0][2], got[1][2]], 0), wr.grad)
    assert (got[0][1] + got[1][1] - xr.grad).abs().max() <= 1e-6 * xr.grad.abs().max() * 64  # float32 sums
    alone = [None, None]
    run(lambda i: None, alone)  # the wrong group: none
    if recipe == "tensorwise":
        assert not torch.equal(torch.cat([alone[0][0], alone[1][0]], 1), whole)


BASE = ["model.preset=tiny", "model.n_layers=2", "train.seq_len=32", "train.global_batch=4"]


def test_bad_input_is_one_line_naming_the_key_or_the_package(monkeypatch):
    for dtype, emulate, ok in [("bfloat16", False, True), ("float32", True, True), ("float64", True, True),
                               ("float16", True, False), ("float32", False, False)]:
        overrides = BASE + ["train.fp8=tensorwise", f"train.dtype={dtype}", f"train.fp8_emulate={emulate}"]
        if ok:
            validate(load_config(None, overrides))
        else:
            with pytest.raises(ConfigError, match=r"^config: train\.fp8: 'tensorwise' needs train\.dtype=bfloat16"):
                load_config(None, overrides)
    t = load_config(None, BASE + ["train.fp8=rowwise", "train.dtype=bfloat16"]).train
    with pytest.raises(ConfigError, match=r"^config: train\.fp8_emulate: train\.fp8='rowwise' on a CPU needs "
                                          r"train\.fp8_emulate=true"):
        check_fp8(t, torch.device("cpu"))
    t.fp8_emulate = True
    check_fp8(t, torch.device("cpu"))
    real = importlib.metadata.version

    def missing(name):
        if name == "torchao":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ConfigError) as exc:
        check_fp8(t, torch.device("cpu"))
    assert str(exc.value) == ("config: train.fp8: 'rowwise' needs torchao==0.18.0, which is not installed: "
                              "pip install 'hpctrain[fp8]'")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.9.0" if name == "torchao" else real(name))
    with pytest.raises(ConfigError, match=r"found torchao 0\.9\.0: pip install 'hpctrain\[fp8\]'"):
        check_fp8(t, torch.device("cpu"))


def test_what_the_device_allows_is_one_line_each(monkeypatch):
    """A GPU below sm89 runs every linear in the training dtype; on sm89+ a linear whose slab is not a multiple of
    16 does (named); the emulation there is a warning. Only shapes are read: the model is built on meta."""
    from hpctrain.config import resolve_model
    from hpctrain.models import fp8 as models_fp8
    from hpctrain.models.gpt import GPTStage

    cfg = load_config(None, BASE + ["model.d_ff=200", "train.fp8=tensorwise", "train.dtype=bfloat16"])
    m = resolve_model(cfg.model)
    with torch.device("meta"):
        stage = GPTStage(m, (0, 2), is_first=True, is_last=True, dtype=torch.bfloat16)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(models_fp8, "Fp8Stats", lambda device: Fp8Stats())  # no CUDA here: its counts on the host
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    old = models_fp8.setup_fp8(cfg.train, [stage], None, cuda, "bfloat16", m)
    assert old.recipe is None and old.warnings == [
        "train.fp8=tensorwise: this GPU (sm80) has no float8 matmul (sm89+: Ada, Hopper); every linear runs in "
        "bfloat16 instead (train.fp8_emulate=true runs the emulation)"]
    assert stage.layers["0"].mlp.up.fp8 is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    hopper = models_fp8.setup_fp8(cfg.train, [stage], None, cuda, "bfloat16", m)
    assert hopper.warnings == [f"train.fp8: linear layers.{i}.mlp.{part} [{shape}] is not a multiple of 16 "
                               f"(torch._scaled_mm): it runs in bfloat16" for i in (0, 1)
                               for part, shape in (("gate", "200, 64"), ("up", "200, 64"), ("down", "64, 200"))]
    assert "d_ff" not in hopper.lines[0] and "on 14 linears of 2 blocks" in hopper.lines[0]
    assert stage.layers["0"].attn.wq.fp8 is not None and stage.layers["0"].mlp.up.fp8 is None
    cfg.train.fp8_emulate = True
    emulated = models_fp8.setup_fp8(cfg.train, [stage], None, cuda, "bfloat16", m)
    assert emulated.warnings[0].startswith("train.fp8_emulate=true on a GPU with float8 matmuls (sm89+)")
    assert stage.layers["0"].mlp.up.fp8 is not None  # the emulation takes any shape


def test_hpctrain_imports_without_torchao():
    code = ("import sys; sys.modules['torchao'] = None\n"  # an import of torchao would fail
            "import hpctrain.train.trainer, hpctrain.models.fp8, hpctrain.parallel.fp8\n"
            "print('imported')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-2000:]


def test_float8_trains_like_bfloat16_on_one_process():
    """The tiny preset (2 blocks), 10 steps, bfloat16 against float8 tensorwise and rowwise (emulated): the mean of
    the last 4 losses within 3% (the 100-step, 2-rank measurement: docs/gpus.md, FP8)."""
    from mpi4py import MPI

    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.data.corpus import load_tokens_collective
    from hpctrain.runtime.launcher import discover
    from hpctrain.train.trainer import Trainer

    def losses(*extra):
        cfg = load_config(None, BASE + ["data.max_bytes=100000", "train.dtype=bfloat16", "train.steps=10",
                                        "train.lr=3e-3", "train.warmup_steps=2", *extra])
        tokens = load_tokens_collective(MPI.COMM_SELF, cfg.data.source, cfg.data.cache_dir, cfg.data.max_bytes)
        grid = ProcessGrid.from_config(cfg, discover(MPI.COMM_SELF), mpi_world=MPI.COMM_SELF, timeout_s=60)
        try:
            trainer = Trainer(cfg, grid, tokens=tokens)
            return [trainer.train_step().loss for _ in range(cfg.train.steps)]
        finally:
            grid.close()

    bf16 = losses()
    for recipe in ("tensorwise", "rowwise"):
        fp8 = losses(f"train.fp8={recipe}", "train.fp8_emulate=true")
        assert all(math.isfinite(v) for v in fp8) and fp8 != bf16
        mean, ref = sum(fp8[-4:]) / 4, sum(bf16[-4:]) / 4
        assert abs(mean - ref) / ref < 0.03, (recipe, mean, ref)
        assert ref < bf16[0] - 0.5  # it trained
