"""``hpctrain info``: what the launch looks like, and the grid that hpctrain would build on it."""
from __future__ import annotations

import json
import sys

from types import SimpleNamespace

from hpctrain.comm.grid import AXES, ProcessGrid
from hpctrain.comm.intra_node import RouteChoice
from hpctrain.comm.routes import CLASSES, class_text, describe, uses_shm
from hpctrain.errors import GridError, HpcTrainError
from hpctrain.config.rules import check_schedule
from hpctrain.parallel.schedules import bubble_formula, schedule_bubble
from hpctrain.runtime.launcher import discover

ROUTES = {"mpi": "MPI", "shm": "the node's shared-memory window",
          "shm-hierarchical": "shared memory on each node, MPI between nodes"}


def pipeline_report(pp: int, schedule: str = "1f1b", virtual_stages: int = 1, microbatches: int = 0) -> dict | None:
    """The pipeline's schedule and bubble (``schedule_bubble``) of the ideal step (None without a pipeline).
    ``microbatches`` 0 = pp. Raises GridError on a schedule rule (the layer rule needs a model: not here)."""
    if pp == 1:
        return None
    m = microbatches or pp
    try:
        check_schedule(SimpleNamespace(n_layers=pp * virtual_stages), schedule, pp, virtual_stages, m)
    except HpcTrainError as exc:
        raise GridError(str(exc)) from None
    return {"schedule": schedule, "virtual_stages": virtual_stages, "microbatches": m,
            "bubble": schedule_bubble(schedule, pp, m, virtual_stages)}


def routes_report(choice: RouteChoice) -> dict | None:
    """comm.intra_node=auto's table for the report: per op the route and MPI's time / shm's per size class."""
    if choice.table is None:
        return None
    return {"source": choice.source, "summary": describe(choice.table) if uses_shm(choice.table) else "mpi everywhere",
            "classes": [class_text(i) for i in range(len(CLASSES))],
            "ops": {op: [{"route": route, "shm_speedup": ratio} for _, route, ratio in rows]
                    for op, rows in choice.table.items()}}


def print_routes(routes: dict, stream) -> None:
    """The table: a row per size class, per op the route and shm's measured speed over MPI's."""
    print(f"dp routes by size (comm.intra_node=auto; {routes['source']}; shm speed / MPI speed):", file=stream)
    ops = list(routes["ops"])
    print(f"  {'size':>8} " + " ".join(f"{op:>16}" for op in ops), file=stream)
    for i, size in enumerate(routes["classes"]):
        cells = [f"{routes['ops'][op][i]['route']} {routes['ops'][op][i]['shm_speedup']:.2f}x" for op in ops]
        print(f"  {size:>8} " + " ".join(f"{c:>16}" for c in cells), file=stream)


def collect_info(tp: int = 1, pp: int = 1, dp: int = 0, strict: bool = False,
                 pipeline: dict | None = None, intra_node: str = "auto", cp: int = 1) -> tuple[dict | None, ProcessGrid]:
    """Collective: build the grid and gather every rank's record on rank 0 (None elsewhere). ``pipeline``:
    ``pipeline_report``'s, reported as is. ``intra_node``: comm.intra_node, set up as training would
    (``dp_reduction``: "shm", "shm-hierarchical" or "mpi"; "shm" that cannot run raises IntraNodeError; with
    auto on one node ``dp_routes``: its routing table per op and size class, comm/routes.py)."""
    info = discover()
    grid = ProcessGrid.build(info, dp=dp, pp=pp, tp=tp, cp=cp, strict_placement=strict)
    try:
        grid.use_intra_node(intra_node)
    except Exception:
        grid.close()
        raise
    records = grid.world.gather_object(grid.describe(), root=0)
    routes = grid.world.gather_object(grid.intra_node, root=0)
    if info.rank != 0:
        return None, grid
    assert records is not None and routes is not None  # gathered on rank 0
    ranks_per_node = [info.node_of_rank.count(n) for n in range(info.num_nodes)]
    document = {
        "launcher": info.launcher.name,
        "mpi_library": info.mpi_library,
        "world_size": info.size,
        "nodes": info.num_nodes,
        "ranks_per_node": ranks_per_node,
        "hostnames": sorted({r["hostname"] for r in records}),
        "layout": dict(grid.sizes),
        "dp_reduction": sorted(set(routes)) if len(set(routes)) > 1 else routes[0],
        "dp_routes": routes_report(grid.intra_node_routes),
        "groups_crossing_nodes": sorted({a for r in records for a in r["crosses_nodes"]}),
        "warnings": grid.warnings,
        "pipeline": pipeline,
        "ranks": records,
    }
    return document, grid


def run_info(tp: int = 1, pp: int = 1, dp: int = 0, strict: bool = False, as_json: bool = False,
             stream=None, schedule: str = "1f1b", virtual_stages: int = 1, microbatches: int = 0,
             intra_node: str = "auto", cp: int = 1) -> int:
    stream = sys.stdout if stream is None else stream  # the stream of the call, not of the import
    pipeline = pipeline_report(pp, schedule, virtual_stages, microbatches)
    document, grid = collect_info(tp=tp, pp=pp, dp=dp, strict=strict, pipeline=pipeline, intra_node=intra_node,
                                  cp=cp)
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
    if pipeline:
        v = pipeline["virtual_stages"]
        formula = bubble_formula(pipeline["schedule"])
        print(f"pipeline: schedule {pipeline['schedule']}" + (f", virtual_stages={v}" if v > 1 else "") +
              f", {pipeline['microbatches']} micro-batches, bubble {formula} = {pipeline['bubble']:.1%} of the "
              f"ideal step", file=stream)
    print(f"dp reduction of CPU float sums (comm.intra_node={intra_node}): {document['dp_reduction']}"
          + (f" ({ROUTES[document['dp_reduction']]})" if document["dp_reduction"] in ROUTES else ""), file=stream)
    if document["dp_routes"]:
        print_routes(document["dp_routes"], stream)
    if document["groups_crossing_nodes"]:
        print(f"groups crossing nodes: {', '.join(document['groups_crossing_nodes'])}", file=stream)
    axes = [a for a in AXES if a != "cp" or document["layout"]["cp"] > 1]  # cp's columns when it is used
    header = f"{'rank':>5} {'node':>5} {'local':>5} " + " ".join(f"{a:>3}" for a in axes) + "  " + \
        " / ".join(f"{a}_group" for a in axes)
    print(header, file=stream)
    for r in document["ranks"]:
        print(f"{r['rank']:>5} {r['node']:>5} {r['local_rank']:>5} " + " ".join(f"{r[a]:>3}" for a in axes) + "  " +
              " / ".join(str(r[f"{a}_group"]) for a in axes), file=stream)
    return 0
