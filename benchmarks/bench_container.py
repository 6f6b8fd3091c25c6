"""The CPU image against the checkout's venv: image size, container start-up, importing torch and mpi4py,
and the 2-rank demo run (4 float64 steps of the tiny GPT), each timed inside a container and outside.

    python benchmarks/bench_container.py [--repeats 3] [--json F] [--csv F] [--podman "podman --runtime ..."]

Needs root and podman, and the image ``localhost/hpctrain:cpu`` (containers/build_cpu_image.sh). Each
command runs ``--repeats`` times, inside and outside alternately; the table gives the best and the worst
wall time (this machine is noisy) and the ratio of the bests. Outside runs use the venv of the python that
runs this script. The container runs take the same data file (a file of this checkout) as the outside ones.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpctrain.bench.report import write_records  # noqa: E402

IMAGE = "localhost/hpctrain:cpu"
TRAIN = ["train", "--config", "{root}/configs/tiny.toml", "parallel.pp=1", "parallel.tp=1", "train.dtype=float64",
         "train.steps=4", "train.seq_len=32", "model.n_layers=2", "--resume", "none",
         "data.source={root}/docs/architecture.md", "train.run_dir={runs}/bench", "train.progress=false"]
FIELDS = ("what", "inside_best_s", "inside_worst_s", "outside_best_s", "outside_worst_s", "inside_vs_outside",
          "repeats")


def timed(cmd: list[str], env: dict | None = None) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"bench_container: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--podman", default="podman", help='the podman command and its global flags')
    ap.add_argument("--runs", default="/tmp/hpctrain-bench-container", help="run directory root (made writable)")
    ap.add_argument("--json")
    ap.add_argument("--csv")
    args = ap.parse_args()
    podman = shlex.split(args.podman)
    os.makedirs(args.runs, exist_ok=True)
    os.chmod(args.runs, 0o777)
    venv = Path(sys.executable).parent
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{venv}{os.pathsep}{os.environ['PATH']}")
    run = [*podman, "run", "--rm", "--shm-size=1g", "-v", f"{ROOT}:/src:ro", "-v", f"{args.runs}:/runs", IMAGE]

    def train(root: str, runs: str) -> list[str]:
        return ["mpiexec", "-n", "2", "hpctrain", *[a.format(root=root, runs=runs) for a in TRAIN]]

    cases = {
        "start a container / a process (`true`)": (run + ["true"], ["true"]),
        "python -c 'import torch, mpi4py.MPI'": (run + ["python", "-c", "import torch, mpi4py.MPI"],
                                                 [sys.executable, "-c", "import torch, mpi4py.MPI"]),
        "2-rank demo, 4 float64 steps (mpiexec -n 2 hpctrain train)": (run + train("/src", "/runs"),
                                                                       train(str(ROOT), args.runs)),
    }
    records = []
    for what, (inside, outside) in cases.items():
        times: dict[str, list[float]] = {"inside": [], "outside": []}
        for _ in range(args.repeats):
            times["inside"].append(timed(inside))
            times["outside"].append(timed(outside, env))
        records.append({"what": what, "inside_best_s": round(min(times["inside"]), 3),
                        "inside_worst_s": round(max(times["inside"]), 3),
                        "outside_best_s": round(min(times["outside"]), 3),
                        "outside_worst_s": round(max(times["outside"]), 3),
                        "inside_vs_outside": round(min(times["inside"]) / min(times["outside"]), 2),
                        "repeats": args.repeats})
    size = subprocess.run([*podman, "image", "inspect", IMAGE, "--format", "{{.Size}}"], capture_output=True,
                          text=True, timeout=120)
    image_mib = round(int(size.stdout.strip()) / 2**20) if size.returncode == 0 and size.stdout.strip() else None
    print(f"image {IMAGE}: {image_mib} MiB")
    print(f"{'what':62s} {'inside best-worst (s)':>22s} {'outside best-worst (s)':>23s} {'ratio':>6s}")
    for r in records:
        print(f"{r['what']:62s} {r['inside_best_s']:>10.2f}-{r['inside_worst_s']:<11.2f} "
              f"{r['outside_best_s']:>10.2f}-{r['outside_worst_s']:<12.2f} {r['inside_vs_outside']:>5.2f}x")
    for r in records:
        r["image_mib"] = image_mib
    write_records(records, args.json, args.csv, FIELDS + ("image_mib",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
