"""``hpctrain export CKPT --format hf --out DIR`` and ``hpctrain import-hf DIR --out CKPT_DIR`` (one process).

export: the global view of a checkpoint of any layout (dp/tp/pp/ZeRO) -> config.json (a Llama, or a
Mistral when model.attention_window > 0), model.safetensors and the run's tokenizer (when it used a
tokenizer.json). import-hf: a Llama or Mistral config.json + safetensors -> a weights-only hpctrain
checkpoint at step 0 (``CKPT_DIR/latest``, ``CKPT_DIR/step-00000000/``) that
``hpctrain train --resume CKPT_DIR`` or ``model.init_from=CKPT_DIR`` starts from, in any layout.
Both write into a temporary directory beside ``--out`` and rename it at the end: a failure leaves
nothing half-written, and a non-empty ``--out`` is only replaced with ``--force``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

from hpctrain.errors import HpcTrainError
from hpctrain.runtime.outputs import mark, why_not_replaceable
from hpctrain.runtime import env
from hpctrain.runtime.dtypes import DTYPE_NAMES, torch_dtype  # no torch import here: `hpctrain info` stays fast



def add_parser(sub) -> None:
    e = sub.add_parser("export", help="write a checkpoint (any layout) as a Hugging Face Llama/Mistral model "
                                      "(one process)",
                       description="Export the model of a checkpoint (a run, checkpoints or step directory; any "
                                   "layout) as a transformers LlamaForCausalLM directory (MistralForCausalLM, "
                                   "with sliding_window, when model.attention_window > 0).")
    e.add_argument("checkpoint", metavar="CKPT_OR_RUN_DIR")
    e.add_argument("--format", required=True, choices=["hf"], help="hf: config.json + model.safetensors")
    e.add_argument("--out", required=True, metavar="DIR", help="the directory to create")
    e.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES],
                   help="dtype of the exported weights (default auto: the run's train.dtype)")
    e.add_argument("--tokenizer", default="", metavar="PATH|none",
                   help="tokenizer.json to include (default: the run's data.tokenizer when it is a file)")
    e.add_argument("--force", action="store_true", help="replace a non-empty --out")
    e.set_defaults(func=run_export)
    i = sub.add_parser("import-hf", help="turn a Hugging Face Llama/Mistral model into a step-0 hpctrain "
                                         "checkpoint",
                       description="Read a Llama or Mistral config.json + model.safetensors (or sharded "
                                   "safetensors with their index) and write a weights-only hpctrain checkpoint at "
                                   "step 0.")
    i.add_argument("hf_dir", metavar="DIR")
    i.add_argument("--out", required=True, metavar="CKPT_DIR", help="the checkpoints directory to create")
    i.add_argument("--force", action="store_true", help="replace a non-empty --out")
    i.set_defaults(func=run_import)


@contextlib.contextmanager
def staged_output(out: str, force: bool, tool: str, source: str):
    """Yield a fresh temporary directory beside ``out``; on success it becomes ``out`` (an existing one is
    replaced only when empty, or with ``force`` when ``tool`` wrote it: ``runtime/outputs.py``), on failure
    it is removed. ``out`` may never be, hold or lie inside ``source``."""
    out = os.path.abspath(out.rstrip("/") or out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise HpcTrainError(f"--out {out}: exists and is not a directory")
    problem = why_not_replaceable(out, f"--out {out}", (source,))
    if problem:
        raise HpcTrainError(problem)
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise HpcTrainError(f"--out {out}: exists and is not empty; use --force to replace it")
    parent, base = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    try:
        yield tmp
        mark(tmp, tool)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        for root, _, files in os.walk(tmp):
            for name in files:
                path = os.path.join(root, name)
                os.chmod(path, 0o666 & ~umask)  # safetensors (0.8) writes its files 0600
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        old = None
        if os.path.isdir(out):
            old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
            os.rename(out, os.path.join(old, base))
        os.rename(tmp, out)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _tokenizer_file(option: str, configured: str) -> str | None:
    """The tokenizer.json to export: ``--tokenizer`` (``none``/``bytes``: nothing), else the run's data.tokenizer."""
    spec = option or configured
    if spec in ("", "bytes", "none"):
        return None
    if not os.path.isfile(spec):
        where = "--tokenizer" if option else f"the run's data.tokenizer ({spec!r}, relative to {os.getcwd()})"
        raise HpcTrainError(f"{where}: no such tokenizer.json; give its path with --tokenizer PATH, or "
                            f"--tokenizer none to export the model without it")
    return spec


def run_export(args) -> int:
    import torch

    from hpctrain.data.tokenizer import load_tokenizer
    from hpctrain.interop.hf import hf_model_type, parameter_shapes, require_llama, write_hf
    from hpctrain.interop.sources import CheckpointSource

    torch.set_num_threads(env.omp_num_threads())
    with staged_output(args.out, args.force, "hpctrain export", args.checkpoint) as tmp:  # checks --out first
        source = CheckpointSource(args.checkpoint)
        try:
            m, dtype = source.model, (source.dtype if args.dtype == "auto" else args.dtype)
            require_llama(m, f"hpctrain export {source.dir}")
            tensors = {name: source.read(name) for name in parameter_shapes(m)}
            step, tokenizer = source.attrs.get("step"), _tokenizer_file(args.tokenizer, source.config.data.tokenizer)
        finally:
            source.close()
        if tokenizer and load_tokenizer(tokenizer).vocab_size > m.vocab_size:
            raise HpcTrainError(f"{tokenizer} has more tokens than the model's vocab_size={m.vocab_size}: "
                                f"not this model's tokenizer")
        files = write_hf(tmp, m, tensors, dtype, tokenizer)
    params = sum(t.numel() for t in tensors.values())
    print(f"hpctrain export: {source.dir} (step {step}) -> {os.path.abspath(args.out)}: a {hf_model_type(m)} "
          f"model, {', '.join(files)}; "
          f"{params:,} parameters in {dtype}" + ("" if tokenizer else "; no tokenizer (byte-level ids 0..255)"))
    return 0


def model_toml(m) -> str:
    """The ``[model]`` TOML section of the resolved model ``m`` (what a training config needs)."""
    from hpctrain.config import config_to_dict

    lines = ["[model]"]
    for key, value in config_to_dict(m).items():
        if key != "init_from":
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def window_note(m, comment: str = "# ") -> str:
    """A line on the sliding window of the model ``m`` (none without one): train.seq_len must hold it."""
    if not m.attention_window:
        return ""
    return (f"{comment}model.attention_window = {m.attention_window} (Mistral's sliding_window) is part of the "
            f"model: train it with train.seq_len >= {m.attention_window} (a window must fit the sequence).\n")


class _OneRank:
    """The communicator the checkpoint writers need, for one process without MPI."""

    rank, size = 0, 1

    def allgather_object(self, obj):
        return [obj]

    def gather_object(self, obj, root: int = 0):
        return [obj]


def write_weights_only(directory: str, cfg, tensors: dict, dtype: str, source: str) -> str:
    """Write ``tensors`` (hpctrain name -> global tensor) as a published weights-only checkpoint of step 0 in
    the checkpoints directory ``directory`` (shards writer, verified); returns the step directory."""
    import hpctrain
    from hpctrain.checkpoint.format import (COMPLETE_MARKER, FORMAT_NAME, FORMAT_VERSION, LATEST_POINTER, Box,
                                            disk_dtype, model_dataset, step_dirname)
    from hpctrain.checkpoint.reader import CheckpointReader
    from hpctrain.checkpoint.state import Snapshot, WriteItem
    from hpctrain.checkpoint.writers import write_shards
    from hpctrain.config import config_to_dict

    on_disk = disk_dtype(torch_dtype(dtype))
    snap = Snapshot(0, {})
    for name, t in tensors.items():
        array = t.to(torch_dtype(dtype)).double().numpy().astype(on_disk)  # bf16/fp16 widen exactly
        snap.datasets[model_dataset(name)] = (tuple(array.shape), on_disk.str)
        snap.items.append(WriteItem(model_dataset(name), Box((0,) * array.ndim, array.shape), array))
    snap.attrs = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "hpctrain_version": hpctrain.__version__,
                  "step": 0, "optimizer_step": 0, "config": config_to_dict(cfg), "model_dtype": dtype,
                  "layout": {"dp": 1, "pp": 1, "tp": 1, "zero": 0, "world": 1},
                  "sampler": {"consumed": 0, "seed": cfg.train.seed, "seq_len": cfg.train.seq_len},
                  "loss_scaler": {"scale": cfg.train.loss_scale, "good_steps": 0},
                  "weights_only": True, "imported_from": source}
    step_dir = os.path.join(directory, step_dirname(0))
    os.makedirs(os.path.join(step_dir, "shards"))
    write_shards(_OneRank(), step_dir, snap)
    with CheckpointReader(step_dir) as reader:
        problems = reader.verify()
    if problems:
        raise HpcTrainError(f"{step_dir}: the written checkpoint does not verify: {'; '.join(problems[:3])}")
    with open(os.path.join(step_dir, COMPLETE_MARKER), "w", encoding="utf-8") as f:
        json.dump({"step": 0, "writer": "shards"}, f)
    with open(os.path.join(directory, LATEST_POINTER), "w", encoding="utf-8") as f:
        f.write(step_dirname(0) + "\n")
    return step_dir


def run_import(args) -> int:
    import torch

    from hpctrain.config import Config
    from hpctrain.interop.hf import HFModelDir, supported_tp
    from hpctrain.interop.hf_config import import_seq_len

    torch.set_num_threads(env.omp_num_threads())
    out = os.path.abspath(args.out)
    with staged_output(args.out, args.force, "hpctrain import-hf", args.hf_dir) as tmp:
        source = HFModelDir(args.hf_dir)
        try:
            m, dtype = source.model, source.dtype
            tensors = {name: source.read(name) for name in source.shapes}
        finally:
            source.close()
        cfg = Config(model=m)
        cfg.train.dtype, cfg.train.seq_len = dtype, import_seq_len(m)
        tokenizer = os.path.join(args.hf_dir, "tokenizer.json")
        if os.path.isfile(tokenizer):
            shutil.copyfile(tokenizer, os.path.join(tmp, "tokenizer.json"))
            cfg.data.tokenizer = os.path.join(out, "tokenizer.json")
        write_weights_only(tmp, cfg, tensors, dtype, os.path.abspath(args.hf_dir))
        with open(os.path.join(tmp, "model.toml"), "w", encoding="utf-8") as f:
            f.write(f"# the model of {os.path.abspath(args.hf_dir)}: put this section in the training config\n"
                    + window_note(m) + model_toml(m))
    params = sum(t.numel() for t in tensors.values())
    tok = f"; its tokenizer: data.tokenizer={cfg.data.tokenizer}" if cfg.data.tokenizer != "bytes" else ""
    print(f"hpctrain import-hf: {os.path.abspath(args.hf_dir)} -> {out}/step-00000000 (weights only, step 0): "
          f"{params:,} parameters in {dtype}; tensor-parallel sizes that split it: "
          f"{', '.join(map(str, supported_tp(m)))}\n"
          f"Its [model] section is in {out}/model.toml{tok}. {window_note(m, comment='')}Train from it with\n"
          f"  hpctrain train --config CONFIG model.init_from={out}   (any layout; a resumed run ignores it)\n"
          f"  or --resume {out}")
    return 0
