"""The state contract (hpctrain/checkpoint/contract.py): checkpoint/ and interop/ see a run only through
``TrainState``; the Trainer's adapter (hpctrain/train/state.py) maps its internals to it; FlatParams is
complete at construction. No MPI: fake dp groups and a stand-in trainer."""
import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from hpctrain.checkpoint import contract
from hpctrain.checkpoint.contract import OptimizerPiece, TrainState
from hpctrain.optim.flat import FlatOptimizer
from hpctrain.parallel.data_parallel import FlatParams
from hpctrain.optim.group import OptimizerGroup
from hpctrain.parallel.zero.engine import ParamEngine
from hpctrain.parallel.zero.frozen_slices import FrozenGroup, FrozenSlices
from hpctrain.parallel.zero.groups import FlatGroup
from hpctrain.parallel.slab import SlabSpec
from hpctrain.train.state import TrainerState

PACKAGE = Path(contract.__file__).resolve().parents[1]
CHECKED = sorted((PACKAGE / "checkpoint").glob("*.py")) + sorted((PACKAGE / "interop").glob("*.py"))
# the trainer-side classes whose attributes checkpoint/ and interop/ must not name: (file, classes)
INTERNALS = [("train/trainer.py", {"Trainer"}), ("train/state.py", {"TrainerState"}),
             ("parallel/data_parallel.py", {"FlatParams"}), ("parallel/buckets.py", {"Bucket", "ParamPiece"}),
             ("optim/flat.py", {"FlatOptimizer", "OptimizerSlice"})]
# names too common to flag anywhere (slices, arrays, configs have them too); on a run itself they still
# count as outside the contract
GENERIC = {"start", "end", "size", "index", "dtype", "device", "step", "cfg", "params", "data", "state", "pending"}
FORBIDDEN_IMPORTS = ("hpctrain.train", "hpctrain.optim", "hpctrain.parallel.data_parallel", "hpctrain.parallel.buckets")


def members(proto) -> set[str]:
    """The attributes and methods a Protocol declares."""
    return set(proto.__annotations__) | {n for n, v in vars(proto).items() if callable(v) and n[0] != "_"}


def contract_names() -> set[str]:
    """Every name the contract defines: TrainState's and ReducerState's members, the dataclasses' fields
    and methods."""
    names = members(contract.TrainState) | members(contract.ReducerState)
    for cls in (contract.ModelSlab, contract.OwnedRange, contract.OptimizerPiece, contract.TrainTensors,
                contract.RootState):
        names |= {f.name for f in dataclasses.fields(cls)} | {n for n, v in vars(cls).items()
                                                             if callable(v) and n[0] != "_"}
    return names


def internal_names() -> set[str]:
    """Attributes and methods of the trainer-side classes (``self.x = ...``, fields, defs), minus the
    contract's and GENERIC names."""
    names = set()
    for rel, classes in INTERNALS:
        for cls in ast.walk(ast.parse((PACKAGE / rel).read_text())):
            if not (isinstance(cls, ast.ClassDef) and cls.name in classes):
                continue
            for node in ast.walk(cls):
                if isinstance(node, ast.FunctionDef) and node in cls.body:
                    names.add(node.name)
                elif isinstance(node, ast.AnnAssign) and node in cls.body and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
    return names - contract_names() - GENERIC - {"__init__"}


def contract_violations(source: str, filename: str) -> list[str]:
    """``file:line: what`` for each place ``source`` reaches past the contract: an attribute of a run (a
    name ``trainer``, or a parameter annotated ``TrainState``; also through get/set/hasattr) that TrainState
    does not have; anywhere but on ``self``, an attribute only the trainer's internals have
    (``.param_buffer``, ``.flat_lo``, ``.owned_pieces``, ...); an import of the training side
    (hpctrain.train, hpctrain.optim, parallel.data_parallel)."""
    tree, allowed, internals = ast.parse(source), members(contract.TrainState), internal_names()
    runs = {"trainer"} | {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg) and a.annotation is not None
                          and "TrainState" in ast.unparse(a.annotation)}
    outside, found = ": not in the state contract (TrainState)", []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if (owner in runs and node.attr not in allowed) or (owner != "self" and node.attr in internals):
                found.append((node.lineno, ast.unparse(node) + outside))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.endswith("attr") \
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in runs \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value not in allowed:
            found.append((node.lineno, ast.unparse(node) + outside))  # getattr / setattr / hasattr
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                if module.startswith(FORBIDDEN_IMPORTS):
                    found.append((node.lineno, f"imports {module}: the training side imports checkpoint, "
                                               f"never the reverse"))
    return [f"{filename}:{line}: {what}" for line, what in sorted(found)]


def test_checkpoint_and_interop_use_only_the_contract():
    assert len(CHECKED) >= 10 and {"param_buffer", "flat_lo", "owned_pieces", "step_count", "flat"} <= internal_names()
    problems = [v for path in CHECKED for v in contract_violations(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert problems == []


def test_a_violation_is_reported_with_file_and_line():
    snippet = ("from hpctrain.optim.flat import FlatOptimizer\n"
               "def save(state: 'TrainState', reader):\n"
               "    state.set_steps(1, 1)\n"
               "    n = state.tensors().pieces[0].lo + reader.shape(1).size\n"
               "    buf = state.flat.param_buffer\n"
               "    for piece, part in other.owned_pieces():\n"
               "        piece.flat_lo\n"
               "    trainer.step = 3\n"
               "    setattr(state, 'step', 4)\n")
    assert contract_violations(snippet, "checkpoint/bad.py") == [
        "checkpoint/bad.py:1: imports hpctrain.optim.flat: the training side imports checkpoint, never the reverse",
        "checkpoint/bad.py:5: state.flat.param_buffer: not in the state contract (TrainState)",
        "checkpoint/bad.py:5: state.flat: not in the state contract (TrainState)",
        "checkpoint/bad.py:6: other.owned_pieces: not in the state contract (TrainState)",
        "checkpoint/bad.py:7: piece.flat_lo: not in the state contract (TrainState)",
        "checkpoint/bad.py:8: trainer.step: not in the state contract (TrainState)",
        "checkpoint/bad.py:9: setattr(state, 'step', 4): not in the state contract (TrainState)",
    ]


# ------------------------------------------------------------------ the Trainer's side
def params(*specs, dtype=torch.float32):
    out = []
    for spec in specs:
        p = nn.Parameter(torch.arange(float(torch.Size(spec.local_shape).numel()), dtype=dtype).view(spec.local_shape))
        p.spec = spec
        out.append(p)
    return out


def stand_in_trainer(ps, *, dp_rank, zero, tp_rank=0, frozen=(), frozen_units=None):
    """What TrainerState reads of a Trainer (its step and ``parts``), built from real FlatParams and FlatOptimizer over a fake dp group;
    ``frozen``: parameters of the model outside them (requires_grad=False: a LoRA run's base); ``frozen_units``:
    ZeRO-3's units of them (sliced in FrozenSlices), or None (kept whole)."""
    flat = FlatParams(ps, SimpleNamespace(size=2, rank=dp_rank), zero=zero)
    for p in frozen:
        p.requires_grad_(False)
    slices = FrozenGroup([] if frozen_units is None else [
        FrozenSlices(frozen_units, SimpleNamespace(size=2, rank=dp_rank), first_index=len(flat.buckets))])
    engine = ParamEngine(FlatGroup([flat]), slices, None, [] if frozen_units is not None else list(frozen))
    local_model = SimpleNamespace(parameters=lambda: iter(list(frozen) + list(ps)))
    grid = SimpleNamespace(info=SimpleNamespace(rank=3, size=4), sizes={"dp": 2, "tp": 2, "pp": 1},
                           coords={"dp": dp_rank, "tp": tp_rank, "pp": 0, "cp": 0})
    cfg = SimpleNamespace(parallel=SimpleNamespace(zero=int(zero), ep=1))
    state_dict = lambda: {"position": 7}  # noqa: E731
    parts = SimpleNamespace(model_cfg="model", timer="timer", params=engine, reducer=flat.reducer,
                            local_model=local_model,
                            optimizer=OptimizerGroup([FlatOptimizer(flat, SimpleNamespace(), tp_rank=tp_rank)]),
                            data=SimpleNamespace(batches=SimpleNamespace(state_dict=state_dict)),
                            scaler=SimpleNamespace(state_dict=lambda: {}, enabled=False))
    return SimpleNamespace(grid=grid, cfg=cfg, step=5, parts=parts)


def test_trainer_state_maps_owned_pieces_and_who_writes():
    w, v = params(SlabSpec("w", (2, 3)), SlabSpec("v", (4,), 0, 1, 2))  # w replicated over tp, v split
    trainer = stand_in_trainer([w, v], dp_rank=1, zero=True, tp_rank=1)  # one bucket [0, 8): v 0..2, w 2..8
    state = TrainerState(trainer)
    assert isinstance(state, TrainState)
    assert state.layout == {"dp": 2, "tp": 2, "pp": 1, "ep": 1, "zero": 1, "world": 4} and state.rank == 3
    tensors = state.tensors()
    assert [p.spec.name for p in tensors.params] == ["w", "v"] and tensors.params[0].data.data_ptr() == w.data_ptr()
    (owned,) = tensors.ranges  # ZeRO: dp rank 1 owns [4, 8), all of it inside w (elements 2..6)
    assert tensors.pieces == [OptimizerPiece(w.spec, 2, 6, 0, 0, False)]  # tp rank 1: w is tp rank 0's to write
    assert torch.equal(tensors.pieces[0].take(owned.params, 3, 5), w.detach().reshape(-1)[3:5])
    assert tensors.state_kinds == ("exp_avg", "exp_avg_sq") and owned.state["exp_avg"].numel() == 4
    w, v = params(SlabSpec("w", (2, 3)), SlabSpec("v", (4,), 0, 0, 2))
    tp0 = TrainerState(stand_in_trainer([w, v], dp_rank=1, zero=True, tp_rank=0)).tensors()
    assert [p.written for p in tp0.pieces] == [True]  # ZeRO: the owner writes, on tp rank 0
    rank0 = TrainerState(stand_in_trainer(params(SlabSpec("w", (2, 3))), dp_rank=0, zero=False)).tensors()
    assert [p.written for p in rank0.pieces] == [True]  # no ZeRO: dp rank 0 writes everything it counts
    unowned = TrainerState(stand_in_trainer(params(SlabSpec("w", (2, 3))), dp_rank=1, zero=False)).tensors()
    assert [p.written for p in unowned.pieces] == [False]


def test_frozen_parameters_are_model_pieces_without_optimizer_state_written_once():
    """A LoRA run: the frozen base is in ``params`` (loaded on resume), in no optimizer piece, and written
    whole by dp rank 0 (cp rank 0), on tp rank 0 when replicated over tp, never as the tied copy."""
    def tensors(dp_rank, tp_rank):
        adapter, = params(SlabSpec("a.lora_A.weight", (2, 3)))
        base = params(SlabSpec("w", (4, 3), 0, tp_rank, 2), SlabSpec("norm", (3,), None, tp_rank, 2),
                      SlabSpec("head", (4, 3), 0, tp_rank, 2, tied="copy"))
        trainer = stand_in_trainer([adapter], dp_rank=dp_rank, zero=False, tp_rank=tp_rank, frozen=base)
        return TrainerState(trainer).tensors()

    t = tensors(0, 1)
    assert [(p.spec.name, p.frozen, p.written) for p in t.params] == [
        ("w", True, True), ("norm", True, False), ("head", True, False), ("a.lora_A.weight", False, False)]
    assert [piece.spec.name for piece in t.pieces] == ["a.lora_A.weight"]
    assert [p.written for p in tensors(0, 0).params if p.frozen] == [True, True, False]
    assert not any(p.written for p in tensors(1, 0).params)


def test_a_sharded_frozen_base_is_written_and_loaded_through_the_slices_each_rank_keeps():
    """ZeRO-3 with a frozen base: its params are ``sharded`` (never read whole); ``frozen_pieces`` cover every
    element once over the two dp ranks, lie in ``frozen_slices``, and are written where counted (tp rank 0 for
    a tp-replicated norm, never the tied copy)."""
    def tensors(dp_rank, tp_rank):
        adapter, = params(SlabSpec("a.lora_A.weight", (2, 3)))
        w, norm, head = params(SlabSpec("w", (4, 3), 0, tp_rank, 2), SlabSpec("norm", (3,), None, tp_rank, 2),
                               SlabSpec("head", (4, 3), 0, tp_rank, 2, tied="copy"))
        trainer = stand_in_trainer([adapter], dp_rank=dp_rank, zero=3, tp_rank=tp_rank, frozen=[w, norm, head],
                                   frozen_units=[[w], [norm, head]])
        return TrainerState(trainer).tensors(), {"w": w, "norm": norm, "head": head}

    for tp_rank in (0, 1):
        covered: dict[str, list] = {}
        for dp_rank in (0, 1):
            t, base = tensors(dp_rank, tp_rank)
            assert [(p.spec.name, p.frozen, p.sliced) for p in t.params if p.frozen] == [
                ("w", True, True), ("norm", True, True), ("head", True, True)]
            assert [s.numel() for s in t.frozen_slices] == [3, 5]  # w: 6 elements / 2; norm + head: 9 -> 10 / 2
            for piece in t.frozen_pieces:
                values = piece.take(t.frozen_slices[piece.owner], piece.lo, piece.hi)
                assert torch.equal(values, torch.arange(float(piece.lo), float(piece.hi))), piece  # params() counts up
                assert piece.written == (piece.spec.name == "w" or (piece.spec.name == "norm" and tp_rank == 0))
                covered.setdefault(piece.spec.name, []).extend(range(piece.lo, piece.hi))
        assert {name: sorted(e) for name, e in covered.items()} == {"w": list(range(6)), "norm": list(range(3)),
                                                                     "head": list(range(6))}


def test_trainer_state_root_state_and_step_counters():
    trainer = stand_in_trainer(params(SlabSpec("w", (2, 2))), dp_rank=0, zero=False)
    trainer.parts.optimizer.step_count = 4
    state = TrainerState(trainer)
    assert state.root_state() == contract.RootState(5, 4, {"position": 7}, {})
    state.set_steps(11, 9)
    assert (trainer.step, trainer.parts.optimizer.step_count) == (11, 9)
    state.load_loss_scaler({"scale": 2.0})  # no loss scaling in this run: ignored


def test_half_precision_runs_checkpoint_a_separate_master_copy():
    trainer = stand_in_trainer(params(SlabSpec("w", (2, 2)), dtype=torch.bfloat16), dp_rank=0, zero=False)
    tensors = TrainerState(trainer).tensors()
    assert tensors.state_kinds == ("exp_avg", "exp_avg_sq", "master")
    assert (tensors.model_dtype, tensors.state_dtype) == (torch.bfloat16, torch.float32)


def test_flat_params_is_complete_at_construction():
    """The reducer is built last, from the finished FlatParams: it sees the timer and buckets passed in."""
    seen = {}

    def make_reducer(flat):
        seen.update(timer=flat.timer, check=flat.check_finite, buckets=len(flat.buckets))
        return "reducer"

    flat = FlatParams(params(SlabSpec("w", (2, 2))), None, timer="timer", check_finite=True,
                      make_reducer=make_reducer)
    assert flat.reducer == "reducer" and seen == {"timer": "timer", "check": True, "buckets": 1}
    assert type(FlatParams(params(SlabSpec("w", (2, 2))), None).reducer).__name__ == "DenseReducer"
