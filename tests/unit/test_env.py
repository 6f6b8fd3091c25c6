"""Settings from the environment: one reader (hpctrain/runtime/env.py), typed values, one precedence rule,
and every variable documented in docs/configuration.md."""
import ast
import re
from pathlib import Path

import pytest
from mpi4py import MPI

from hpctrain.runtime import env
from hpctrain.runtime.env import EnvError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hpctrain"
READER = "hpctrain/runtime/env.py"
# These interpret the launchers' own variables (SLURM_*, OMPI_*, PMI_*), read from an ``env`` mapping.
LAUNCH_READERS = {"hpctrain/runtime/launcher.py", "hpctrain/runtime/signals.py"}
NAME = re.compile(r"\bHPCTRAIN_[A-Z][A-Z0-9_]*")


def environment_reads(source: str) -> list[str]:
    """Where ``source`` touches the process environment (os.environ, os.getenv, ...): "line: what"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv", "putenv",
                                                             "unsetenv") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            found.append(f"{node.lineno}: os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{node.lineno}: from os import {a.name}" for a in node.names
                      if a.name in ("environ", "environb", "getenv", "putenv", "unsetenv")]
    return found


def hpctrain_names(source: str) -> list[str]:
    """The HPCTRAIN_* string constants of ``source``."""
    return [n.value for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and NAME.search(n.value)
            and not n.value.startswith(("``", "$"))]


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def test_only_env_py_reads_the_environment():
    offenders = {}
    for name, source in modules():
        if name == READER:
            continue
        if name in LAUNCH_READERS:
            if hpctrain_names(source):  # the launch readers may read launch facts, never a setting
                offenders[name] = hpctrain_names(source)
        elif environment_reads(source):
            offenders[name] = environment_reads(source)
    assert not offenders, f"read the environment through hpctrain/runtime/env.py: {offenders}"


def test_the_check_sees_every_way_of_reading():
    assert environment_reads("import os\nx = os.environ.get('HPCTRAIN_X')\n") == ["2: os.environ"]
    assert environment_reads("import os\nx = os.getenv('HPCTRAIN_X', '1')\n") == ["2: os.getenv"]
    assert environment_reads("from os import environ\n") == ["1: from os import environ"]
    assert environment_reads("import os\nif 'HPCTRAIN_X' in os.environ: pass\n") == ["2: os.environ"]
    assert environment_reads("import os\nos.path.join('a', 'b')\n") == []
    assert hpctrain_names("env.get('HPCTRAIN_X')\n") == ["HPCTRAIN_X"]


def test_every_variable_is_documented():
    docs = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = docs.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    seen = set(env.SETTINGS)
    for folder in ("hpctrain", "scripts", "slurm", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".sh", ".sbatch") and path.name != "test_env.py":
                seen |= set(NAME.findall(path.read_text(encoding="utf-8", errors="replace")))
    missing = sorted(name for name in seen if f"`{name}`" not in section)
    assert not missing, f"document these in docs/configuration.md, section Environment variables: {missing}"


# ---------------------------------------------------------------- values
def test_precedence_a_set_variable_wins_over_the_config_key():
    assert env.comm_timeout_s(5.0, {}) == 5.0
    assert env.comm_timeout_s(5.0, {"HPCTRAIN_COMM_TIMEOUT": "7"}) == 7.0
    assert env.comm_timeout_s(5.0, {"HPCTRAIN_COMM_TIMEOUT": " "}) == 5.0  # empty = unset
    assert env.cache_dir("/cfg", {}) == "/cfg"
    assert env.cache_dir("/cfg", {"HPCTRAIN_CACHE": "/env"}) == "/env"
    assert env.cache_dir("", {}).endswith(".cache/hpctrain")


@pytest.mark.parametrize("name,read", [
    ("HPCTRAIN_COMM_TIMEOUT", lambda e: env.comm_timeout_s(600.0, e)),
    ("HPCTRAIN_ERROR_GRACE_S", env.error_grace_s),
    ("SLURM_RESTART_COUNT", env.slurm_restart_count),
    ("OMP_NUM_THREADS", env.omp_num_threads),
])
@pytest.mark.parametrize("bad", ["abc", "-1", "nan"])
def test_a_bad_value_is_an_error_naming_the_variable(name, read, bad):
    if name in ("SLURM_RESTART_COUNT", "OMP_NUM_THREADS") and bad == "nan":
        bad = "1.5"
    with pytest.raises(EnvError, match=f"\\${name}="):
        read({name: bad})


def test_defaults_and_types():
    assert env.error_grace_s({}) == 1.0 and env.error_grace_s({"HPCTRAIN_ERROR_GRACE_S": "0.5"}) == 0.5
    assert env.fault_spec({}) == "" and env.gloo_addr({}) is None and env.ns_dir({}) == "/tmp/hpctrain-ns"
    assert env.slurm_restart_count({}) == 0 and env.slurm_restart_count({"SLURM_RESTART_COUNT": "2"}) == 2
    assert env.slurm_job_id({"SLURM_JOB_ID": "42"}) == "42" and env.slurm_job_id({}) is None
    assert env.omp_num_threads({}) == 1 and env.omp_num_threads({"OMP_NUM_THREADS": "4,2"}) == 4
    assert env.in_batch_job({"PBS_JOBID": "7.pbs"}) and not env.in_batch_job({"PATH": "/bin"})
    assert env.cuda_visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == ""


def test_child_environ_sets_and_defaults():
    child = env.child_environ({"B": "set"}, defaults={"A": "default", "C": "default"},
                              environ={"A": "mine", "B": "mine"})
    assert child == {"A": "mine", "B": "set", "C": "default"}


def test_both_timeout_reads_of_the_grid_obey_the_rule(monkeypatch):
    """``ProcessGrid.from_config`` (the training path) and ``ProcessGrid.build``: the variable wins over
    the key (or its default); an explicit ``timeout_s`` wins over both."""
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.config import load_config
    from hpctrain.runtime.launcher import discover

    info, cfg = discover(MPI.COMM_SELF), load_config(None, ["comm.timeout_s=50"])

    def timeout_of(grid) -> float:
        grid.close()
        return grid.watchdog.timeout_s

    def configured(**kwargs) -> float:
        return timeout_of(ProcessGrid.from_config(cfg, info, mpi_world=MPI.COMM_SELF, **kwargs))

    def built(**kwargs) -> float:
        return timeout_of(ProcessGrid.build(info, mpi_world=MPI.COMM_SELF, **kwargs))

    monkeypatch.delenv("HPCTRAIN_COMM_TIMEOUT", raising=False)
    assert (configured(), built()) == (50, 600)
    monkeypatch.setenv("HPCTRAIN_COMM_TIMEOUT", "70")
    assert (configured(), built()) == (70, 70)
    assert (configured(timeout_s=30), built(timeout_s=30)) == (30, 30)
