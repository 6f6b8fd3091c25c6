"""``hpctrain plan``: rank the layouts of a model on a machine by predicted tokens/s (no MPI, one process).

    hpctrain plan --model gpt-1t --nodes 384 --gpus-per-node 8 --device a100 --intra-gbps 2400 --inter-gbps 200
    hpctrain plan --model configs/tiny.toml --nodes 1 --gpus-per-node 4 --profile link.json --json
    hpctrain plan --model llama-3-8b --seq-len 131072 --nodes 2 --gpus-per-node 8 --device h100 --inter-gbps 400
    hpctrain plan --set model.preset=mixtral-8x7b --nodes 2 --gpus-per-node 8 --device h100 --inter-gbps 400

``--model`` (or ``--config``) is a preset name (``hpctrain.config.PRESETS``) or a TOML config (its model, seq_len,
global batch, dtype and schedule are the defaults of the flags; the keys its ``[parallel]`` section sets
and its ``train.micro_batch_size`` fix those choices, like the flags ``--dp/--tp/--pp/--cp/--micro-batch/--zero``:
a GIVEN layout is evaluated instead of searched; its ``parallel.zero_prefetch`` and
``parallel.zero_reshard_after_forward`` are the defaults of ``--zero-prefetch`` / ``--zero-reshard-after-forward``).
``--micro-batch`` and ``train.micro_batch_size`` are the same notion: sequences per forward per replica.
Planning is in bfloat16 unless ``--dtype`` or the TOML's ``train.dtype`` says otherwise. Links come from a
measured profile
(``hpctrain bench comm --profile``) or from ``--intra-gbps`` / ``--inter-gbps`` (Gbit/s per rank).
Context parallelism (``--cp``; searched unless ``--dp/--tp/--pp`` give a layout, which then has cp 1)
cuts each sequence over cp ranks; a RoPE model may be planned past its ``max_seq_len`` (a context
extension). ``--set section.key=value`` (repeatable) overrides a key of the preset's or the TOML's
configuration as ``hpctrain train`` does (``--set model.preset=NAME`` may stand for ``--model NAME``); the
``[parallel]`` and ``train`` keys it sets are given like a TOML's. A mixture of experts (a preset with
experts, or ``--set moe.num_experts=...``) is searched over expert parallelism as well (``--ep`` or
``parallel.ep`` fixes it). ``--json`` prints ``{"plans": [...], "infeasible": [...]}``, best first (cli
fields: planner.Prediction.to_dict).
"""
from __future__ import annotations

import json
import os
import tomllib



def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="rank the dp x cp x tp x pp layouts of a model on a machine by predicted "
                                    "tokens/s (the performance and memory model, hpctrain/plan)")
    p.add_argument("--model", "--config", default="",
                   help="a model preset (e.g. gpt-1t, gpt3-175b, tiny) or a TOML config (--config: the same flag)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a configuration key of the preset or TOML (repeatable), e.g. "
                        "model.preset=mixtral-8x7b, moe.num_experts=16, parallel.ep=8, train.global_batch=1024")
    p.add_argument("--nodes", type=int, default=0)
    p.add_argument("--gpus-per-node", type=int, default=0, help="ranks per node")
    p.add_argument("--validate", choices=("published", "ptdp"), default="",
                   help="print the model against published runs instead of planning: published (held-out and "
                        "calibration runs, hpctrain/plan/published.py) or ptdp (Megatron-LM PTD-P Table 1)")
    p.add_argument("--profile", default="", help="link profile JSON from `hpctrain bench comm --profile`")
    p.add_argument("--device", default="", help="device preset: a100, h100, h200, mi250x, mi250x-gcd, v100, cpu "
                                                "(default: the profile's, else a100)")
    p.add_argument("--intra-gbps", type=float, default=0.0,
                   help="per-rank bandwidth inside a node, Gbit/s (default: the device's NVLink figure)")
    p.add_argument("--inter-gbps", type=float, default=0.0, help="per-rank bandwidth between nodes, Gbit/s")
    p.add_argument("--global-batch", type=int, default=0, help="sequences per step (default: the config's, else 512)")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default: config's, else 2048)")
    p.add_argument("--ring", choices=("engine", "fused"), default="engine",
                   help="ring attention's blocks with cp: engine (hpctrain's: unfused, float32) or fused (a "
                        "flash-style kernel per block in the training dtype, as TransformerEngine's)")
    p.add_argument("--attention-window", type=int, default=-1,
                   help="sliding-window attention W (model.attention_window; 0 = full causal; default: the "
                        "config's, else 0)")
    p.add_argument("--dtype", default="", help="bfloat16 (default for presets), float16, float32, float64")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="override the device's peak (TFLOP/s)")
    p.add_argument("--efficiency", type=float, default=0.0, help="override the device's matmul efficiency")
    p.add_argument("--memory-gib", type=float, default=0.0, help="override the device's memory (GiB)")
    p.add_argument("--dp", type=int, default=0, help="evaluate this data-parallel size only (default: search)")
    p.add_argument("--tp", type=int, default=0, help="evaluate this tensor-parallel size only (default: search)")
    p.add_argument("--pp", type=int, default=0, help="evaluate this pipeline-parallel size only (default: search)")
    p.add_argument("--cp", type=int, default=0,
                   help="evaluate this context-parallel size only (default: search every cp with --seq-len "
                        "divisible by 2 x cp, or 1 when --dp/--tp/--pp give the layout; 1: no context parallelism)")
    p.add_argument("--ep", type=int, default=0,
                   help="evaluate this expert-parallel size only (a mixture of experts; default: the config's "
                        "parallel.ep when it sets it, else search every ep dividing dp x cp and moe.num_experts)")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="sequences per micro-batch, per forward on each replica (train.micro_batch_size; "
                        "Megatron's --micro-batch-size; default: the config's, else search)")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="model chunks per pipeline rank (interleaved 1F1B; default 1)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage (parallel.zero; default: try 0 to 3 with dp x cp > 1): 1 shards the optimizer "
                        "state, 2 the gradients too, 3 the parameters too (gathered unit by unit)")
    p.add_argument("--no-zero", action="store_true", help="do not consider ZeRO (zero 0 only)")
    p.add_argument("--allow-tp-across-nodes", action="store_true",
                   help="also search tp groups that span nodes (tp not dividing --gpus-per-node): by default tp stays "
                        "inside a node, as Megatron-LM advises, since every layer's collectives would cross the network")
    p.add_argument("--zero-prefetch", type=int, default=None,
                   help="ZeRO-3: units whose all-gather is posted ahead (parallel.zero_prefetch; default: the "
                        "config's, else 1)")
    p.add_argument("--zero-reshard-after-forward", choices=("true", "false"), default=None,
                   help="ZeRO-3: free a unit after its forward and gather it again for its backward "
                        "(parallel.zero_reshard_after_forward; default: the config's, else true)")
    p.add_argument("--sequence-parallel", action="store_true", help="always use sequence parallelism (tp > 1)")
    p.add_argument("--no-sequence-parallel", action="store_true", help="do not consider sequence parallelism")
    p.add_argument("--attention", choices=("fused", "unfused"), default="fused",
                   help="fused: a flash-style kernel (hpctrain's); unfused: the full score matrix stored "
                        "(Megatron's attention of the PTD-P runs)")
    p.add_argument("--recompute", choices=("auto", "on", "full", "selective", "off"), default="auto",
                   help="activation recomputation: try each (auto), full (= on: every block's forward again), "
                        "selective (Korthikanti et al.: only the attention core; with --attention fused the same "
                        "as off), off")
    p.add_argument("--schedule", choices=("1f1b", "gpipe", "zb-h1", "zb-v"), default="",
                   help="pipeline schedule (default 1f1b; zb-v: two virtual stages per rank in the V shape, so "
                        "--virtual-stages stays 1)")
    p.add_argument("--compression", default="",
                   help="gradient compression of the dp reduction (compression.method: none, fp16, bf16, int8, "
                        "zfp, onebit, onebit-adam; default: the config's, else none; hpctrain/plan/compressed.py)")
    p.add_argument("--compression-warmup", type=int, default=-1,
                   help="onebit-adam: dense steps before compression (default: the config's "
                        "compression.warmup_steps)")
    p.add_argument("--steps", type=int, default=0,
                   help="the run's steps, for onebit-adam's mean step with its dense warm-up (default: the "
                        "config's train.steps)")
    p.add_argument("--top", type=int, default=5, help="plans to show (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run_plan)


GIVEN_PARALLEL = ("dp", "tp", "pp", "cp", "microbatches", "zero", "sequence_parallel", "ep")


def _set_keys(overrides) -> dict[str, set[str]]:
    """{section: keys} that ``--set`` overrides name (their values are read from the configuration)."""
    named: dict[str, set[str]] = {}
    for item in overrides:
        section, _, key = item.partition("=")[0].strip().lstrip("-").partition(".")
        named.setdefault(section, set()).add(key)
    return named


def _given(cfg, named: dict[str, set[str]]) -> dict:
    """The layout choices a configuration fixes: the ``[parallel]`` keys it sets (``named``) that are not 0,
    and ``train.micro_batch_size``."""
    given = {k: getattr(cfg.parallel, k) for k in GIVEN_PARALLEL
             if k in named.get("parallel", set()) and getattr(cfg.parallel, k) != 0}
    if cfg.train.micro_batch_size:  # sequences per forward: the planner's micro_batch
        given["micro_batch"] = cfg.train.micro_batch_size
        if given.get("microbatches") == 1:  # its default: train.micro_batch_size derives the count
            del given["microbatches"]
    return given


def _run_keys(cfg) -> dict:
    """The defaults of the flags that a configuration's schedule, buckets, ZeRO-3 and compression keys give."""
    p, c = cfg.parallel, cfg.compression
    return {"schedule": p.schedule, "bucket_mb": p.bucket_mb, "zero_prefetch": p.zero_prefetch,
            "zero_reshard_after_forward": p.zero_reshard_after_forward, "compression": c.method,
            "warmup_steps": c.warmup_steps, "zfp_rate": c.zfp_rate, "lora_rank": cfg.lora.rank,
            "lora_targets": tuple(cfg.lora.targets)}


def _model_and_defaults(spec: str, overrides=()):
    """(resolved ModelConfig, resolved MoeConfig or None, defaults dict) for a preset name or a TOML path
    (empty: the preset of ``--set model.preset=NAME``), with the ``--set`` ``overrides`` applied."""
    from hpctrain.config import PRESETS, Config, ModelConfig, apply_overrides, load_config, resolve_model, validate
    from hpctrain.config.moe_keys import resolve_moe
    from hpctrain.plan.devices import PlanError

    named = _set_keys(overrides)
    if not spec and "preset" in named.get("model", set()):
        spec = apply_overrides(Config(), overrides).model.preset
    if spec in PRESETS or spec == "custom":
        cfg = apply_overrides(Config(model=ModelConfig(preset=spec, vocab_size=0)), overrides)
        validate(cfg)
        model = resolve_model(cfg.model)
        train = named.get("train", set())
        return model, resolve_moe(cfg.moe, model), {
            "global_batch": cfg.train.global_batch if "global_batch" in train else 512,
            "seq_len": cfg.train.seq_len if "seq_len" in train else min(2048, model.max_seq_len),
            "dtype": cfg.train.dtype if "dtype" in train else "bfloat16",
            "steps": cfg.train.steps if "steps" in train else 0, "given": _given(cfg, named), **_run_keys(cfg)}
    if spec.endswith(".toml") or os.path.exists(spec):
        if not os.path.isfile(spec):
            raise PlanError(f"--model {spec}: no such config file")
        cfg = load_config(spec, overrides)
        with open(spec, "rb") as f:
            raw = tomllib.load(f)  # which keys the file SETS: those are given, the rest searched
        for section in ("parallel", "train"):
            named.setdefault(section, set()).update(raw.get(section, {}))
        model = resolve_model(cfg.model)
        return model, resolve_moe(cfg.moe, model), {
            "global_batch": cfg.train.global_batch, "seq_len": cfg.train.seq_len,
            "dtype": cfg.train.dtype if "dtype" in named["train"] else "bfloat16",
            "given": _given(cfg, named), "steps": cfg.train.steps, **_run_keys(cfg),
            "virtual_stages": int(raw.get("parallel", {}).get("virtual_stages", 1))}
    if not spec:
        raise PlanError("give --model (a preset or a TOML config) or --set model.preset=NAME")
    raise PlanError(f"--model {spec!r}: neither a preset ({', '.join(PRESETS)}) nor a TOML config file")


def _long_context(model, seq_len: int, window: int):
    """``model`` for ``seq_len`` tokens with ``--attention-window`` (< 0: the model's own). A RoPE model is
    planned past its ``max_seq_len`` as a context extension (training it with ``model.max_seq_len =
    seq_len``, as Llama 3.1 extends Llama 3 to 128K); a learned position table has no rows past it."""
    from dataclasses import replace

    from hpctrain.plan.devices import PlanError

    if window >= 0:
        model = replace(model, attention_window=window)
    if model.attention_window > seq_len:
        raise PlanError(f"--attention-window {model.attention_window} is larger than --seq-len {seq_len}: a window "
                        f"covering the whole sequence is full causal attention, use 0")
    if seq_len > model.max_seq_len:
        if getattr(model, "positions", "rope") == "learned":
            raise PlanError(f"--seq-len {seq_len} exceeds the model's max_seq_len {model.max_seq_len} (its learned "
                            f"position table has no rows past it)")
        model = replace(model, max_seq_len=seq_len)
    return model


def _machine(args):
    from hpctrain.plan.devices import PlanError, device_preset, with_overrides
    from hpctrain.plan.machine import Machine, device_from_profile, links_from_bandwidth, load_profile

    overrides = (args.peak_tflops, args.memory_gib, args.efficiency)
    if args.profile:
        links = load_profile(args.profile)
        dev = with_overrides(device_from_profile(links, args.device, args.gpus_per_node), *overrides)
    else:
        dev = device_preset(args.device or "a100", *overrides)
        if args.nodes > 1 and not args.inter_gbps:
            raise PlanError(f"{args.nodes} nodes: give --inter-gbps (per-rank bandwidth between nodes, Gbit/s; "
                            f"e.g. 200 for one HDR InfiniBand NIC per GPU) or a measured --profile")
        links = links_from_bandwidth(args.intra_gbps or dev.intra_gbps, args.inter_gbps or None)
    return Machine(dev, links, args.nodes, args.gpus_per_node)


def _space(args, given: dict, schedule: str, devices: int):
    """The search space: the flags, then the keys a TOML's [parallel] section sets, else everything."""
    from hpctrain.plan.devices import PlanError
    from hpctrain.plan.planner import SearchSpace

    def pick(flag, key):
        return flag if flag else given.get(key, 0)
    dp, tp, pp, cp = pick(args.dp, "dp"), pick(args.tp, "tp"), pick(args.pp, "pp"), pick(args.cp, "cp")
    cp = cp or (1 if dp or tp or pp else 0)  # a given layout has no cp unless it says so
    ep = pick(args.ep, "ep")
    micro_batch = args.micro_batch or given.get("micro_batch", 0)
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("micro-batch", micro_batch)):
        if value < 0 or (value and name != "micro-batch" and devices % value):
            raise PlanError(f"--{name} {value}: must be a positive divisor of the {devices} devices")
    zero = (args.zero,) if args.zero is not None else (given["zero"],) if "zero" in given else \
        (0,) if args.no_zero else (0, 1, 2, 3)
    sp = (True,) if args.sequence_parallel else (False,) if args.no_sequence_parallel else \
        (bool(given["sequence_parallel"]),) if "sequence_parallel" in given else (False, True)
    microbatches = (given["microbatches"],) if "microbatches" in given and not micro_batch else ()
    return SearchSpace(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch=micro_batch, microbatches=microbatches, zero=zero,
                       sequence_parallel=sp, schedule=schedule, tp_across_nodes=args.allow_tp_across_nodes,
                       recompute={"auto": ("off", "selective", "full"), "on": ("full",)}.get(args.recompute,
                                                                                          (args.recompute,)))


def run_plan(args) -> int:
    from hpctrain.plan.cost import Options
    from hpctrain.plan.devices import PlanError
    from hpctrain.plan.planner import plan

    if args.validate:
        from hpctrain.plan import ptdp, validate

        (validate.main if args.validate == "published" else ptdp.main)()
        return 0
    if not (args.model or args.overrides) or args.nodes < 1 or args.gpus_per_node < 1:
        raise PlanError("give --model, --nodes and --gpus-per-node (>= 1), or --validate published|ptdp")
    model, moe, defaults = _model_and_defaults(args.model, args.overrides)
    for flag, value in (("--global-batch", args.global_batch), ("--seq-len", args.seq_len), ("--top", args.top - 1)):
        if value < 0:
            raise PlanError(f"{flag} must be >= 1")
    machine = _machine(args)
    global_batch = args.global_batch or defaults["global_batch"]
    seq_len = args.seq_len or defaults["seq_len"]
    model = _long_context(model, seq_len, args.attention_window)
    schedule = args.schedule or defaults["schedule"]
    if schedule == "interleaved":  # parallel.schedule = "interleaved": 1F1B with parallel.virtual_stages chunks
        schedule = "1f1b"
        if args.virtual_stages == 1:
            args.virtual_stages = max(2, defaults.get("virtual_stages", 2))
    if args.virtual_stages < 1 or (args.virtual_stages > 1 and schedule in ("gpipe", "zb-h1", "zb-v")):
        raise PlanError(f"--virtual-stages {args.virtual_stages}: must be >= 1, and 1 with the {schedule} schedule"
                        + (" (its two virtual stages are its V shape)" if schedule == "zb-v" else ""))
    if args.zero_prefetch is not None and args.zero_prefetch < 0:
        raise PlanError(f"--zero-prefetch {args.zero_prefetch}: must be >= 0")
    options = Options(dtype=args.dtype or defaults["dtype"], bucket_mb=defaults["bucket_mb"],
                      virtual_stages=args.virtual_stages, flash_attention=args.attention == "fused",
                      fused_ring=args.ring == "fused", compression=args.compression or defaults["compression"],
                      zfp_rate=defaults["zfp_rate"],
                      zero_prefetch=defaults["zero_prefetch"] if args.zero_prefetch is None else args.zero_prefetch,
                      zero_reshard_after_forward=defaults["zero_reshard_after_forward"]
                      if args.zero_reshard_after_forward is None else args.zero_reshard_after_forward == "true",
                      lora_rank=defaults.get("lora_rank", 0), lora_targets=defaults.get("lora_targets", ()))
    if options.lora_rank and moe is not None:
        raise PlanError(f"lora.rank={options.lora_rank} on a mixture of experts: the planner models LoRA on dense "
                        f"models only")
    space = _space(args, defaults.get("given", {}), schedule, machine.devices)
    result = plan(model, machine, global_batch, seq_len, options, space, moe)
    warmup = _onebit_adam_warmup(args, defaults, model, machine, options, result, moe)
    name = args.model or model.preset
    if args.json:
        experts = {"moe": {"num_experts": moe.num_experts, "top_k": moe.top_k, "moe_layers": len(moe.layers),
                           "d_ff_expert": moe.d_ff_expert, "shared_experts": moe.shared_experts}} if moe else {}
        print(json.dumps({"model": name, "nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
                          "device": machine.device.name, "global_batch": global_batch, "seq_len": seq_len,
                          "attention_window": model.attention_window, "ring": args.ring,
                          "dtype": options.dtype, "evaluated": result.evaluated,
                          "tp_across_nodes_skipped": result.tp_across_nodes_skipped,
                          "compression": options.compression, "set": args.overrides, **experts,
                          **({"lora": {"rank": options.lora_rank, "targets": list(options.lora_targets)}}
                             if options.lora_rank else {}),
                          "plans": [{**p.to_dict(), **warmup.get(i, {})} for i, p in enumerate(result.plans[:args.top])],
                          "infeasible": [i.to_dict() for i in result.infeasible]}, indent=1))
    else:
        from hpctrain.plan.report import print_plans

        print_plans(result, machine, model, name, global_batch, seq_len, options, args.top, moe)
        hint = _zero_bubble_hint(result, model, machine, options, moe)
        if hint:
            print(f"\n{hint}")
        if warmup:
            first = warmup[0]
            print(f"\nonebit-adam: the first {first['compression_warmup_steps']} of {first['run_steps']} steps are "
                  f"dense AdamW; the table shows the compressed steps after them")
            for i, row in warmup.items():
                print(f"{i + 1:>2} dense step {row['dense_step_s']:.3g} s, compressed {row['compressed_step_s']:.3g} s, "
                      f"run mean {row['run_mean_step_s']:.3g} s/step")
    return 0 if result.plans else 2


def _zero_bubble_hint(result, model, machine, options, moe=None) -> str:
    """A line recommending a zero-bubble schedule where the best plan is a 1F1B (or GPipe) pipeline and ZB-H1 or
    ZB-V is predicted faster on the same layout (same memory bound: both hold 1F1B's first-rank peak); "" else."""
    from dataclasses import replace

    from hpctrain.errors import HpcTrainError
    from hpctrain.plan.planner import predict

    if not result.plans:
        return ""
    best = result.plans[0]
    lay = best.candidate.layout
    if lay.pp_size < 2 or lay.schedule not in ("1f1b", "gpipe") or best.virtual_stages > 1:
        return ""
    found = []
    for schedule, v in (("zb-h1", 1), ("zb-v", 2)):
        try:
            pred = predict(model, replace(lay, schedule=schedule, virtual_stages=v), machine,
                           best.candidate.recompute, options, moe)
        except HpcTrainError:
            continue
        if pred.tokens_per_s > best.tokens_per_s and pred.memory.total_gib <= machine.memory_gib():
            found.append(f"{schedule} {pred.time.step_s:.3g} s/step ({pred.tokens_per_s / best.tokens_per_s - 1:+.0%} "
                         f"tokens/s, {pred.memory.total_gib:.1f} GiB)")
    if not found:
        return ""
    return (f"zero-bubble schedules on plan 1's layout (bubble {best.time.bubble_s:.3g} s/step with "
            f"{lay.schedule}): " + ", ".join(found) + "; parallel.schedule = \"zb-h1\" (or \"zb-v\" with "
            f"parallel.virtual_stages = 2), or hpctrain plan --schedule zb-h1")


def _onebit_adam_warmup(args, defaults: dict, model, machine, options, result, moe=None) -> dict:
    """onebit-adam: per shown plan (index -> fields), the dense warm-up step of the same layout and the run's
    mean step (compressed.warmup_average_step_s); {} for other methods."""
    from dataclasses import replace

    from hpctrain.plan.compressed import warmup_average_step_s
    from hpctrain.plan.devices import PlanError
    from hpctrain.plan.planner import predict

    if options.compression != "onebit-adam":
        return {}
    warmup = args.compression_warmup if args.compression_warmup >= 0 else defaults["warmup_steps"]
    steps = args.steps or defaults["steps"]
    if warmup < 1 or steps < 1:
        raise PlanError("--compression onebit-adam: give --compression-warmup (>= 1 dense steps) and --steps (the "
                        "run's length), or a config with compression.warmup_steps and train.steps")
    dense = replace(options, compression="none")
    rows = {}
    for i, pred in enumerate(result.plans[:args.top]):
        dense_s = predict(model, pred.candidate.layout, machine, pred.candidate.recompute, dense, moe).time.step_s
        rows[i] = {"compression_warmup_steps": warmup, "run_steps": steps, "dense_step_s": dense_s,
                   "compressed_step_s": pred.time.step_s,
                   "run_mean_step_s": warmup_average_step_s(dense_s, pred.time.step_s, warmup, steps)}
    return rows
