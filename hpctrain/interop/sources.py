"""Global weights by hpctrain parameter name, from a Hugging Face Llama/Mistral/Mixtral directory or an hpctrain
checkpoint, and ``model.init_from``: a fresh run starts from those weights, each rank reading only its slabs, in
any layout (dp/tp/pp/ZeRO, sequence parallelism, expert parallelism).

A source has ``model`` (its resolved ModelConfig), ``moe`` (its resolved ``[moe]``, None for a dense model),
``dtype`` (``float32``, ``bfloat16``, ...), ``read(name, index=None)`` (a torch tensor: the global tensor, or
its ``index`` slab) and ``close()``.
"""
from __future__ import annotations

import json
import os

import torch

from hpctrain.checkpoint.contract import TrainState
from hpctrain.checkpoint.architecture import of_checkpoint
from hpctrain.checkpoint.format import local_range_boxes
from hpctrain.config import ModelConfig, architecture, architecture_differences, resolve_model
from hpctrain.config.moe_keys import resolve_moe
from hpctrain.errors import HpcTrainError, everywhere
from hpctrain.interop.base_ref import ReferencedBase
from hpctrain.interop.hf import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, HFModelDir, parameter_shapes
from hpctrain.models.lora import adapter_shapes
from hpctrain.parallel.lora import is_adapter


class CheckpointSource:
    """The model weights of an hpctrain checkpoint (step, checkpoints or run directory), every read
    CRC-checked; only complete (published) checkpoints are accepted. A LoRA checkpoint that refers to its base
    (root attribute ``lora_base``, interop/base_ref.py) reads the base weights from there, each tensor checked
    against the recorded checksums the first time it is read; ``base`` is where to look when the recorded path
    is gone. ``base_path``: where the base weights are (None: in this checkpoint)."""

    def __init__(self, path: str, base: str = ""):
        from hpctrain.checkpoint.weights import config_of, open_checkpoint

        self.reader = open_checkpoint(path)
        self.dir = self.reader.dir
        try:
            if not self.reader.complete:
                raise HpcTrainError(f"{self.reader.dir}: no COMPLETE marker: a partial checkpoint, never published")
            cfg = config_of(self.reader)
        except BaseException:
            self.reader.close()
            raise
        self.config, self.model = cfg, resolve_model(cfg.model)
        self.moe = resolve_moe(cfg.moe, self.model)
        self.architecture = of_checkpoint(self.reader.attrs)  # the model it was written for (recorded keys)
        self.dtype = str(self.reader.attrs.get("model_dtype", cfg.train.dtype))
        self.attrs = self.reader.attrs
        self.lora = cfg.lora if cfg.lora.rank else None  # a LoRA run's checkpoint: base + adapters
        self.shapes = parameter_shapes(self.model, self.moe)
        if self.lora:
            self.shapes.update(adapter_shapes(self.model, self.lora))
        self._reference, self._base_hint = self.attrs.get("lora_base"), base
        self._base: ReferencedBase | None = None

    @property
    def base(self):
        """The ReferencedBase of a checkpoint that refers to its base (opened on first use), else None."""
        if self._reference and self._base is None:
            self._base = ReferencedBase(self._reference, self._base_hint or self.config.model.init_from, self.model,
                                        f"checkpoint {self.dir}", open_source, verify_all=True)
        return self._base

    @property
    def base_path(self) -> str | None:
        return self.base.base_path if self._reference else None

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        from hpctrain.checkpoint.format import Box, model_dataset

        dataset, shape = model_dataset(name), self.shapes.get(name)
        if self._reference and self.reader.shape(dataset) is None and shape is not None and not is_adapter(name):
            return self.base.read(name, index)
        if shape is None or self.reader.shape(dataset) != shape:
            raise HpcTrainError(f"{self.reader.path}: {dataset} has shape {self.reader.shape(dataset)}, its config "
                                f"implies {shape}: the checkpoint does not match its own config")
        index = index or tuple(slice(None) for _ in shape)
        offset = tuple(s.start or 0 for s in index)
        box = Box(offset, tuple((n if s.stop is None else s.stop) - o for s, o, n in zip(index, offset, shape)))
        data = self.reader.read_checked(dataset, box)
        if self.reader.problems:
            raise HpcTrainError(f"{self.reader.path} is corrupt: " + "; ".join(self.reader.problems[:3]))
        return torch.from_numpy(data)

    def drop_cache(self) -> None:
        """Forget the checked boxes read so far (an export reading one parameter at a time holds one)."""
        self.reader.drop_cache()
        if self._base is not None:
            self._base.drop_cache()

    def close(self) -> None:
        self.reader.close()
        if self._base is not None:
            self._base.close()


def load_run_model(path: str, dtype: torch.dtype | None = None, base: str = ""):
    """(cfg, model, attrs): ``checkpoint.weights.load_model`` of the checkpoint at ``path`` (a run, checkpoints
    or step directory), its LoRA base read where it refers to (``base``: where it is now, when moved) and
    checked against the recorded checksums; every byte CRC-checked."""
    from hpctrain.checkpoint.weights import load_model

    source = CheckpointSource(path, base)
    try:
        cfg, model = load_model(source.reader, dtype, read=source.read)
        return cfg, model, {**source.attrs, "path": source.reader.path}
    finally:
        source.close()


def open_source(path: str, base: str = ""):
    """An HFModelDir when ``path`` holds a config.json, else a CheckpointSource (``base``: where its LoRA base
    is when it refers to one that moved); HpcTrainError otherwise."""
    if not path or not os.path.exists(path):
        raise HpcTrainError(f"{path!r}: no such Hugging Face model directory or hpctrain checkpoint")
    if os.path.isfile(os.path.join(path, "adapter_config.json")) and not is_hf_dir(path):
        raise HpcTrainError(f"{path} is a PEFT adapter directory, without its base model: import it with "
                            f"`hpctrain import-peft {path} --base BASE --out CKPT_DIR` and start from CKPT_DIR")
    return HFModelDir(path) if is_hf_dir(path) else CheckpointSource(path, base)


def is_hf_dir(path: str) -> bool:
    """A directory with an HF config.json (not the config.json of an hpctrain run directory)."""
    config = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config):
        return False
    if any(os.path.exists(os.path.join(path, name)) for name in (WEIGHTS_FILE, INDEX_FILE)):
        return True
    try:
        with open(config, encoding="utf-8") as f:
            return "model_type" in json.load(f)
    except (OSError, ValueError):
        return True  # HFModelDir says what is wrong with it


def check_same_model(source_model: ModelConfig | dict, ours: ModelConfig | dict, where: str) -> None:
    """HpcTrainError listing every architecture key (heads, sizes, rope_theta, ...) that differs."""
    differences = architecture_differences(source_model, ours)
    if differences:
        raise HpcTrainError(f"{where} holds another model than this run's config: {'; '.join(differences)}. Set "
                            f"model.* as there (`hpctrain import-hf` prints the [model] section of an HF model)")


def check_adapters(source, lora, where: str) -> bool:
    """Whether a fresh run with ``lora`` (its ``[lora]``) takes the adapters of ``source`` too: yes when the
    source holds adapters of the same rank, targets and alpha; no when it holds none or others (the run takes
    its base weights, its adapters start fresh). A run without adapters refuses a source with adapters
    (HpcTrainError): their base alone is not the model they train."""
    theirs = getattr(source, "lora", None)
    if theirs is None:
        return False
    if not lora.rank:
        raise HpcTrainError(f"{where} holds LoRA adapters (lora.rank={theirs.rank} on {','.join(theirs.targets)}) "
                            f"and this run has none: export it with `hpctrain export {where} --format hf "
                            f"--merge-lora --out DIR` and start from DIR, or set lora.rank/targets/alpha as there")
    same = theirs.rank == lora.rank and sorted(theirs.targets) == sorted(lora.targets)
    if same and theirs.alpha != lora.alpha:
        raise HpcTrainError(f"{where} holds adapters with lora.alpha={theirs.alpha:g}, this run has "
                            f"lora.alpha={lora.alpha:g}: set it as there to continue them")
    return same


def _piece_values(tensors, spec, source) -> list:
    """(target, values) for each box of the ZeRO-3 pieces of parameter ``spec`` this rank keeps."""
    staged = []
    kept = [(piece, tensors.ranges[piece.owner].params) for piece in tensors.pieces] + \
        [(piece, tensors.frozen_slices[piece.owner]) for piece in tensors.frozen_pieces]  # a frozen base's too
    for piece, values in kept:
        if piece.spec.name == spec.name:
            for box, a, b in local_range_boxes(spec, piece.lo, piece.hi):
                staged.append((piece.take(values, a, b), source.read(spec.name, box.slices()).reshape(-1)))
    return staged


def init_weights(state: TrainState, path: str, world) -> None:
    """Collective over ``world`` (the world Communicator): copy ``path``'s weights (HF dir or hpctrain
    checkpoint) into a fresh run (``trainer.state``). Each rank reads its slab of every parameter it holds; the
    ranks agree before anything changes, so an error (missing file, other model, corrupt checkpoint) is
    raised on every rank with the model untouched. Optimizer state stays fresh; half-precision runs take
    their float32 master weights from the new values. A LoRA run takes its base weights from ``path``,
    and its adapters too when ``path`` is a LoRA checkpoint with the same ones (``check_adapters``); else
    they keep their initial values."""
    staged, problem, source = [], None, None
    tensors = state.tensors()
    try:
        source = open_source(path)
        check_same_model(getattr(source, "architecture", source.model),
                         architecture(state.model_config, state.config.moe), path)
        with_adapters = check_adapters(source, state.config.lora, path)
        for p in tensors.params:
            if is_adapter(p.spec.name) and not with_adapters:
                continue  # a LoRA run from base weights: its adapters keep their initial values
            if p.sliced:  # ZeRO-3: only the pieces this rank keeps
                staged += _piece_values(tensors, p.spec, source)
            elif p.spec.valid_numel:  # the real rows of a padded vocabulary slab; the padding stays zero
                staged.append((p.data[p.spec.valid_local()], source.read(p.spec.name, p.spec.local_slices())))
    except (HpcTrainError, OSError) as exc:
        problem = str(exc)
    finally:
        if source is not None:
            source.close()
    problems = [(r, e) for r, e in enumerate(world.allgather_object(problem)) if e]
    if problems:
        rank, message = problems[0]
        others = f" (rank {rank}; {len(problems)} rank(s) failed)" if len(problems) < world.size else ""
        raise everywhere(HpcTrainError(f"model.init_from={path}: {message}{others}"))
    with torch.no_grad():
        for data, values in staged:
            data.copy_(values)
        for owned in tensors.ranges:
            if "master" in owned.state:  # a separate copy
                owned.state["master"].copy_(owned.params)
