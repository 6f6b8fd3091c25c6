"""Everything that can stop a run at start-up, checked in one process before the job is launched or queued
(``hpctrain check``): the rules a run's start applies, from the same code, each problem listed.

    report = check_job(cfg, ranks=8, gpus_per_node=4, device=device_preset("h100"), resume="auto")
    report.problems   # one line each: the config's rules, the layout on 8 ranks, memory, data, the resume
    report.summary    # layout, memory per rank, tokens per step (when the layout is valid)

What runs, and what a run's start runs for the same thing:

| check                          | here                               | at a run's start                      |
|--------------------------------|------------------------------------|---------------------------------------|
| keys and the rules between them | ``validation.problems`` (all)      | ``validate`` (the first)              |
| the layout on the rank count   | ``Layout.problems_of`` (all)       | ``Layout.from_config`` (the first)    |
| memory per rank                | ``memory_check.rank_need``, every pp rank, against ``--device``'s memory | the same bound against the memory free on each rank |
| the corpus and its vocabulary  | ``load_tokens_collective(None, ..)`` + ``check_corpus`` | the same, collective       |
| a resume's model               | ``architecture.model_differences`` | the same in ``transfer.check_compatible`` |
| ``train.fp8``                  | ``parallel.fp8.torchao_problem``; float8 on ``--device`` (a warning) | ``models.fp8.check_fp8``, ``setup_fp8``'s warnings |

Tensor-parallel groups that would span nodes (tp not dividing ``--gpus-per-node``) are a warning, as at a run's
start, and a problem with ``parallel.strict_placement``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from hpctrain.checkpoint.directory import human_size
from hpctrain.config import resolve_model
from hpctrain.config.layout import Layout
from hpctrain.config.rules import tp_across_nodes
from hpctrain.config.validation import key_problems
from hpctrain.config.validation import problems as config_problems
from hpctrain.errors import HpcTrainError

GIB = 1 << 30


@dataclass
class CheckReport:
    """What ``check_job`` found: ``problems`` (one line each; none: the job can start) and ``summary`` lines."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what a run's start would warn about
    summary: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_job(cfg, ranks: int, gpus_per_node: int = 0, device=None, resume: str | None = None) -> CheckReport:
    """Check the run ``cfg`` (read, not validated: ``config.load.read_config``) on ``ranks`` ranks
    (``gpus_per_node`` > 0: ranks per node) with ``device`` (a ``plan.devices.Device``; None: no memory
    verdict) and ``resume`` ("auto", a path, "none" or None). Single process, no MPI."""
    report = CheckReport(problems=[_line(e) for e in config_problems(cfg)])
    if key_problems(cfg):  # a key out of its own range: the rules below would read it
        return report
    layout_problems = [_line(e) for e in Layout.problems_of(cfg, ranks)]
    report.problems += [line for line in layout_problems if line not in report.problems]  # said once
    if not layout_problems:
        layout = Layout.from_config(cfg, ranks)
        warnings, problems = _placement(cfg, layout, gpus_per_node)
        report.warnings += warnings
        report.problems += problems
        report.summary.append(_layout_line(cfg, layout, gpus_per_node))
        if not report.problems:  # the memory bound needs a model and a layout that hold together
            memory, problem = _memory(cfg, layout, device)
            report.summary.append(memory)
            report.problems += problem
    report.problems += _data(cfg)
    fp8_warnings, fp8_problems = _fp8(cfg.train, device)
    report.warnings += fp8_warnings
    report.problems += fp8_problems
    if resume not in (None, "none"):
        line, problem = _resume(cfg, resume)
        report.summary.append(line)
        report.problems += problem
    return report


def _line(exc: Exception) -> str:
    return str(exc).removeprefix("config: ")


def _placement(cfg, layout: Layout, gpus_per_node: int) -> tuple[list[str], list[str]]:
    """(warnings, problems) of where the tp groups land: the grid numbers tp fastest on each node
    (``comm/grid.py``), so a group spans nodes when tp does not divide the ranks per node; a run's start warns,
    or refuses with ``parallel.strict_placement``."""
    if gpus_per_node <= 0 or gpus_per_node % layout.tp_size == 0:
        return [], []
    message = tp_across_nodes(layout.tp_size, [gpus_per_node])
    return ([], [message + " (parallel.strict_placement=true)"]) if cfg.parallel.strict_placement else ([message], [])


def _layout_line(cfg, layout: Layout, gpus_per_node: int) -> str:
    nodes = f" on {layout.world_size // gpus_per_node} node(s) of {gpus_per_node}" if gpus_per_node else ""
    ep = f" x ep={layout.ep_size}" if layout.ep_size > 1 else ""
    return (f"layout: {layout.world_size} ranks{nodes}, dp={layout.dp_size} x pp={layout.pp_size} x "
            f"cp={layout.cp_size} x tp={layout.tp_size}{ep}, ZeRO-{layout.zero}, {layout.microbatches} micro-batch(es) "
            f"of {layout.micro_batch} sequence(s), {cfg.train.global_batch * cfg.train.seq_len:,} tokens per step "
            f"(train.global_batch={cfg.train.global_batch} x train.seq_len={cfg.train.seq_len})")


def _memory(cfg, layout: Layout, device) -> tuple[str, list[str]]:
    """The largest lower bound over the pipeline ranks (``memory_check.rank_need``), against ``device``."""
    from hpctrain.train.memory_check import rank_need

    needs = [rank_need(cfg, layout, r) for r in range(layout.pp_size)]
    worst = max(range(len(needs)), key=lambda r: needs[r].total)
    need = needs[worst]
    parts = ", ".join(f"{name} {human_size(size)}" for name, size in need.parts.items() if size)
    line = (f"memory: at least {human_size(need.total)} per rank on pipeline rank {worst} ({parts}; "
            f"{need.parameters:,} parameters), a lower bound: activations of more micro-batches, logits and "
            f"the framework come on top")
    capacity = getattr(device, "memory_gib", None)
    if capacity is None:
        return line + " (give --device for a verdict)", []
    line += f"; {device.name} has {capacity:g} GiB"
    if need.total > capacity * GIB:
        return line, [f"the model does not fit in memory: pipeline rank {worst} needs at least "
                      f"{human_size(need.total)} ({parts}), the most for {need.largest}, but a {device.name} has "
                      f"{capacity:g} GiB; make the model or the micro-batch smaller, or spread it over more ranks "
                      f"(parallel.tp, parallel.pp, parallel.zero=1..3)"]
    return line, []


def _data(cfg) -> list[str]:
    """The corpus opens and fits the vocabulary and tokenizer: the trainer's own functions, in one process."""
    from hpctrain.data.corpus import load_tokens_collective
    from hpctrain.data.prepared import check_corpus
    from hpctrain.runtime import env

    d = cfg.data
    try:
        tokens = load_tokens_collective(None, d.source, env.cache_dir(d.cache_dir), d.max_bytes)
        check_corpus(tokens, d.tokenizer, resolve_model(cfg.model).vocab_size, d.source)
    except HpcTrainError as exc:
        return [str(exc)]
    return []


FP8_DEVICES = ("h100", "h200")  # the presets with float8 matmuls (sm89+: torch._scaled_mm)


def _fp8(t, device) -> tuple[list[str], list[str]]:
    """``train.fp8``: (warnings, problems). torchao present at the pinned version (``parallel.fp8.torchao_problem``,
    a problem, as a run's start refuses it); with ``--device`` a GPU without float8 matmuls and no
    ``train.fp8_emulate``: a warning, as at a run's start (every linear then computes in the training dtype)."""
    if t.fp8 == "none":
        return [], []
    from hpctrain.parallel.fp8 import torchao_problem

    problem = torchao_problem()
    problems = [f"train.fp8: {t.fp8!r} {problem}"] if problem else []
    warnings = []
    if device is not None and device.name not in FP8_DEVICES and not t.fp8_emulate:
        warnings.append(f"train.fp8: {t.fp8!r} needs float8 matmuls (an sm89+ GPU: {', '.join(FP8_DEVICES)}), which "
                        f"--device {device.name} has not: every linear would compute in train.dtype; "
                        f"train.fp8_emulate=true (the same casts, not a speed path) or train.fp8='none'")
    return warnings, problems


def _resume(cfg, resume: str) -> tuple[str, list[str]]:
    """The checkpoint a resume would start from, against the config's model and adapters."""
    from hpctrain.checkpoint.architecture import model_differences
    from hpctrain.checkpoint.directory import list_checkpoints, resolve_latest
    from hpctrain.checkpoint.reader import CheckpointReader

    if resume == "auto":
        directory = cfg.checkpoint.dir or os.path.join(cfg.train.run_dir, "checkpoints")
        complete = sorted((r for r in list_checkpoints(directory) if r["complete"]), key=lambda r: -r["step"])
        if not complete:
            return f"resume: {directory} holds no complete checkpoint: a fresh start (or the node-local tier)", []
        path = complete[0]["path"]
    else:
        path = resolve_latest(resume)
    try:
        reader = CheckpointReader(path)
    except (OSError, ValueError) as exc:
        return f"resume: {path}", [f"--resume {resume}: cannot open {path}: {exc}"]
    try:
        differences = model_differences(reader.attrs, cfg)
        step = reader.attrs.get("step")
    finally:
        reader.file.close()
    if differences:
        return f"resume: {path}", [f"--resume {resume}: {path} was written for another model than this config: "
                                   f"{'; '.join(differences)}"]
    return f"resume: from {path} (step {step})", []

