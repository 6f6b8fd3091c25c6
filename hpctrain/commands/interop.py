"""``hpctrain export CKPT --format hf --out DIR`` and ``hpctrain import-hf DIR --out CKPT_DIR`` (one process).

export: the global view of a checkpoint of any layout (dp/tp/pp/ZeRO/ep) -> config.json (a Llama, a
Mistral when model.attention_window > 0, a Mixtral when the model has experts), model.safetensors and the
run's tokenizer (when it used a tokenizer.json); the weights stream one parameter at a time into safetensors
files of at most ``--max-shard-gb`` (hpctrain/interop/safetensors_stream.py). import-hf: a Llama, Mistral or Mixtral config.json +
safetensors -> a weights-only hpctrain checkpoint at step 0 (``CKPT_DIR/latest``, ``CKPT_DIR/step-00000000/``;
a Mixtral's config with its ``[moe]`` section) that ``hpctrain train --resume CKPT_DIR`` or
``model.init_from=CKPT_DIR`` starts from, in any layout.
A LoRA run exports as hf only with ``--merge-lora`` (W + alpha/r B A); ``--format peft`` and
``import-peft``: peft.py. Both write into a temporary directory beside ``--out`` and rename it at the
end: a failure leaves nothing half-written, and a non-empty ``--out`` is only replaced with ``--force``.
"""
from __future__ import annotations

import math
import os
import shutil

from hpctrain.errors import HpcTrainError
from hpctrain.commands.peft import add_import_parser, open_run, run_export_peft
from hpctrain.interop.staging import model_toml, staged_output, window_note, write_weights_only
from hpctrain.runtime import env
from hpctrain.runtime.dtypes import DTYPE_NAMES  # no torch import here: `hpctrain info` stays fast


def add_parser(sub) -> None:
    e = sub.add_parser("export", help="write a checkpoint (any layout) as a Hugging Face Llama/Mistral/Mixtral "
                                      "model (one process)",
                       description="Export the model of a checkpoint (a run, checkpoints or step directory; any "
                                   "layout) as a transformers LlamaForCausalLM directory (MistralForCausalLM, "
                                   "with sliding_window, when model.attention_window > 0; MixtralForCausalLM "
                                   "when moe.num_experts > 0).")
    e.add_argument("checkpoint", metavar="CKPT_OR_RUN_DIR")
    e.add_argument("--format", required=True, choices=["hf", "peft"],
                   help="hf: config.json + model.safetensors; peft: a LoRA run's adapters as a PEFT adapter "
                        "directory (adapter_config.json + adapter_model.safetensors)")
    e.add_argument("--merge-lora", action="store_true",
                   help="with --format hf, a LoRA run: write the merged weights W + alpha/r B A")
    e.add_argument("--out", required=True, metavar="DIR", help="the directory to create")
    e.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES],
                   help="dtype of the exported weights (default auto: the run's train.dtype)")
    e.add_argument("--tokenizer", default="", metavar="PATH|none",
                   help="tokenizer.json to include (default: the run's data.tokenizer when it is a file)")
    e.add_argument("--force", action="store_true", help="replace a non-empty --out")
    e.add_argument("--max-shard-gb", type=float, default=5.0, metavar="GB",
                   help="--format hf: the most bytes (1e9) one safetensors file holds (default 5, as save_pretrained); "
                        "more weights go to model-0000i-of-0000n.safetensors + model.safetensors.index.json. The "
                        "export streams one parameter at a time whatever the size")
    e.add_argument("--base", default="", metavar="PATH",
                   help="where a LoRA run's base is now, if it moved from the path its checkpoints refer to")
    e.add_argument("--base-model", default="", metavar="HF_DIR|NAME",
                   help="--format peft: the adapter's base_model_name_or_path (default: the Hugging Face "
                        "directory the run's base came from, else null with a warning)")
    e.set_defaults(func=run_export)
    i = sub.add_parser("import-hf", help="turn a Hugging Face Llama/Mistral/Mixtral model into a step-0 "
                                         "hpctrain checkpoint",
                       description="Read a Llama, Mistral or Mixtral config.json + model.safetensors (or sharded "
                                   "safetensors with their index) and write a weights-only hpctrain checkpoint at "
                                   "step 0.")
    i.add_argument("hf_dir", metavar="DIR")
    i.add_argument("--out", required=True, metavar="CKPT_DIR", help="the checkpoints directory to create")
    i.add_argument("--force", action="store_true", help="replace a non-empty --out")
    i.set_defaults(func=run_import)
    add_import_parser(sub)


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
    from hpctrain.interop.hf import hf_model_type, write_hf

    if args.format == "peft":
        return run_export_peft(args)
    torch.set_num_threads(env.omp_num_threads())
    if not args.max_shard_gb > 0:
        raise HpcTrainError(f"--max-shard-gb {args.max_shard_gb}: must be > 0")
    with staged_output(args.out, args.force, "hpctrain export", args.checkpoint) as tmp:  # checks --out first
        with open_run(args.checkpoint, args.merge_lora, "hf", args.base) as run:  # a LoRA run's weights merged
            m, lora, moe = run.model, run.lora, run.moe
            dtype = run.dtype if args.dtype == "auto" else args.dtype
            tokenizer = _tokenizer_file(args.tokenizer, run.config.data.tokenizer)
            if tokenizer and load_tokenizer(tokenizer).vocab_size > m.vocab_size:
                raise HpcTrainError(f"{tokenizer} has more tokens than the model's vocab_size={m.vocab_size}: "
                                    f"not this model's tokenizer")
            files = write_hf(tmp, m, run.shapes, run.read, dtype, tokenizer, moe,
                             max_shard_bytes=int(args.max_shard_gb * 1e9))  # one parameter at a time
    params = sum(math.prod(shape) for shape in run.shapes.values())
    merged = f" (LoRA r={lora.rank} on {','.join(lora.targets)} merged in)" if lora else ""
    print(f"hpctrain export: {run.dir} (step {run.step}) -> {os.path.abspath(args.out)}: a {hf_model_type(m, moe)} "
          f"model{merged}, {', '.join(files)}; "
          f"{params:,} parameters in {dtype}" + ("" if tokenizer else "; no tokenizer (byte-level ids 0..255)"))
    return 0


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
            m, moe, dtype = source.model, source.moe, source.dtype
            tensors = {name: source.read(name) for name in source.shapes}
        finally:
            source.close()
        cfg = Config(model=m, moe=source.moe_section)  # a Mixtral's experts: [moe]
        sections = "these sections" if moe else "this section"
        cfg.train.dtype, cfg.train.seq_len = dtype, import_seq_len(m)
        tokenizer = os.path.join(args.hf_dir, "tokenizer.json")
        if os.path.isfile(tokenizer):
            shutil.copyfile(tokenizer, os.path.join(tmp, "tokenizer.json"))
            cfg.data.tokenizer = os.path.join(out, "tokenizer.json")
        write_weights_only(tmp, cfg, tensors, dtype, os.path.abspath(args.hf_dir))
        with open(os.path.join(tmp, "model.toml"), "w", encoding="utf-8") as f:
            f.write(f"# the model of {os.path.abspath(args.hf_dir)}: put {sections} in the training config\n"
                    + window_note(m) + model_toml(m, source.moe_section))
    params = sum(t.numel() for t in tensors.values())
    tok = f"; its tokenizer: data.tokenizer={cfg.data.tokenizer}" if cfg.data.tokenizer != "bytes" else ""
    print(f"hpctrain import-hf: {os.path.abspath(args.hf_dir)} -> {out}/step-00000000 (weights only, step 0): "
          f"{params:,} parameters in {dtype}; tensor-parallel sizes that split it: "
          f"{', '.join(map(str, supported_tp(m, moe)))}\n"
          f"Its [model]{' and [moe] sections are' if moe else ' section is'} in {out}/model.toml{tok}. "
          f"{window_note(m, comment='')}Train from it with\n"
          f"  hpctrain train --config CONFIG model.init_from={out}   (any layout; a resumed run ignores it)\n"
          f"  or --resume {out}")
    return 0
