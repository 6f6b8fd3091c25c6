"""The built wheel is the product: it holds every module and trains when installed outside the source tree.

Every other test imports hpctrain from the source tree (editable install, PYTHONPATH), so a package
folder left out of the wheel (hpctrain/checkpoint/ once had no __init__.py) goes unnoticed there.
Here: ``pip wheel --no-deps .``; its file list must equal the source tree's modules and package data;
it is installed with ``--no-deps`` into a fresh virtual environment in a temporary directory, whose
third-party dependencies (torch, mpi4py, h5py, ...) come from this test environment's site-packages
through a ``.pth`` path line (a path line adds no editable finder, so hpctrain itself can only come
from the wheel); MPI is this environment's, named by ``MPI4PY_LIBMPI`` as on a cluster whose MPI
is a module. Then ``hpctrain train`` (2 ranks), ``ckpt verify`` and ``plan`` run from that venv.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from mpirun import ROOT, mpiexec

PACKAGE_DATA = {"hpctrain/tools/two_hosts.sh", "hpctrain/sweep/scaling_study.sbatch"}


def run(cmd, cwd, env, timeout=240):
    proc = subprocess.run(["timeout", "-k", "5", str(timeout), *map(str, cmd)], cwd=cwd, env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def source_files() -> set[str]:
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "hpctrain").rglob("*.py") if "__pycache__" not in p.parts}
    return files | PACKAGE_DATA


def installed_env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               MPIR_CVAR_CH4_PROGRESS_THROTTLE="1", PYTHONUNBUFFERED="1", HPCTRAIN_ERROR_GRACE_S="0.5")
    libmpi = Path(sys.prefix) / "lib" / "libmpi.so.12"  # the PyPI mpich wheel's library, if that is the MPI
    if libmpi.exists() and "MPI4PY_LIBMPI" not in env:
        env["MPI4PY_LIBMPI"] = str(libmpi)
    env.pop("SLURM_JOB_ID", None)
    return env


def test_the_wheel_holds_every_module_and_trains_installed(tmp_path):
    source = tmp_path / "source"  # a copy: setuptools builds in-tree and would leave build/ in the checkout
    shutil.copytree(ROOT / "hpctrain", source / "hpctrain", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", wheels, source], tmp_path, dict(os.environ))
    (wheel,) = wheels.glob("hpctrain-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n for n in zf.namelist() if n.startswith("hpctrain/")}
    missing, extra = source_files() - shipped, shipped - source_files()
    assert not missing, f"the wheel leaves out {sorted(missing)} (a package folder without __init__.py?)"
    assert not extra, f"the wheel ships files the source tree does not have: {sorted(extra)}"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    new_site = Path(subprocess.run([venv / "bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    (new_site / "hpctrain-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = installed_env(venv)
    run([sys.executable, "-m", "pip", "--python", venv / "bin/python", "install", "-q", "--no-deps", wheel], tmp_path, env)

    where = run([venv / "bin/python", "-c", "import hpctrain, json, os, sys; print(hpctrain.__file__); "
                 "print(json.dumps([os.path.abspath(p or '.') for p in sys.path]))"], tmp_path, env).splitlines()
    assert where[0].startswith(str(new_site)), f"hpctrain imported from {where[0]}, not the installed wheel"
    assert str(ROOT) not in json.loads(where[1]), f"the source tree is on sys.path: {where[1]}"

    work = tmp_path / "work"  # a user's directory: no configs/, no source tree
    work.mkdir()
    hpctrain = venv / "bin" / "hpctrain"
    out = run([*mpiexec(), "-n", "2", hpctrain, "train", "--config", ROOT / "configs/tiny.toml", "parallel.pp=1",
               "train.steps=3", "data.max_bytes=200000", "train.progress=false", "train.run_dir=runs/w"], work, env)
    assert "done: 3 steps" in out, out[-2000:]
    verified = run([hpctrain, "ckpt", "verify", "runs/w/checkpoints/step-00000003"], work, env)
    assert "step-00000003" in verified and "ok" in verified.lower(), verified
    plan = run([hpctrain, "plan", "--model", "gpt3-175b", "--nodes", "16", "--gpus-per-node", "8",
                "--inter-gbps", "200", "--json"], work, env)
    assert '"plans"' in plan, plan[-2000:]
