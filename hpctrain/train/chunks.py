"""A pipeline rank's model chunks: which layers of the GPT each virtual stage holds."""
from __future__ import annotations

from hpctrain.models.gpt import GPTStage, partition_layers


def build_chunks(m, layout, pp_rank: int, tp_comm, dtype, seed: int, recompute: bool,
                 cp_comm=None, lora=None) -> list[GPTStage]:
    """The model chunks of pp rank ``pp_rank``: chunk c is virtual stage v = c * pp + pp_rank of the
    pp x V virtual stages (V = ``layout.virtual_stages``), whose layers ``partition_layers`` balances over
    them (or ``stage_layers`` gives, one entry per virtual stage). The embedding is on v = 0, the norm and
    LM head on the last; a tied embedding's copy lives there (its grad is summed over pp with rank 0's).
    ``lora``: the ``[lora]`` section (rank > 0: adapters, the rest frozen)."""
    pp, chunks = layout.pp_size, layout.virtual_stages
    ranges = partition_layers(m, pp * chunks, list(layout.stage_layers))
    out = []
    for c in range(chunks):
        v = c * pp + pp_rank
        out.append(GPTStage(m, ranges[v], is_first=v == 0, is_last=v == pp * chunks - 1, tp_comm=tp_comm,
                            sp=layout.sequence_parallel, dtype=dtype, seed=seed, recompute=recompute,
                            cp_comm=cp_comm, lora=lora))
    return out
