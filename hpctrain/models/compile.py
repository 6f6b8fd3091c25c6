"""``train.compile``: torch.compile of a pipeline stage's transformer blocks (regional compilation).

Each ``Block`` of a ``GPTStage`` (and the last stage's final norm) is compiled in place with
``nn.Module.compile``: the same module and parameters, the same state-dict names, so the flat-buffer views
of ``FlatParams``, checkpoints and exports see nothing new. Why blocks and not the whole stage:

- blocks of one shape share one graph (dynamo inlines ``nn.Module``s, parameters are graph inputs), so the
  compile time does not grow with the number of layers;
- a compiled region's backward is one autograd node that hands out all its gradients when it ends: per
  block, the parameters' post-accumulate-grad hooks (the bucketed dp reduction of
  hpctrain/parallel/data_parallel.py) still fire block by block, overlapped with the rest of the backward;
  one graph per stage would deliver every gradient at its very end;
- the tensor/sequence-parallel collectives (hpctrain/parallel/tp_comm.py) and ring attention (cp) are
  mpi4py calls inside autograd Functions that dynamo cannot trace: when traced they run under
  ``torch.compiler.disable`` (``tp_comm._tp_collective``, ``gpt.eager_ring_attention``; decided at call
  time by ``torch.compiler.is_compiling()``, so eager runs never import torch._dynamo), graph breaks by design, and the compiled pieces are the local compute between them (norm; q/k/v
  projections, rotary, SDPA and output projection; SwiGLU/GELU MLP; residual adds). With tp = cp = 1 a
  block is one graph without a break; with tp > 1 each collective splits it (4 per block);
- with ``train.fp8`` each float8 linear (hpctrain/parallel/fp8.py ``fp8_linear``: torchao's tensor subclass,
  amax all-reduces over tp) runs eagerly the same way: a graph break per linear;
- with ``train.recompute`` the compiled block runs under ``torch.utils.checkpoint``.

The last stage's head and loss, with ``model.fused_head_loss`` (the default), run as fixed-shape chunks, each
chunk's local work compiled (hpctrain/parallel/head_chunks.py ``ChunkKernels``: at tp = 1 one compiled call a
chunk, under tp two around the all-gather of each token's statistics), never [tokens, vocab] logits; the final
norm is compiled as a module. With ``model.fused_head_loss = false`` the tail, final norm, LM head and loss
(``GPTStage.tail_loss``), is one compiled region (the plain head and cross-entropy, which inductor fuses), as the
compiled loop of benchmarks/bench_gpu_train.py has it. Under tp that vocab-parallel cross-entropy is plain ops
between its two tp collectives (hpctrain/parallel/tensor_parallel.py), so the region breaks at the head's input
collective, the max and the all-reduce of each token's statistics, and the local parts between them (the head's
matmul, the shifted exp and its sums, the loss) are compiled. The embedding stays eager.
At dp = pp = tp = cp = 1 (``whole_stage_wanted``) the whole stage is one region instead, embedding to loss
(``whole_loss``) or, with the fused head, embedding to final norm (``hidden``) before the compiled chunks: with no
data-parallel reduction there are no per-block gradient hooks to overlap with (issue #52 item 1).

Inductor compiles its C++/Triton kernels in a pool of worker processes, ``compile_threads`` of them, by default
one per core it may use: on a node running several ranks every rank would start a pool as large as the node.
``share_compile_workers`` divides the cores among the node's ranks instead (unless
``TORCHINDUCTOR_COMPILE_THREADS`` is set).
"""
from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hpctrain.parallel.head_chunks import ChunkKernels

if TYPE_CHECKING:
    from hpctrain.models.gpt import GPTStage


def compile_wanted(setting: str, device: torch.device) -> bool:
    """``train.compile`` ("true", "false", "auto": on for CUDA devices) for a rank computing on ``device``."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return setting == "true"


def whole_stage_wanted(layout, lora_rank: int, moe, fp8: str) -> bool:
    """Whether a run's one stage is compiled whole (``GPTStage.whole_loss``: embedding to loss, one forward and one
    backward graph, as the compiled loop of benchmarks/bench_gpu_train.py has it): dp = pp = tp = cp = 1 (no
    data-parallel reduction for per-block regions' gradient hooks to overlap, no collective inside), ZeRO <= 1,
    and nothing that runs eagerly by design inside the blocks (LoRA's dropout draws, experts, float8 linears)."""
    return (layout.dp_size == layout.pp_size == layout.tp_size == layout.cp_size == 1 and layout.zero <= 1
            and not lora_rank and moe is None and fp8 == "none")


def share_compile_workers(ranks_on_node: int, environ=None) -> int | None:
    """Give each of the ``ranks_on_node`` ranks of this node an equal share of the cores this process may use
    for inductor's compile workers (at least 1: compile in-process); returns the count set, or None where
    ``TORCHINDUCTOR_COMPILE_THREADS`` decides. Call before the first compile."""
    import os

    import torch._inductor.config as inductor_config

    from hpctrain.runtime import env

    if env.inductor_compile_threads_set(environ):
        return None

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    default = inductor_config.compile_threads or cores
    threads = max(1, min(default, cores // max(1, ranks_on_node)))
    inductor_config.compile_threads = threads
    return threads


def compile_stage(stage: GPTStage, whole: bool = False) -> int:
    """Compile every block (and the final norm) of a GPTStage in place, lazily (on the first call); returns
    the number of modules compiled. ``whole`` (``whole_stage_wanted``): the stage's ``whole_loss`` instead, one
    region (its blocks, used whole, are not compiled apart; ``forward`` alone, e.g. generation, runs eagerly).
    Random ops (LoRA's dropout) draw from torch's generator as in eager (inductor's ``fallback_random``), not
    from inductor's own Philox streams: the same masks, so compiled equals eager and a resumed run redraws what
    it would have drawn."""
    targets = list(stage.layers.values())
    options: dict[str, str | int | bool | Callable[..., Any]] = {"fallback_random": True}
    last = getattr(stage, "is_last", False)
    tail = last and tail_compilable(stage)  # the head and loss compiled (else the final norm alone)
    fused = tail and stage.fused_loss  # the fused head's chunks compiled
    if fused:
        stage.head_chunks = ChunkKernels(options)
    if whole and getattr(stage, "is_first", False) and tail:
        if fused:
            stage.compiled_hidden = torch.compile(stage.hidden, options=options)
        else:
            stage.compiled_whole = torch.compile(stage.whole_loss, options=options)
        return 1 + fused
    if tail and not fused:
        stage.compiled_tail = torch.compile(stage.tail_loss, options=options)
    elif last:
        targets.append(stage.norm)
    for module in targets:
        module.compile(options=options)
    return len(targets) + (stage.compiled_tail is not None) + fused


def tail_compilable(stage: GPTStage) -> bool:
    """Whether the last stage's tail (final norm, LM head, loss: ``GPTStage.tail_loss``) is one compiled region
    (under tp broken at its collectives): without LoRA on the head (whose dropout draws in eager)."""
    return getattr(stage.head, "lora", None) is None


def compile_stages(stages, whole: bool = False, ranks_on_node: int = 1) -> dict:
    """``compile_stage`` on each of this rank's stage modules (one per virtual stage; ``whole``: see
    ``whole_stage_wanted``), with the node's cores shared among its ``ranks_on_node`` ranks'
    compile workers; returns the ``dynamo_counts`` reading taken before (what ``compile_report`` counts from)."""
    share_compile_workers(ranks_on_node)
    since = dynamo_counts()
    for stage in stages:
        compile_stage(stage, whole)
    return since


def dynamo_counts() -> dict:
    """A reading of this process's torch.compile counters: {"graphs", "frames", "breaks": {reason: count}}."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["ok"],
            "breaks": dict(counters["graph_break"])}


def compile_report(since: dict, top: int = 5) -> list[str]:
    """Lines describing what torch.compile did after the reading ``since`` (``dynamo_counts``): graphs
    compiled, graph breaks and their most frequent reasons."""
    now = dynamo_counts()
    seen = collections.Counter(now["breaks"])
    seen.subtract(since["breaks"])
    breaks: collections.Counter[str] = collections.Counter()
    for reason, count in (+seen).items():  # only the reasons seen since
        breaks[_break_kind(str(reason))] += count
    lines = [f"torch.compile: {now['graphs'] - since['graphs']} graph(s) compiled, {sum(breaks.values())} "
             f"graph break(s)"]
    lines += [f"  {count} x {reason}" for reason, count in breaks.most_common(top)]
    return lines


def _break_kind(reason: str) -> str:
    """A graph break's reason in one line: the tp/cp collectives' and ZeRO-3 gathers' breaks by design (``torch.compiler.disable``,
    hpctrain/parallel/tp_comm.py, ``eager_ring_attention``), else dynamo's explanation without its hints."""
    if "ZeRO-3" in reason:  # hpctrain/parallel/zero/gather.py's hooks, at each unit's edge
        return "a ZeRO-3 parameter gather run eagerly (by design: torch.compiler.disable)"
    if "torch.compiler.disable" in reason or "function `disable`" in reason:
        return "a tp/cp collective or ZeRO-3 gather run eagerly (by design: torch.compiler.disable)"
    return " ".join(reason.split()).split(" Hint:")[0][:240]
