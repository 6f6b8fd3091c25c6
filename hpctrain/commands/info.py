"""``hpctrain info``: the launch, MPI library, nodes and the dp x pp x cp x tp grid (tools/info.py)."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="describe the launch, MPI library, nodes and the dp x pp x cp x tp grid")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    p.add_argument("--dp", type=int, default=0, help="data-parallel size (default world/(tp*pp*cp))")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"],
                   help="pipeline schedule, for the bubble report (default 1f1b)")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="model chunks per pp rank (interleaved: >= 2; zb-v: 2)")
    p.add_argument("--microbatches", type=int, default=0, help="micro-batches per step (default: pp)")
    p.add_argument("--strict-placement", action="store_true", help="error if a tp group spans nodes")
    p.add_argument("--intra-node", default="auto", choices=["auto", "shm", "mpi"],
                   help="comm.intra_node: report how the dp group would reduce CPU float sums (default auto, as training)")
    p.add_argument("--json", action="store_true", help="print one JSON document on rank 0")
    p.set_defaults(func=_run_info)


def _run_info(args) -> int:
    from hpctrain.tools.info import run_info

    return run_info(tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, strict=args.strict_placement,
                    as_json=args.json,
                    schedule=args.schedule, virtual_stages=args.virtual_stages, microbatches=args.microbatches,
                    intra_node=args.intra_node)
