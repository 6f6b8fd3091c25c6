"""``hpctrain ckpt list|inspect|verify|diff``: single-process checkpoint tools on plain (serial) h5py."""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from hpctrain.errors import HpcTrainError


def add_parser(sub) -> None:
    p = sub.add_parser("ckpt", help="list, inspect, verify and compare checkpoints")
    c = p.add_subparsers(dest="ckpt_command", required=True)
    ls = c.add_parser("list", help="checkpoints of a run directory (or a checkpoint directory)")
    ls.add_argument("run_dir")
    ls.add_argument("--json", action="store_true", help="print a JSON list of {step, path, complete, latest}")
    ls.add_argument("--local-dir", metavar="DIR", help=(
        "also list this node's pieces of the run in the node-local tier (the run's checkpoint.local_dir; "
        "{hostname} expanded): JSON records with tier=local, step, rank, kind (own/replica), path, bytes, layout"))
    ls.set_defaults(func=_list)
    ins = c.add_parser("inspect", help="step, layout, tensors, shapes, dtypes, bytes, checksums")
    ins.add_argument("path")
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(func=_inspect)
    ver = c.add_parser("verify", help="recompute every checksum; non-zero exit naming the bad dataset (a step "
                                      "directory, or a local-tier piece's .json)")
    ver.add_argument("path")
    ver.set_defaults(func=_verify)
    diff = c.add_parser("diff", help="tensor-by-tensor max abs difference; non-zero exit beyond --atol")
    diff.add_argument("a")
    diff.add_argument("b")
    diff.add_argument("--atol", type=float, default=0.0)
    diff.set_defaults(func=_diff)


def _resolve_dir(path: str) -> str:
    checkpoints = os.path.join(path, "checkpoints")
    return checkpoints if os.path.isdir(checkpoints) else path


def _open(path: str):
    from hpctrain.checkpoint.weights import open_checkpoint

    return open_checkpoint(path)

def _list(args) -> int:
    from hpctrain.checkpoint.directory import list_checkpoints

    directory = _resolve_dir(args.run_dir)
    if not os.path.isdir(directory):
        raise HpcTrainError(f"{args.run_dir}: no such run or checkpoint directory")
    records = list_checkpoints(directory)
    if args.local_dir:
        records += _local_pieces(args.local_dir, args.run_dir)
    if args.json:
        json.dump(records, sys.stdout, indent=1)
        print()
        return 0
    for r in records:
        if r.get("tier") == "local":
            whose = f"rank {r['rank']}'s piece" if r["kind"] == "own" else f"replica of rank {r['rank']}"
            print(f"{r['step']:>8}  {r['path']}  (local: {whose}, {r['bytes'] / 2**20:.1f} MiB, {r['layout']})")
            continue
        flags = ("complete" if r["complete"] else "PARTIAL") + (", latest" if r["latest"] else "")
        print(f"{r['step']:>8}  {r['path']}  ({flags})")
    if not records:
        print(f"no checkpoints in {directory}")
    return 0


def _inspect(args) -> int:
    from hpctrain.checkpoint.format import layout_text  # not local_tier: it starts MPI

    with _open(args.path) as reader:
        tensors = []
        for name in reader.datasets():
            d = reader.file[name]
            boxes = reader.manifest.get(name, [])
            tensors.append({"name": name, "shape": list(d.shape), "dtype": str(d.dtype),
                            "bytes": int(d.size * d.dtype.itemsize), "boxes": len(boxes),
                            "crc32": [f"{crc:08x}" for _, _, crc in boxes][:8]})
        info = {"path": reader.path, "step": reader.attrs.get("step"), "complete": reader.complete,
                "writer": reader.attrs.get("writer"), "layout": reader.attrs.get("layout"),
                "hpctrain_version": reader.attrs.get("hpctrain_version"), "model_dtype": reader.attrs.get("model_dtype"),
                "sampler": reader.attrs.get("sampler"), "total_bytes": sum(t["bytes"] for t in tensors),
                "tensors": tensors}
        info["architecture"] = _architecture(reader.attrs)
        base = reader.attrs.get("lora_base")
        if base:  # a LoRA checkpoint that refers to its frozen base
            info["lora_base"] = {"path": base.get("path"), "checksum": base.get("checksum"),
                                 "tensors": len(base.get("tensors", {}))}
    if args.json:
        json.dump(info, sys.stdout, indent=1)
        print()
        return 0
    print(f"{info['path']}: step {info['step']}, {'complete' if info['complete'] else 'PARTIAL'}, "
          f"writer {info['writer']}, layout {layout_text(info['layout'])}, {info['model_dtype']}, "
          f"{info['total_bytes'] / 2**20:.2f} MiB, hpctrain {info['hpctrain_version']}")
    arch = info["architecture"]
    print(f"  architecture: fingerprint {arch['fingerprint']}{'' if arch['recorded'] else ' (from its config)'}: "
          + ", ".join(f"{k}={v}" for k, v in arch["keys"].items()))
    if "lora_base" in info:
        base = info["lora_base"]
        print(f"  frozen base: {base['tensors']} tensors referred to at {base['path']} (checksum {base['checksum'][:16]})")
    for t in tensors:
        print(f"  {t['name']:<44} {str(tuple(t['shape'])):<14} {t['dtype']:<8} {t['bytes']:>10} B  "
              f"{t['boxes']} box(es) crc32 {','.join(t['crc32'][:2])}{'...' if t['boxes'] > 2 else ''}")
    return 0


def _architecture(attrs: dict) -> dict:
    """The model the checkpoint was written for (checkpoint/architecture.py): its keys and fingerprint, and
    whether it recorded them (older checkpoints: derived from their config)."""
    from hpctrain.checkpoint.architecture import ARCHITECTURE_ATTR, fingerprint, of_checkpoint

    keys = of_checkpoint(attrs)
    return {"fingerprint": fingerprint(keys), "keys": keys, "recorded": ARCHITECTURE_ATTR in attrs}


def _local_pieces(local_dir: str, run_dir: str) -> list[dict]:
    """This node's pieces of the run in its local tier (unchecked: ``ckpt verify PIECE.json`` checks one)."""
    import glob

    from hpctrain.checkpoint.local_piece import read_index
    from hpctrain.checkpoint.format import layout_text
    from hpctrain.checkpoint.local_tier import tier_root

    records = []
    for path in sorted(glob.glob(os.path.join(tier_root(local_dir, run_dir), "step-*", "*.json"))):
        try:
            doc = read_index(path)
        except (OSError, ValueError) as exc:
            raise HpcTrainError(f"{path}: unreadable local piece index: {exc}") from None
        layout = layout_text(doc["layout"])
        records.append({"tier": "local", "step": doc["step"], "rank": doc["rank"], "path": path,
                        "kind": "replica" if os.path.basename(path).startswith("replica-") else "own",
                        "bytes": doc["nbytes"], "layout": layout})
    return sorted(records, key=lambda r: (r["step"], r["rank"], r["kind"]))


def _verify_piece(path: str) -> int:
    from hpctrain.checkpoint.local_piece import checksum_problem, read_piece

    try:
        piece = read_piece(path)
    except (OSError, ValueError, KeyError) as exc:
        raise HpcTrainError(f"{path}: unreadable local piece: {exc}") from None
    problem = checksum_problem(piece)
    if problem:
        raise HpcTrainError(f"{path} is corrupt: {problem}")
    print(f"{path}: OK ({len(piece.entries)} tensors of step {piece.meta['step']}, rank {piece.meta['rank']} verified)")
    return 0


def _verify(args) -> int:
    if args.path.endswith(".json"):
        return _verify_piece(args.path)
    with _open(args.path) as reader:
        problems = reader.verify()
        if not reader.complete:
            problems.insert(0, "no COMPLETE marker: the checkpoint was never published (partial)")
        if problems:
            raise HpcTrainError(f"{reader.path} is corrupt: " + "; ".join(problems[:10]))
        print(f"{reader.path}: OK ({len(reader.boxes())} boxes in {len(reader.datasets())} datasets verified)")
    return 0


def _diff(args) -> int:
    with _open(args.a) as a, _open(args.b) as b:
        names_a, names_b = set(a.datasets()), set(b.datasets())
        worst, differing = 0.0, []
        for name in sorted(names_a | names_b):
            if name.startswith("rng/"):
                continue
            if name not in names_a or name not in names_b:
                differing.append(f"{name}: only in {'A' if name in names_a else 'B'}")
                continue
            x, y = a.file[name][()], b.file[name][()]
            if x.shape != y.shape:
                differing.append(f"{name}: shape {x.shape} vs {y.shape}")
                continue
            diff = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) if x.size else 0.0
            worst = max(worst, diff)
            print(f"  {name:<44} max|a-b| = {diff:.3e}")
            if not diff <= args.atol:
                differing.append(f"{name}: max abs diff {diff:.3e} > atol {args.atol:g}")
        print(f"steps {a.attrs.get('step')} vs {b.attrs.get('step')}; worst max|a-b| = {worst:.3e}")
    if differing:
        raise HpcTrainError("checkpoints differ: " + "; ".join(differing[:10]))
    print("checkpoints agree within atol")
    return 0
