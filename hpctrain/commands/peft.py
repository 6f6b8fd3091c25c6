"""LoRA runs in and out (one process): ``hpctrain export RUN --format peft --out DIR`` (a PEFT adapter
directory), the merged weights of ``--format hf --merge-lora`` and ``hpctrain import-peft DIR --base BASE
--out CKPT_DIR`` (a PEFT adapter on its base -> a weights-only step-0 checkpoint with ``[lora]`` set, that
``train --resume`` or ``model.init_from`` continues). Outputs are staged as in interop.py: nothing is written on
error, and a non-empty ``--out`` is replaced only with ``--force``.
"""
from __future__ import annotations

import os
import shutil
import sys
from contextlib import contextmanager
from types import SimpleNamespace

from hpctrain.errors import HpcTrainError
from hpctrain.runtime import env


def add_import_parser(sub) -> None:
    i = sub.add_parser("import-peft", help="turn a PEFT LoRA adapter on its base model into a step-0 hpctrain "
                                           "checkpoint that trains the adapter on",
                       description="Read a PEFT LoRA adapter directory (adapter_config.json + "
                                   "adapter_model.safetensors) and its base model (--base, else the adapter's "
                                   "base_model_name_or_path when it is a local directory) and write a weights-only "
                                   "hpctrain checkpoint at step 0 holding the base and the adapter, with the "
                                   "adapter's r/alpha/targets as [lora].")
    i.add_argument("adapter_dir", metavar="DIR")
    i.add_argument("--base", default="", metavar="HF_DIR|CKPT",
                   help="the base model: a Hugging Face Llama/Mistral directory or an hpctrain checkpoint")
    i.add_argument("--out", required=True, metavar="CKPT_DIR", help="the checkpoints directory to create")
    i.add_argument("--force", action="store_true", help="replace a non-empty --out")
    i.set_defaults(func=run_import_peft)


def base_model_path(init_from: str, depth: int = 4) -> str | None:
    """The Hugging Face directory a run's base came from (its ``model.init_from``, followed through hpctrain
    checkpoints' own init_from / imported_from), which PEFT can load; None when there is none (no init_from,
    an hpctrain-trained base, a path that is gone)."""
    from hpctrain.checkpoint.weights import config_of, open_checkpoint
    from hpctrain.interop.sources import is_hf_dir

    if not init_from or not os.path.exists(init_from) or depth == 0:
        return None
    if is_hf_dir(init_from):
        return os.path.abspath(init_from)
    try:
        reader = open_checkpoint(init_from)
    except HpcTrainError:
        return None
    try:
        attrs, cfg = reader.attrs, config_of(reader)
    finally:
        reader.close()
    for earlier in (cfg.model.init_from, attrs.get("imported_from", "")):
        if earlier and os.path.exists(earlier) and is_hf_dir(earlier):
            return os.path.abspath(earlier)
    return base_model_path(cfg.model.init_from, depth - 1)


@contextmanager
def open_run(path: str, merge_lora: bool, want: str, base: str = ""):
    """Yield ``model``, ``moe`` (the resolved ``[moe]``, None without experts), ``dtype``, ``shapes`` (base
    parameter name -> global shape), ``read(name)`` (that parameter's global tensor, read when asked: a LoRA
    run's merged), ``adapters`` (read), ``lora`` (None without), ``config``, ``step`` and ``dir`` (the step
    directory) of a checkpoint, open until the block ends; ``want``: ``hf`` or ``peft``. A LoRA run exported as
    hf needs ``merge_lora`` (its base alone is not the trained model); a run without adapters has nothing to
    export as peft. ``base``: where a referred LoRA base is now, if it moved."""
    from hpctrain.interop.hf import parameter_shapes, require_llama
    from hpctrain.interop.peft import merged
    from hpctrain.interop.sources import CheckpointSource

    source = CheckpointSource(path, base)
    try:
        m, lora = source.model, source.lora
        require_llama(m, f"hpctrain export {source.dir}", source.moe)
        if want == "peft" and lora is None:
            raise HpcTrainError(f"hpctrain export --format peft: {source.dir} has no LoRA adapters (lora.rank = 0): "
                                f"export its weights with --format hf")
        if want == "hf" and lora is not None and not merge_lora:
            raise HpcTrainError(f"hpctrain export --format hf: {source.dir} is a LoRA run (lora.rank={lora.rank}): "
                                f"pass --merge-lora for merged full weights, or use --format peft for the adapters")
        if want == "hf" and lora is None and merge_lora:
            raise HpcTrainError(f"hpctrain export --merge-lora: {source.dir} has no LoRA adapters to merge")
        base_names = parameter_shapes(m, source.moe)
        adapters = {n: source.read(n) for n in source.shapes if n not in base_names}

        def read(name: str):
            tensor = merged(name, source.read(name), adapters, lora) if lora else source.read(name)
            source.drop_cache()  # its boxes are in ``tensor`` now: hold one parameter, never the model
            return tensor

        yield SimpleNamespace(model=m, moe=source.moe, dtype=source.dtype,
                              shapes={} if want == "peft" else base_names, read=read, adapters=adapters, lora=lora,
                              config=source.config, step=source.attrs.get("step"), dir=source.dir)
    finally:
        source.close()


def run_export_peft(args) -> int:
    import torch

    from hpctrain.interop.staging import staged_output
    from hpctrain.interop.peft import write_peft

    torch.set_num_threads(env.omp_num_threads())
    if args.merge_lora:
        raise HpcTrainError("hpctrain export --merge-lora goes with --format hf (merged full weights); "
                            "--format peft writes the adapters")
    with staged_output(args.out, args.force, "hpctrain export", args.checkpoint) as tmp:
        with open_run(args.checkpoint, False, "peft") as run:
            lora, adapters = run.lora, run.adapters
        dtype = run.dtype if args.dtype == "auto" else args.dtype
        init_from = run.config.model.init_from
        base = getattr(args, "base_model", "") or base_model_path(init_from)
        files = write_peft(tmp, lora, adapters, dtype, base)
    params = sum(t.numel() for t in adapters.values())
    if base is None:  # PEFT loads a Hugging Face model (or hub name) only: say what to do
        print(f"hpctrain export: WARNING: base_model_name_or_path is null: the run's base ("
              f"{init_from or 'random, no model.init_from'}) is no Hugging Face model directory that PEFT can "
              f"load. Export the base with `hpctrain export BASE --format hf --out DIR` and pass --base-model DIR "
              f"(or set base_model_name_or_path in adapter_config.json)", file=sys.stderr, flush=True)
    print(f"hpctrain export: {run.dir} (step {run.step}) -> {os.path.abspath(args.out)}: a PEFT LoRA adapter "
          f"(r={lora.rank}, alpha={lora.alpha:g}, on {','.join(lora.targets)}), {', '.join(files)}; {params:,} "
          f"parameters in {dtype}; base_model_name_or_path: {base}")
    return 0


def run_import_peft(args) -> int:
    import torch

    from hpctrain.config import Config
    from hpctrain.interop.staging import model_toml, staged_output, window_note, write_weights_only
    from hpctrain.interop.hf import parameter_shapes
    from hpctrain.interop.hf_config import import_seq_len
    from hpctrain.interop.peft import ADAPTER_CONFIG, read_adapter_config, read_peft
    from hpctrain.interop.sources import is_hf_dir, open_source

    torch.set_num_threads(env.omp_num_threads())
    base = args.base
    if not base:
        recorded = read_adapter_config(args.adapter_dir).get("base_model_name_or_path") or ""
        if not (recorded and os.path.isdir(recorded)):
            raise HpcTrainError(f"hpctrain import-peft: {args.adapter_dir}/{ADAPTER_CONFIG} names no local base "
                                f"model (base_model_name_or_path={recorded!r}): give it with --base HF_DIR|CKPT")
        base = recorded
    out = os.path.abspath(args.out)
    with staged_output(args.out, args.force, "hpctrain import-peft", args.adapter_dir) as tmp:
        source = open_source(base)
        try:
            m, dtype = source.model, source.dtype
            lora, adapters, _ = read_peft(args.adapter_dir, m)
            tensors = {name: source.read(name) for name in parameter_shapes(m)}
        finally:
            source.close()
        cfg = Config(model=m, lora=lora)
        cfg.model.init_from = os.path.abspath(base)  # a record: where the base came from (export names it)
        cfg.train.dtype, cfg.train.seq_len = dtype, import_seq_len(m)
        tokenizer = os.path.join(base, "tokenizer.json")
        if is_hf_dir(base) and os.path.isfile(tokenizer):
            shutil.copyfile(tokenizer, os.path.join(tmp, "tokenizer.json"))
            cfg.data.tokenizer = os.path.join(out, "tokenizer.json")
        write_weights_only(tmp, cfg, {**tensors, **adapters}, dtype, os.path.abspath(args.adapter_dir))
        targets = ", ".join(f'"{t}"' for t in lora.targets)
        with open(os.path.join(tmp, "model.toml"), "w", encoding="utf-8") as f:
            f.write(f"# the model of {os.path.abspath(base)} with the adapter {os.path.abspath(args.adapter_dir)}: "
                    f"put these sections in the training config\n" + window_note(m) + model_toml(m)
                    + f"\n[lora]\nrank = {lora.rank}\nalpha = {lora.alpha!r}\ndropout = {lora.dropout!r}\n"
                      f"targets = [{targets}]\n")
    print(f"hpctrain import-peft: {os.path.abspath(args.adapter_dir)} on {os.path.abspath(base)} -> "
          f"{out}/step-00000000 (weights only, step 0): LoRA r={lora.rank}, alpha={lora.alpha:g} on "
          f"{','.join(lora.targets)}, {sum(t.numel() for t in adapters.values()):,} adapter parameters in {dtype}\n"
          f"Its [model] and [lora] sections are in {out}/model.toml. Continue training the adapter with\n"
          f"  hpctrain train --config CONFIG model.init_from={out}   (any layout; the same [lora])\n"
          f"  or --resume {out}")
    return 0
