"""The Trainer's side of the checkpoint contract (``hpctrain.checkpoint.contract.TrainState``): the one place
that maps trainer internals (flat buffers, optimizer slices, sampler, loss scaler, dp reducer, step
counters) to what a checkpoint saves and restores."""
from __future__ import annotations

import torch

from hpctrain.checkpoint.contract import ModelSlab, OptimizerPiece, OwnedRange, RootState, TrainTensors


class TrainerState:
    """``TrainState`` of one Trainer, on this rank (``trainer.state``, built at the end of its construction)."""

    def __init__(self, trainer):
        self._trainer = trainer
        grid, cfg = trainer.grid, trainer.cfg
        self.rank, self.world_size = grid.info.rank, grid.info.size
        self.config, self.model_config, self.timer = cfg, trainer.parts.model_cfg, trainer.parts.timer
        self.layout = {**grid.sizes, "ep": cfg.parallel.ep, "zero": cfg.parallel.zero, "world": grid.info.size}
        self.reducer = trainer.parts.reducer
        self.base_reference = None  # set by model.init_from (train/loop.py) or a resumed checkpoint

    def open_base(self, reference: dict, what: str):
        from hpctrain.interop.base_ref import ReferencedBase
        from hpctrain.interop.sources import open_source

        return ReferencedBase(reference, self.config.model.init_from, self.model_config, what, open_source)

    def tensors(self) -> TrainTensors:
        """Model pieces: every parameter of the local model (the trainable ones are ``params.flat.params``; the
        frozen base of a LoRA run is written by replica rank 0); owned ranges: the optimizer's slices;
        pieces: ``owned_pieces()``, written by the ZeRO owner (or replica rank 0) where
        ``SlabSpec.counted_on`` this tp rank."""
        t = self._trainer
        params, opt, coords = t.parts.params, t.parts.optimizer, t.grid.coords
        kinds = opt.state_kinds
        ranges: list[OwnedRange] = []
        owner: dict[int, int] = {}  # id(slice) -> its index in ranges
        for part in opt.owned_slices:
            owner[id(part)] = len(ranges)
            ranges.append(OwnedRange(part.params, {kind: getattr(part, kind) for kind in kinds}))
        first_replica = coords["dp"] == 0 and coords["cp"] == 0  # one of the dp x cp replicas

        def first_holder(p) -> bool:  # an expert split over ep: the first replica holding it (ep_replica rank 0)
            return first_replica if p.spec.experts is None else t.grid.comm("ep_replica").rank == 0

        pieces = [OptimizerPiece(piece.param.spec, piece.param_lo, piece.param_hi, owner[id(part)],
                                 piece.flat_lo - part.start,
                                 params.writes(piece.param, first_replica) and piece.param.spec.counted_on(coords["tp"]))
                  for piece, part in opt.owned_pieces()]
        slabs = [ModelSlab(p.spec, p.data, sliced=params.sliced(p)) if p.requires_grad else
                 ModelSlab(p.spec, p.data, frozen=True, sliced=params.sliced(p),
                           written=first_holder(p) and p.spec.counted_on(coords["tp"]))
                 for p in t.parts.local_model.parameters()]
        # ZeRO-3's frozen base: each element kept by one rank of its group, which writes it (none below ZeRO-3)
        frozen = params.frozen
        frozen_pieces = [OptimizerPiece(piece.param.spec, piece.param_lo, piece.param_hi, k, at,
                                        piece.param.spec.counted_on(coords["tp"]))
                         for piece, k, at in frozen.pieces()]
        return TrainTensors(slabs, ranges, pieces, kinds, params.flat.param_dtype, opt.master_dtype,
                            [b.param_slice for b in frozen.buckets], frozen_pieces)

    def root_state(self) -> RootState:
        t = self._trainer
        parts = t.parts
        return RootState(t.step, parts.optimizer.step_count, parts.data.batches.state_dict(), parts.scaler.state_dict())

    def before_next_update(self, wait) -> None:
        self._trainer.before_update.append(wait)

    def set_steps(self, step: int, optimizer_step: int) -> None:
        self._trainer.step = step
        self._trainer.parts.optimizer.step_count = optimizer_step

    def check_sampler(self, state: dict) -> None:
        self._trainer.parts.data.batches.check_state_dict(state)

    def load_sampler(self, state: dict) -> None:
        self._trainer.parts.data.batches.load_state_dict(state)

    def load_loss_scaler(self, state: dict) -> None:
        if self._trainer.parts.scaler.enabled:
            self._trainer.parts.scaler.load_state_dict(state)

    def rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()  # the Trainer seeds torch's global generator per rank

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)
