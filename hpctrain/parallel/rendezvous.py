"""A strict-rendezvous deadlock check for point-to-point plans (pure Python: no torch, no MPI).

A plan is, per rank, the list of posts it issues, each post a list of operations
``("send" | "recv", peer rank, tag)`` that the rank posts together and waits for before it issues the next.
The model is the strictest a library may apply: a send completes only once its receive is posted (MPI may
buffer small sends, which can only help), and the messages between two ranks match in the order posted
whatever their tag (NCCL's model: it has no tags); the tags must agree too. ``schedules.simulate`` applies
the same model to pipeline schedules; ``cp_comm.ring_plan`` is checked with this one.
"""
from __future__ import annotations

import collections


def _keyed(plans) -> list[list[dict]]:
    """Per rank, per post: {(src, dst, n-th message between them, kind): tag}."""
    keyed = []
    for rank, plan in enumerate(plans):
        count: collections.Counter[tuple] = collections.Counter()
        posts = []
        for post in plan:
            ops = {}
            for kind, peer, tag in post:
                pair = (rank, peer) if kind == "send" else (peer, rank)
                ops[pair + (count[pair + (kind,)], kind)] = tag
                count[pair + (kind,)] += 1
            posts.append(ops)
        keyed.append(posts)
    return keyed


def strict_rendezvous_completes(plans) -> bool:
    """Whether every rank's posts complete under the strict model (True: the plan cannot deadlock)."""
    keyed = _keyed(plans)
    pos = [0] * len(plans)

    def matched(op, tag) -> bool:
        src, dst, n, kind = op
        peer, twin = (dst, "recv") if kind == "send" else (src, "send")
        return any(post.get((src, dst, n, twin)) == tag for post in keyed[peer][:pos[peer] + 1])

    progressed = True
    while progressed:
        progressed = False
        for rank, posts in enumerate(keyed):
            if pos[rank] < len(posts) and all(matched(op, tag) for op, tag in posts[pos[rank]].items()):
                pos[rank] += 1
                progressed = True
    return all(p == len(posts) for p, posts in zip(pos, keyed))
