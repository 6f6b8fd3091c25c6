"""Start real MPI jobs from tests: ``run_mpi(n, script, *args)`` with a hard timeout.

Every multi-rank test goes through here, so none can hang CI: ``timeout -k`` kills the whole
launcher tree, and ``python -m mpi4py`` aborts the job as soon as one rank raises.
Override the launcher with ``HPCTRAIN_TEST_MPIEXEC`` (e.g. "mpirun --oversubscribe") on a cluster.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "mpi" / "scripts"
FAKE_NODES_LAUNCHER = Path(__file__).resolve().parent / "fake_nodes_launch.sh"


@dataclass
class MpiResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def mpiexec() -> list[str]:
    override = os.environ.get("HPCTRAIN_TEST_MPIEXEC")
    if override:
        return shlex.split(override)
    exe = shutil.which("mpiexec", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        raise RuntimeError("mpiexec not found: install the 'mpi' extra (pip install -e .[mpi,test])")
    return [exe]


def yield_shim() -> str | None:
    """tests/native/yield_sleeps.c built once into .pytest_cache (a sched_yield that sleeps 50 us: MPI ranks
    waiting on an oversubscribed machine let the others run), or None where no C compiler is found or
    ``HPCTRAIN_TEST_YIELD_SHIM=0``. Safe on two workers at once: built under a private name, then renamed."""
    if os.environ.get("HPCTRAIN_TEST_YIELD_SHIM", "1") == "0":
        return None
    source = Path(__file__).resolve().parent / "native" / "yield_sleeps.c"
    target = ROOT / ".pytest_cache" / "native" / f"yield_sleeps-{int(source.stat().st_mtime)}.so"
    if target.exists():
        return str(target)
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    private = target.with_name(f"{target.name}.{os.getpid()}")
    built = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(private), str(source)],
                           capture_output=True, text=True, timeout=60)
    if built.returncode != 0:
        return None
    os.replace(private, target)
    return str(target)


def mpi_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    shim = yield_shim()
    if shim and shim not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = f"{shim} {env['LD_PRELOAD']}".strip() if env.get("LD_PRELOAD") else shim
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1", "HPCTRAIN_ERROR_GRACE_S": "0.5",
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    if os.geteuid() == 0:  # Open MPI's mpiexec refuses root without these (MPICH ignores them)
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.update(extra or {})
    return env


def run_mpi(nprocs: int, target: str, *args: str, timeout: float = 120, env: dict | None = None,
            launcher_args: list[str] | None = None, module: bool = False, check: bool = True,
            fake_nodes: list[str] | None = None) -> MpiResult:
    """Run ``target`` (a script under tests/mpi/scripts, a path, or with ``module=True`` a module) on
    ``nprocs`` ranks. ``fake_nodes``: names of emulated hosts; ranks are placed round-robin over them
    (hydra ``-ppn 1``), each host a UTS namespace, so MPI sees several nodes on this one machine."""
    cmd = ["timeout", "-k", "5", str(timeout)] + mpiexec()
    if fake_nodes:
        cmd += ["-launcher", "rsh", "-launcher-exec", str(FAKE_NODES_LAUNCHER),
                "-hosts", ",".join(fake_nodes), "-ppn", "1"]
    cmd += list(launcher_args or []) + ["-n", str(nprocs), sys.executable]
    if module:
        cmd += ["-m", target]
    else:
        path = SCRIPTS / target if not os.path.isabs(target) else Path(target)
        cmd += ["-m", "mpi4py", str(path)]
    cmd += list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(env), cwd=str(ROOT),
                          stdin=subprocess.DEVNULL)
    result = MpiResult(proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        timed_out = " (TIMED OUT)" if proc.returncode in (124, 137) else ""
        raise AssertionError(f"mpi job failed with exit {proc.returncode}{timed_out}: {' '.join(cmd)}\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return result


def ckpt(*args: str, check: bool = True) -> MpiResult:
    """``hpctrain ckpt ARGS`` in this process (one Python + torch start-up less per call; the command needs no
    MPI), through the entry point's own error handling: its exit code and output. A parallel h5py starts MPI
    when imported, so there the command keeps its own process. ``test_ckpt_list_inspect_verify`` runs the
    command as its own process too."""
    import contextlib
    import io

    import h5py

    from hpctrain.cli import dispatch
    from hpctrain.runtime.errors_exit import run_and_exit

    if h5py.get_config().mpi:
        proc = subprocess.run([sys.executable, "-m", "hpctrain.cli", "ckpt", *args], capture_output=True, text=True,
                              env=mpi_env(), cwd=str(ROOT), timeout=120, stdin=subprocess.DEVNULL)
        result = MpiResult(proc.returncode, proc.stdout, proc.stderr)
    else:
        stdout, stderr = io.StringIO(), io.StringIO()
        had_mpi = "mpi4py.MPI" in sys.modules  # another test of this worker may have imported it
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = run_and_exit(dispatch, ["ckpt", *args])
        assert had_mpi or "mpi4py.MPI" not in sys.modules, "hpctrain ckpt started MPI in the test process"
        result = MpiResult(code, stdout.getvalue(), stderr.getvalue())
    if check:
        assert result.returncode == 0, result.output
    return result


def run_many(nprocs: int, commands: list[list[str]], timeout: float = 600,
             fake_nodes: list[str] | None = None) -> list[dict]:
    """Run independent ``hpctrain`` commands (argv lists, e.g. ``["train", "train.run_dir=..."]``) one after
    the other in ONE launch of ``nprocs`` ranks (scripts/train_many.py: one start-up instead of one per run).
    Asserts each exited 0; returns per command ``{"exit", "stdout", "stderr"}`` (what its ranks printed).
    ``fake_nodes``: as ``run_mpi``'s."""
    import json

    result = run_mpi(nprocs, "train_many.py", json.dumps(commands), timeout=timeout, fake_nodes=fake_nodes)
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    runs = json.loads(line.removeprefix("RESULTS "))
    assert [run["exit"] for run in runs] == [0] * len(commands), result.output[-6000:]
    return runs


def refused_inputs(nprocs: int, base, cases: list[list[str]], timeout: float = 240) -> list[list]:
    """Run each bad case (overrides, or a whole ``train``/``info`` argv) in-process on ``nprocs`` ranks in ONE
    launch (scripts/check_bad_inputs.py, run directories under ``base``); per case, every rank's
    ``(error type, raised alike everywhere, message or None, its run directory exists)``."""
    import json

    result = run_mpi(nprocs, "check_bad_inputs.py", str(base), json.dumps(cases), timeout=timeout)
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    return json.loads(line.removeprefix("RESULTS "))


def assert_refused_alike(ranks: list, nprocs: int, expected: str, case) -> str:
    """Every one of ``nprocs`` ranks raised the same one-line user error, marked as raised everywhere (the CLI
    prints it once), naming ``expected``; returns the line."""
    assert len(ranks) == nprocs, (case, ranks)
    for kind, alike, message, _written in ranks:
        assert message is not None and "\n" not in message and expected in message, (case, kind, message)
        assert alike and "NOT A USER ERROR" not in message, (case, kind, message)
    assert len({message for _, _, message, _ in ranks}) == 1, (case, ranks)
    return ranks[0][2]


class FidelityRuns:
    """Named runs of scripts/check_fidelity.py, ``{name: (world size, layouts, variants, *options and
    overrides)}``, launched together per world size when one of them is first asked for
    (scripts/check_fidelity_many.py: the ranks start once, not once per run). ``runs(name)`` returns that
    run's output, after asserting it ended with FIDELITY OK. A failed launch fails every test that asks for
    one of its runs, without launching again."""

    def __init__(self, runs: dict, timeout: float = 1500):
        self.runs, self.timeout = runs, timeout
        self.outputs: dict[int, dict[str, str] | AssertionError] = {}

    def __call__(self, name: str) -> str:
        import json

        nprocs = self.runs[name][0]
        if nprocs not in self.outputs:
            jobs = [[n, ["--layouts", layouts, "--variants", variants, *extra]]
                    for n, (size, layouts, variants, *extra) in self.runs.items() if size == nprocs]
            try:
                result = run_mpi(nprocs, "check_fidelity_many.py", json.dumps(jobs), timeout=self.timeout)
                parts = result.stdout.split("=== JOB ")[1:]
                self.outputs[nprocs] = dict(part.split(" ===\n", 1) for part in parts)  # type: ignore[misc]
            except AssertionError as failed:
                self.outputs[nprocs] = failed
        outputs = self.outputs[nprocs]
        if isinstance(outputs, AssertionError):
            raise outputs
        out = outputs[name]
        assert "FIDELITY OK" in out, out[-3000:]
        return out


def run_self_stopping(nprocs: int, script: str, *args: str, timeout: float = 60, env: dict | None = None):
    """Run ``script`` whose rank stops itself (SIGSTOP, printing "stops itself (pid N)"), expecting the
    watchdog to end the job; then SIGKILL every such pid so no stopped rank outlives the test."""
    import re
    import signal

    result = run_mpi(nprocs, script, *args, timeout=timeout, check=False, env=env)
    for pid in re.findall(r"stops itself \(pid (\d+)\)", result.stdout):
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    return result


def two_hosts_up(tmp_path_factory, rate: str):
    """Generator for a module fixture: two emulated hosts (hpctrain/tools/two_hosts.py) joined at ``rate``
    ("none" = unshaped), taken down afterwards; skips where they cannot be made (no root, no netns)."""
    from hpctrain.tools.two_hosts import TwoHosts

    ok, reason = TwoHosts.available()
    if not ok:
        import pytest

        pytest.skip(reason)
    hosts = TwoHosts(rate, directory=tmp_path_factory.mktemp("two-hosts"), timeout=60)
    try:
        hosts.up()
        yield hosts
    finally:
        hosts.down()
