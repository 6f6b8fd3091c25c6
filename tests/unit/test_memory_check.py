"""A model that cannot fit is refused before allocation (hpctrain/train/memory_check.py): the parameter count
per rank (config/arithmetic.rank_parameters) is the model's, the lower bound and the verdict over a node's
ranks, the one-line message naming the keys, and what memory is read (runtime/peak_memory.py)."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from mpi4py import MPI

from hpctrain.config import ConfigError, load_config, resolve_model
from hpctrain.config.arithmetic import count_parameters, rank_parameters
from hpctrain.config.layout import Layout
from hpctrain.config.rules import padded_vocab
from hpctrain.runtime.peak_memory import available_memory
from hpctrain.train import memory_check
from hpctrain.train.memory_check import check_memory, first_shortfall, rank_need

GIB = 1 << 30


@pytest.mark.parametrize("overrides", [[], ["model.tie_embeddings=true"], ["model.positions=learned"],
                                       ["model.vocab_multiple=1000"]])
@pytest.mark.parametrize("tp, pp, virtual", [(1, 1, 1), (2, 2, 1), (1, 2, 2), (4, 1, 1)])
def test_the_ranks_of_a_tp_group_and_pipeline_hold_the_padded_model(overrides, tp, pp, virtual):
    m = resolve_model(load_config(None, ["model.n_layers=4", *overrides]).model)
    padded = dataclasses.replace(m, vocab_size=padded_vocab(m, tp))
    held = sum(sum(rank_parameters(m, tp, pp, r, (), virtual).values()) for r in range(pp)) * tp
    positions = m.max_seq_len * m.d_model if m.positions == "learned" else 0
    replicated = (tp - 1) * ((2 * m.n_layers + 1) * m.d_model + positions)  # every tp rank's own: counted once
    tied_copy = m.vocab_size and padded.vocab_size * m.d_model if m.tie_embeddings and pp * virtual > 1 else 0
    assert held - replicated == count_parameters(padded) + tied_copy


def test_one_rank_holds_what_the_trainer_builds():
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.data.corpus import load_tokens_collective
    from hpctrain.runtime.launcher import discover
    from hpctrain.train.trainer import Trainer

    cfg = load_config(None, ["model.n_layers=2", "model.vocab_size=300", "model.positions=learned",
                             "data.max_bytes=60000", "train.seq_len=16", "train.global_batch=2"])
    grid = ProcessGrid.from_config(cfg, discover(MPI.COMM_SELF), mpi_world=MPI.COMM_SELF, timeout_s=60)
    try:
        trainer = Trainer(cfg, grid, tokens=load_tokens_collective(None, "builtin", None, 60000))
        built = sum(p.numel() for p in trainer.parts.local_model.parameters())
    finally:
        grid.close()
    assert sum(rank_parameters(resolve_model(cfg.model), 1, 1, 0).values()) == built


def layout_of(cfg, world=2):
    return Layout.from_config(cfg, world)


def test_the_lower_bound_counts_dtype_gradients_adamw_zero_and_lora():
    cfg = load_config(None, ["parallel.pp=1", "train.dtype=bfloat16"])
    need = rank_need(cfg, layout_of(cfg), 0)
    n = need.parameters
    assert need.parts["parameters"] == 2 * n and need.parts["gradients"] == 4 * n
    assert need.parts["optimizer"] == 12 * n  # two float32 moments + float32 master weights
    zero = load_config(None, ["parallel.pp=1", "train.dtype=bfloat16", "parallel.zero=1"])
    assert rank_need(zero, layout_of(zero), 0).parts["optimizer"] == 12 * n // 2  # sharded over dp=2
    lora = load_config(None, ["parallel.pp=1", "lora.rank=2"])
    parts = rank_need(lora, layout_of(lora), 0).parts
    assert parts["gradients"] == parts["optimizer"] == 0 and parts["parameters"] == 4 * n
    assert need.parts["activations"] > 0


def test_first_shortfall_sums_a_nodes_ranks_on_the_host_and_not_on_devices():
    room = (10 * GIB, "available")
    rows = [(0, "a", 0, 6 * GIB, room), (0, "a", 1, 5 * GIB, room), (1, "b", 0, 4 * GIB, room)]
    assert first_shortfall(rows, per_rank=False) == (0, 2, 11 * GIB, room)  # node 0: 11 GiB > 10
    assert first_shortfall(rows, per_rank=True) is None  # every GPU its own 10 GiB
    assert first_shortfall([(0, "a", 0, 11 * GIB, room)], per_rank=True) == (0, 1, 11 * GIB, room)
    assert first_shortfall([(0, "a", 0, 11 * GIB, None)], per_rank=False) is None  # unknown memory: no verdict


def fake_grid(cfg, world=2, pp_rank=0):
    layout = layout_of(cfg, world)
    return SimpleNamespace(layout=layout, coords={"pp": pp_rank},
                           info=SimpleNamespace(rank=0, node=0, hostname="h0", size=world),
                           world=SimpleNamespace(allgather_object=lambda row: [row] * world))


def test_a_model_too_big_is_refused_in_one_line_naming_the_keys(monkeypatch):
    monkeypatch.setattr(memory_check, "available_memory", lambda device: (1 * GIB, "available on host h0"))
    cfg = load_config(None, ["parallel.pp=1", "model.vocab_multiple=65536", "model.d_model=1024"])
    with pytest.raises(ConfigError) as info:
        check_memory(cfg, fake_grid(cfg), torch.device("cpu"))
    message = str(info.value)
    assert "\n" not in message and info.value.everywhere, message
    assert message.startswith("config: the model does not fit in memory: rank 0 needs at least "), message
    assert "model.vocab_size=256 padded to 65536 rows (a multiple of model.vocab_multiple=65536 x parallel.tp=1)" \
        in message and "model.d_model=1024" in message, message
    assert "the 2 ranks of host h0 need" in message and "but 1.0 GiB are available on host h0" in message, message
    fits = load_config(None, ["parallel.pp=1"])
    check_memory(fits, fake_grid(fits), torch.device("cpu"))  # the tiny model: no error


def test_the_blocks_or_the_micro_batch_are_named_when_they_dominate(monkeypatch):
    monkeypatch.setattr(memory_check, "available_memory", lambda device: (1 * GIB, "free on cuda:0"))
    deep = load_config(None, ["parallel.pp=1", "model.d_model=4096", "model.d_ff=16384", "model.n_layers=32"])
    with pytest.raises(ConfigError, match=r"the blocks: 32 of model.n_layers=32 x \(model.d_model=4096, "
                                          r"model.d_ff=16384\).* free on cuda:0"):
        check_memory(deep, fake_grid(deep), torch.device("cuda"))
    long = load_config(None, ["parallel.pp=1", "model.max_seq_len=16777216", "train.seq_len=16777216",
                              "train.global_batch=64"])
    with pytest.raises(ConfigError, match=r"one micro-batch's activations: 32 sequences .* train.seq_len=16777216"):
        check_memory(long, fake_grid(long), torch.device("cpu"))


def test_available_memory_reads_meminfo_and_a_smaller_cgroup_limit(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:    8388608 kB\n")
    free, where = available_memory(torch.device("cpu"), root=str(tmp_path))
    assert free == 8 * GIB and "MemAvailable" in where
    cgroup = tmp_path / "sys" / "fs" / "cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text(f"{GIB}\n")
    assert available_memory(torch.device("cpu"), root=str(tmp_path))[0] == 8 * GIB  # unlimited
    (cgroup / "memory.max").write_text(f"{3 * GIB}\n")
    free, where = available_memory(torch.device("cpu"), root=str(tmp_path))
    assert free == 2 * GIB and "cgroup" in where
    assert available_memory(torch.device("cpu"), root=str(tmp_path / "nowhere")) is None


def test_zero_two_and_three_shard_gradients_and_parameters_and_count_the_gathered_units(monkeypatch):
    """ZeRO-2 divides the gradients by the replicas, ZeRO-3 the parameters too and adds its gathered units:
    the running one and ``zero_prefetch`` more, or every unit without resharding; when they are the
    largest share a refusal names ``parallel.zero_prefetch`` and ``parallel.zero_reshard_after_forward``."""
    base = ["parallel.pp=1", "model.n_layers=8"]
    parts = {z: rank_need(c, layout_of(c, 4), 0).parts
             for z, c in ((z, load_config(None, base + [f"parallel.zero={z}"])) for z in (0, 2, 3))}
    n = rank_need(load_config(None, base), layout_of(load_config(None, base), 4), 0).parameters
    assert parts[2]["gradients"] == parts[0]["gradients"] // 4 and parts[2]["parameters"] == parts[0]["parameters"]
    assert parts[3]["parameters"] == 4 * n // 4 and 0 < parts[3]["gathered units"] < 4 * n
    more = load_config(None, base + ["parallel.zero=3", "parallel.zero_prefetch=3"])
    assert rank_need(more, layout_of(more, 4), 0).parts["gathered units"] > parts[3]["gathered units"]
    whole = load_config(None, base + ["parallel.zero=3", "parallel.zero_reshard_after_forward=false"])
    assert rank_need(whole, layout_of(whole, 4), 0).parts["gathered units"] == 4 * n
    monkeypatch.setattr(memory_check, "available_memory", lambda device: (1 * GIB, "available on host h0"))
    big = load_config(None, ["parallel.pp=1", "model.n_layers=2", "model.d_model=4096", "model.d_ff=16384",
                             "model.n_heads=32", "model.n_kv_heads=32", "parallel.zero=3",
                             "parallel.zero_reshard_after_forward=false"])
    with pytest.raises(ConfigError) as info:
        check_memory(big, fake_grid(big, world=8), torch.device("cpu"))
    assert "parallel.zero_prefetch" in str(info.value) and "\n" not in str(info.value), str(info.value)
