"""Every layout rule's message, without MPI (hpctrain/config/rules.py, layout.py), and the derived sizes."""
import pytest
import torch

from hpctrain.config import ConfigError, load_config
from hpctrain.errors import GridError, HpcTrainError
from hpctrain.config.layout import Layout, divisors, resolve_sizes


def layout(world, *overrides):
    return Layout.from_config(load_config("configs/tiny.toml", list(overrides)), world)


@pytest.mark.parametrize("world, overrides, error, fragment", [
    (6, ["parallel.tp=2", "parallel.pp=2"], GridError, "world size 6 is not divisible by tp*pp = 2*2 = 4"),
    (8, ["parallel.dp=3", "parallel.tp=2", "parallel.pp=2"], GridError, "dp*pp*tp = 3*2*2 = 12 but the job has 8"),
    (4, ["parallel.tp=4", "parallel.pp=1", "model.n_kv_heads=2"], HpcTrainError,
     "model.n_kv_heads=2 is not divisible by parallel.tp=4"),
    (8, ["parallel.tp=8", "parallel.pp=1"], HpcTrainError, "model.n_heads=4 is not divisible by parallel.tp=8"),
    (2, ["parallel.tp=2", "parallel.pp=1", "model.d_ff=255"], HpcTrainError, "model.d_ff=255 is not divisible"),
    (4, ["parallel.tp=1", "parallel.pp=1", "train.global_batch=6"], HpcTrainError,
     "train.global_batch=6 is not divisible by dp=4"),
    (2, ["parallel.tp=1", "parallel.pp=1", "train.global_batch=8", "parallel.microbatches=3"], HpcTrainError,
     "the per-replica batch 4 (train.global_batch/dp) is not divisible by parallel.microbatches=3"),
    (4, ["parallel.sequence_parallel=true", "train.seq_len=33"], HpcTrainError,
     "sequence parallelism needs train.seq_len=33 divisible by tp=2"),
])
def test_each_rule_names_the_problem(world, overrides, error, fragment):
    with pytest.raises(error) as info:
        layout(world, *overrides)
    assert fragment in str(info.value)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(tp=0), "parallel.tp must be a positive integer"), (dict(pp=-1), "parallel.pp must be a positive"),
    (dict(dp=-2), "parallel.dp must be a positive integer (or 0"), (dict(tp="2"), "parallel.tp must be")])
def test_bad_sizes(kwargs, fragment):
    with pytest.raises(GridError, match=fragment.replace("(", r"\(")):
        resolve_sizes(8, **kwargs)


@pytest.mark.parametrize("overrides, fragment", [
    (["parallel.pp=8"], "model.n_layers=4 < parallel.pp=8: every stage needs a layer"),
    (["parallel.pp=2", "parallel.stage_layers=3,2"], "parallel.stage_layers=[3, 2] must have pp=2 entries >= 1 "
                                                     "summing to model.n_layers=4"),
    (["parallel.pp=2", "parallel.stage_layers=4,0"], "must have pp=2 entries >= 1"),
    (["parallel.pp=1", "parallel.stage_layers=2,2"], "must have pp=1 entries"),
])
def test_stage_rules_fail_at_config_time_without_a_world(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.toml", overrides)
    assert fragment in str(info.value)


@pytest.mark.parametrize("overrides, fragment", [
    (["parallel.virtual_stages=2"], "parallel.virtual_stages=2 needs parallel.schedule=interleaved"),
    (["parallel.schedule=gpipe", "parallel.virtual_stages=3"], "parallel.virtual_stages=3 needs parallel.schedule"),
    (["parallel.schedule=interleaved"], "parallel.schedule=interleaved needs parallel.virtual_stages >= 2"),
    (["parallel.schedule=interleaved", "parallel.virtual_stages=0"], "parallel.virtual_stages: must be >= 1"),
    (["parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.pp=1"],
     "parallel.schedule=interleaved needs parallel.pp >= 2"),
    (["parallel.schedule=interleaved", "parallel.virtual_stages=3"],
     "parallel.virtual_stages=3 is too many for the layers: model.n_layers=4 < pp x virtual_stages = 6"),
    (["parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.microbatches=3"],
     "parallel.microbatches=3 must be a multiple of parallel.pp=2 with the interleaved schedule"),
    (["parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.stage_layers=2,2"],
     "parallel.stage_layers=[2, 2] must have pp x virtual_stages = 2x2 = 4 entries"),
])
def test_interleaved_rules_fail_at_config_time(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.toml", overrides)
    assert fragment in str(info.value) and str(info.value).count("\n") == 0


def test_interleaved_layout_and_its_layers():
    """Each virtual stage (the c-th of rank r is v = c pp + r) gets its layers; the embedding on v = 0 and
    the head on the last; stage_layers lists virtual stages."""
    from hpctrain.config import resolve_model
    from hpctrain.train.build import build_stages

    overrides = ["parallel.schedule=interleaved", "parallel.virtual_stages=2", "model.n_layers=6",
                 "parallel.stage_layers=1,2,2,1", "parallel.tp=1"]
    lay = layout(2, *overrides)
    assert (lay.virtual_stages, lay.pp_size) == (2, 2)
    cfg = load_config("configs/tiny.toml", overrides)
    m = resolve_model(cfg.model)
    rank0, rank1 = (build_stages(m, lay, r, None, torch.float64, 0, False) for r in (0, 1))
    assert [c.layer_range for c in rank0] == [(0, 1), (3, 5)] and [c.layer_range for c in rank1] == [(1, 3), (5, 6)]
    assert [(c.is_first, c.is_last) for c in rank0 + rank1] == [(True, False), (False, False), (False, False),
                                                                 (False, True)]
    balanced = layout(2, *overrides[:3], "parallel.tp=1")
    ranges = [c.layer_range for r in (0, 1) for c in build_stages(m, balanced, r, None, torch.float64, 0, False)]
    assert ranges == [(0, 1), (3, 5), (1, 3), (5, 6)]  # the embedding and head weigh 1/4 block each here


def test_derived_sizes():
    lay = layout(8, "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2", "train.global_batch=8",
                 "parallel.sequence_parallel=true", "train.seq_len=64")
    assert lay.sizes == {"dp": 2, "pp": 2, "cp": 1, "tp": 2}
    assert (lay.local_batch, lay.micro_batch, lay.seq_chunk) == (4, 2, 32)
    one = ["parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1"]
    assert layout(4, *one, "train.seq_len=64").seq_chunk == 64
    assert layout(4, "parallel.dp=4", *one).dp_size == 4


def test_divisors():
    assert divisors(1) == [1] and divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(7) == [1, 7]


def test_layout_imports_neither_mpi_nor_torch():
    import subprocess
    import sys

    code = ("import sys, hpctrain.config.layout; "
            "print(any(m in sys.modules for m in ('torch', 'mpi4py.MPI')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
