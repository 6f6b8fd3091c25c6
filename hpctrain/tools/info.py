"""``hpctrain info``: what the launch looks like, and the grid that hpctrain would build on it."""
from __future__ import annotations

import json
import sys

from hpctrain.comm.grid import AXES, ProcessGrid
from hpctrain.runtime.launcher import discover


def collect_info(tp: int = 1, pp: int = 1, dp: int = 0, strict: bool = False) -> tuple[dict | None, ProcessGrid]:
    """Collective: build the grid and gather every rank's record on rank 0 (None elsewhere)."""
    info = discover()
    grid = ProcessGrid.build(info, dp=dp, pp=pp, tp=tp, strict_placement=strict)
    records = grid.world.gather_object(grid.describe(), root=0)
    if info.rank != 0:
        return None, grid
    ranks_per_node = [info.node_of_rank.count(n) for n in range(info.num_nodes)]
    document = {
        "launcher": info.launcher.name,
        "mpi_library": info.mpi_library,
        "world_size": info.size,
        "nodes": info.num_nodes,
        "ranks_per_node": ranks_per_node,
        "hostnames": sorted({r["hostname"] for r in records}),
        "layout": dict(grid.sizes),
        "groups_crossing_nodes": sorted({a for r in records for a in r["crosses_nodes"]}),
        "warnings": grid.warnings,
        "ranks": records,
    }
    return document, grid


def run_info(tp: int = 1, pp: int = 1, dp: int = 0, strict: bool = False, as_json: bool = False,
             stream=sys.stdout) -> int:
    document, grid = collect_info(tp=tp, pp=pp, dp=dp, strict=strict)
    grid.close()
    if document is None:
        return 0
    if as_json:
        json.dump(document, stream, indent=1)
        stream.write("\n")
        return 0
    layout = " x ".join(f"{a}={document['layout'][a]}" for a in AXES)
    print(f"launcher: {document['launcher']}    MPI: {document['mpi_library']}", file=stream)
    print(f"world: {document['world_size']} ranks on {document['nodes']} node(s), ranks per node "
          f"{document['ranks_per_node']}    layout: {layout}", file=stream)
    if document["groups_crossing_nodes"]:
        print(f"groups crossing nodes: {', '.join(document['groups_crossing_nodes'])}", file=stream)
    header = f"{'rank':>5} {'node':>5} {'local':>5} {'dp':>3} {'pp':>3} {'tp':>3}  dp_group / pp_group / tp_group"
    print(header, file=stream)
    for r in document["ranks"]:
        print(f"{r['rank']:>5} {r['node']:>5} {r['local_rank']:>5} {r['dp']:>3} {r['pp']:>3} {r['tp']:>3}  "
              f"{r['dp_group']} / {r['pp_group']} / {r['tp_group']}", file=stream)
    return 0
