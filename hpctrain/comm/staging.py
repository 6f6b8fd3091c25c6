"""The start-up warning of a CUDA run whose device collectives are staged through host memory
(hpctrain/comm/backends/staged.py: CuPy missing, NCCL unavailable, ranks sharing a GPU, or
``parallel.backend='mpi'``): its cause and its cost per step, the bytes each rank copies device -> host and back
(every copy to the host a synchronous one that stalls the step).

The cost is an estimate from the layout, per rank and step, of the groups wider than one rank:

- dp (and dp x cp): the flat fp32 main gradients, once per step;
- tp: 4 collectives of the local activations [S/cp, B, D] per block and micro-batch (2 forward, 2 backward);
- pp: a micro-batch's activations [S/cp, B, D] out and its gradient back;

each staged twice (to the host and back). Ring attention's (cp) exchanges are not counted.
"""
from __future__ import annotations


def staged_bytes(sizes: dict[str, int], *, grad_params: int, local_layers: int, tokens: int, d_model: int,
                 act_bytes: int, microbatches: int) -> dict[str, int]:
    """{axis: bytes per step through host memory} for the axes wider than one rank. ``sizes``: the grid's
    {axis: size}; ``grad_params``: this rank's trainable parameters; ``tokens``: a micro-batch's tokens on this
    rank (B x S / cp); ``act_bytes``: bytes of one activation element."""
    act = tokens * d_model * act_bytes  # one [S/cp, B, D] activation
    cost = {"dp": 2 * 4 * grad_params,
            "tp": 2 * 4 * local_layers * act * microbatches,
            "pp": 2 * 2 * act * microbatches}
    return {axis: value for axis, value in cost.items() if sizes.get(axis, 1) > 1}


def staging_warning(backends: dict[str, str], causes: dict[str, str], cost: dict[str, int]) -> str:
    """One warning line when a group with traffic (``cost``: ``staged_bytes``) stages CUDA tensors through host
    memory (``backends`` {axis: backend name}, ``causes`` {axis: why}); "" when none does."""
    staged = [axis for axis in cost if backends.get(axis) == "mpi-staged"]
    if not staged:
        return ""
    total = sum(cost[axis] for axis in staged)
    cause = next((causes[axis] for axis in staged if causes.get(axis)), "NCCL not chosen")
    parts = ", ".join(f"{axis} {_size(cost[axis])}" for axis in staged)
    return (f"GPU collectives of {'/'.join(staged)} are staged through host memory (backend mpi-staged: {cause}): "
            f"about {_size(total)} per step per rank copied device -> host and back ({parts}), each "
            f"device -> host copy synchronous, stalling the step; install CuPy with NCCL (pip install "
            f"cupy-cuda12x) and give each rank its own GPU for the NCCL backend")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"
