"""The rules of a parallel layout: sizes, model and batch in, a clear error out (pure arithmetic).

One place for every rule about dp x pp x cp x tp, micro-batches, stages and context parallelism; ``Layout`` (``layout.py``)
applies them to a run's configuration, and ``validate`` (``validation.py``) applies the stage
rules, which need no world size, when the configuration is loaded. No config, no mpi4py, no torch:
the functions take numbers and a resolved ``ModelConfig``-like object (tests/unit/test_layout.py).

Rules, in the order ``Layout.validate`` checks them (each raises the message users see; ``GridError``
for the factorisation of the world, ``LayoutError`` for the rest):
  sizes: tp, pp, cp >= 1; dp >= 0; dp * pp * cp * tp == world (dp = 0 derives it; world divisible by
         tp * pp * cp)
  schedule: virtual_stages > 1 only with interleaved and zb-v; interleaved: virtual_stages >= 2, pp >= 2,
         pp * virtual_stages <= n_layers, micro-batches a multiple of pp; zb-h1 (V = 1) and zb-v
         (virtual_stages = 2, 2 pp <= n_layers): pp >= 2, micro-batches >= pp
  model: n_heads, n_kv_heads, d_ff divisible by tp (the vocabulary is padded: ``padded_vocab``);
         pp <= n_layers;
         stage_layers (if given) has pp (x virtual_stages) entries >= 1 summing to n_layers
  micro-batches: train.micro_batch_size > 0 derives them (``resolve_microbatches``): global_batch divisible
         by dp x micro_batch_size, parallel.microbatches left at 1 or equal to the derived count
  batch: global_batch divisible by dp; the replica batch divisible by micro-batches;
         with sequence parallelism, seq_len (/ cp) divisible by tp
  context: seq_len divisible by 2 x cp (the zig-zag stripes); model.attention_window <= seq_len
"""
from __future__ import annotations

from hpctrain.errors import GridError, HpcTrainError


class LayoutError(HpcTrainError):
    """The model, batch or stage split does not fit the layout (the same on every rank)."""

    everywhere = True


def resolve_sizes(world_size: int, dp: int = 0, pp: int = 1, tp: int = 1, cp: int = 1) -> dict[str, int]:
    """Validate the requested factorisation; ``dp=0`` means world_size / (pp*cp*tp). Raises GridError.
    Returns {"dp", "pp", "cp", "tp"} (outermost to innermost)."""
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(value, int) or value < 1:
            raise GridError(f"parallel.{name} must be a positive integer, got {value!r}")
    if not isinstance(dp, int) or dp < 0:
        raise GridError(f"parallel.dp must be a positive integer (or 0 for world/(tp*pp)), got {dp!r}")
    names, values = ("tp*pp", f"{tp}*{pp}") if cp == 1 else ("tp*pp*cp", f"{tp}*{pp}*{cp}")
    model = tp * pp * cp
    if dp == 0:
        if world_size % model:
            keys = " x ".join(f"parallel.{a}" for a in names.split("*"))
            raise GridError(f"world size {world_size} is not divisible by {names} = {values} = {model} ({keys}); "
                            f"launch a multiple of {model} ranks or change {names.replace('*', '/')}")
        dp = world_size // model
    if dp * model != world_size:
        names = "dp*pp*tp" if cp == 1 else "dp*pp*cp*tp"
        product = f"{names} = {dp}*{pp}*{tp}" if cp == 1 else f"{names} = {dp}*{pp}*{cp}*{tp}"
        keys = " x ".join(f"parallel.{a}" for a in names.split("*"))
        raise GridError(f"{product} = {dp * model} but the job has {world_size} ranks ({keys}); "
                        f"launch {dp * model} ranks or set parallel.dp=0 to derive dp")
    return {"dp": dp, "pp": pp, "cp": cp, "tp": tp}


def padded_vocab(m, tp_size: int) -> int:
    """Rows of the embedding and LM head over all tp ranks: ``model.vocab_size`` rounded up to a multiple
    of ``model.vocab_multiple * tp`` (Megatron's ``make_vocab_size_divisible_by``), so every tp rank holds
    the same number of rows, a multiple of ``vocab_multiple``. The rows past ``vocab_size`` are padding:
    zero, never trained, never saved, masked out of every softmax (docs/parallelism.md)."""
    step = m.vocab_multiple * tp_size
    return -(-m.vocab_size // step) * step


def check_tp_divisibility(m, tp_size: int) -> None:
    """Raise a clear error when the model ``m`` (a resolved ModelConfig) cannot be split over tp (the
    vocabulary always can: it is padded to ``padded_vocab``)."""
    for what, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads), ("model.d_ff", m.d_ff)):
        if value % tp_size:
            raise LayoutError(f"{what}={value} is not divisible by parallel.tp={tp_size}: attention heads, "
                                f"KV heads and the MLP are split over tp; choose tp dividing it")


ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zb-v")  # hpctrain/parallel/zero_bubble.py (the same names)


def check_schedule(m, schedule: str, pp_size: int, virtual_stages: int, microbatches: int) -> None:
    """Interleaved 1F1B: V >= 2 virtual stages per pp rank, pp >= 2, every virtual stage a layer, micro-batches
    a multiple of pp (Megatron's rule: they run through each virtual stage in groups of pp). zb-v: V = 2 (the V
    shape), zb-h1: V = 1; both pp >= 2 and micro-batches >= pp. V > 1 with no other schedule."""
    if schedule in ZERO_BUBBLE_SCHEDULES:
        _check_zero_bubble(m, schedule, pp_size, virtual_stages, microbatches)
        return
    if schedule != "interleaved":
        if virtual_stages != 1:
            raise LayoutError(f"parallel.virtual_stages={virtual_stages} needs parallel.schedule=interleaved or zb-v "
                              f"(gpipe, 1f1b and zb-h1 hold one virtual stage per pp rank; use virtual_stages=1)")
        return
    if virtual_stages < 2:
        raise LayoutError(f"parallel.schedule=interleaved needs parallel.virtual_stages >= 2 (virtual stages "
                          f"per pp rank), got {virtual_stages}")
    if pp_size < 2:
        raise LayoutError(f"parallel.schedule=interleaved needs parallel.pp >= 2, got pp={pp_size}")
    _check_layers(m, pp_size, virtual_stages)
    if microbatches % pp_size:
        raise LayoutError(f"parallel.microbatches={microbatches} must be a multiple of parallel.pp={pp_size} with "
                          f"the interleaved schedule (as Megatron requires: micro-batches go through each virtual "
                          f"stage in groups of pp)")


def _check_layers(m, pp_size: int, virtual_stages: int) -> None:
    if m.n_layers < virtual_stages * pp_size:
        raise LayoutError(f"parallel.virtual_stages={virtual_stages} is too many for the layers: model.n_layers="
                          f"{m.n_layers} < pp x virtual_stages = {pp_size * virtual_stages} (every virtual stage "
                          f"needs a layer)")


def _check_zero_bubble(m, schedule: str, pp_size: int, virtual_stages: int, microbatches: int) -> None:
    needed = 2 if schedule == "zb-v" else 1
    if virtual_stages != needed:
        shape = "two virtual stages per rank, in the V shape" if needed == 2 else "one virtual stage per pp rank"
        raise LayoutError(f"parallel.schedule={schedule} needs parallel.virtual_stages={needed} ({shape}), "
                          f"got {virtual_stages}")
    if pp_size < 2:
        raise LayoutError(f"parallel.schedule={schedule} needs parallel.pp >= 2, got pp={pp_size}")
    _check_layers(m, pp_size, virtual_stages)
    if microbatches < pp_size:
        raise LayoutError(f"parallel.schedule={schedule} needs parallel.microbatches >= parallel.pp, got "
                          f"microbatches={microbatches} < pp={pp_size}")


def check_stages(m, pp_size: int, stage_layers: list[int], virtual_stages: int = 1) -> None:
    """Every (virtual) pipeline stage needs at least one layer; explicit stage sizes must add up. With
    ``virtual_stages`` V > 1 (interleaved) ``stage_layers`` lists the V * pp virtual stages in order."""
    stages = pp_size * virtual_stages
    if stage_layers:
        if len(stage_layers) != stages or sum(stage_layers) != m.n_layers or min(stage_layers) < 1:
            what = f"pp={pp_size}" if virtual_stages == 1 else \
                f"pp x virtual_stages = {pp_size}x{virtual_stages} = {stages}"
            order = "" if virtual_stages == 1 else ", one per virtual stage v in order"
            raise LayoutError(f"parallel.stage_layers={stage_layers} must have {what} entries >= 1 "
                              f"summing to model.n_layers={m.n_layers}{order}")
    elif m.n_layers < pp_size:
        raise LayoutError(f"model.n_layers={m.n_layers} < parallel.pp={pp_size}: every stage needs a layer")


def resolve_microbatches(global_batch: int, dp_size: int, microbatches: int, micro_batch_size: int) -> int:
    """Micro-batches per replica per step. ``micro_batch_size`` (``train.micro_batch_size``, sequences per
    forward per replica; with cp each cp rank holds its 2 stripes of those sequences) 0: ``microbatches``
    (``parallel.microbatches``) as given. > 0: ``global_batch / (dp x micro_batch_size)``, which must be an
    integer; ``parallel.microbatches`` must then be left at 1 (its default) or equal that count."""
    if micro_batch_size == 0:
        return microbatches
    per_step = dp_size * micro_batch_size
    if global_batch % per_step:
        raise LayoutError(f"train.global_batch={global_batch} is not divisible by dp x train.micro_batch_size = "
                          f"{dp_size} x {micro_batch_size} = {per_step}: each of the dp replicas runs "
                          f"global_batch/dp sequences in micro-batches of micro_batch_size")
    derived = global_batch // per_step
    if microbatches not in (1, derived):
        raise LayoutError(f"parallel.microbatches={microbatches} contradicts train.micro_batch_size={micro_batch_size}"
                          f": global_batch / (dp x micro_batch_size) = {global_batch} / ({dp_size} x "
                          f"{micro_batch_size}) = {derived} micro-batches; set one of the two keys")
    return derived


def check_batch(global_batch: int, microbatches: int, seq_len: int, dp_size: int, tp_size: int,
                sequence_parallel: bool, cp_size: int = 1) -> None:
    """The global batch splits over dp replicas, then into micro-batches; SP splits the (cp rank's) sequence
    over tp."""
    if global_batch % dp_size:
        raise LayoutError(f"train.global_batch={global_batch} is not divisible by dp={dp_size}")
    if (global_batch // dp_size) % microbatches:
        raise LayoutError(f"the per-replica batch {global_batch // dp_size} (train.global_batch/dp) is not "
                            f"divisible by parallel.microbatches={microbatches}")
    if sequence_parallel and (seq_len // cp_size) % tp_size:
        what = f"train.seq_len={seq_len}" if cp_size == 1 else \
            f"each cp rank's tokens train.seq_len/cp = {seq_len}/{cp_size} = {seq_len // cp_size}"
        raise LayoutError(f"sequence parallelism needs {what} divisible by tp={tp_size}")


def check_cp_stripes(seq_len: int, cp_size: int) -> None:
    """Each cp rank holds 2 of the 2 x cp zig-zag stripes of every sequence."""
    if cp_size > 1 and seq_len % (2 * cp_size):
        raise LayoutError(f"train.seq_len={seq_len} must be divisible by 2 x parallel.cp = {2 * cp_size}: each "
                          f"cp rank holds 2 of the 2 x cp stripes of each sequence (the load-balanced zig-zag split)")


def check_context(m, seq_len: int, cp_size: int, tp_size: int = 1) -> None:
    """Context parallelism cuts every sequence into 2 x cp zig-zag stripes; a sliding window must fit the
    sequence. (The heads split over tp only, checked by ``check_tp_divisibility``: the ring keeps each tp
    rank's GQA groups whole, since n_heads / n_kv_heads is an integer.)"""
    window = getattr(m, "attention_window", 0)
    if window > seq_len:
        raise LayoutError(f"model.attention_window={window} is larger than the sequence train.seq_len={seq_len}: "
                          f"set train.seq_len >= {window} (a model's own window, e.g. an imported Mistral's "
                          f"sliding_window, is part of its function), or model.attention_window=0 for full "
                          f"causal attention")
    check_cp_stripes(seq_len, cp_size)


def tp_across_nodes(tp: int, per_node) -> str:
    """The warning (with ``parallel.strict_placement``: the error) for tp groups that span nodes."""
    return (f"tensor-parallel groups span nodes (tp={tp}, ranks per node {per_node}): every layer's "
            f"activations then cross the inter-node network twice per forward and backward, "
            f"typically 5-20x slower than intra-node; use tp <= ranks per node and a divisor of it")
