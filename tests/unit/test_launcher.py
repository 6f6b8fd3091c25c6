"""Launcher detection and the grid's pure placement logic (single process)."""
import pytest

from hpctrain.comm.grid import layout_coordinates
from hpctrain.config.layout import resolve_sizes
from hpctrain.errors import GridError, LaunchError
from hpctrain.runtime.launcher import check_launcher_agreement, read_launcher_env


@pytest.mark.parametrize("env,name,rank,size,local", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "openmpi", 3, 8, 1),
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}, "hydra", 2, 4, 0),
    ({"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
      "PMI_RANK": "5", "PMI_SIZE": "8"}, "slurm", 5, 8, 1),
    ({"PALS_RANKID": "1", "PALS_LOCAL_RANKID": "1"}, "pals", 1, None, 1),
    ({"PMIX_RANK": "0"}, "pmix", 0, None, None),
    ({}, "none", None, None, None),
])
def test_launcher_detection(env, name, rank, size, local):
    found = read_launcher_env(env)
    assert (found.name, found.rank, found.size, found.local_rank) == (name, rank, size, local)


def test_mpiexec_inside_sbatch_ignores_the_batch_shells_slurm_variables():
    env = {"SLURM_PROCID": "0", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "8",
           "PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"}
    assert read_launcher_env(env).name == "hydra"


def test_srun_without_pmi_is_a_clear_error():
    env = read_launcher_env({"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"})
    with pytest.raises(LaunchError, match=r"slurm started 4 tasks .* 1 rank\(s\); .*srun --mpi=pmi2"):
        check_launcher_agreement(0, 1, 0, env)


def test_rank_mismatch_and_local_rank_note():
    env = read_launcher_env({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    with pytest.raises(LaunchError, match="says rank 1"):
        check_launcher_agreement(0, 2, 0, env)
    assert "local rank 1 differs" in check_launcher_agreement(1, 2, 0, env)[0]


@pytest.mark.parametrize("container, fix", [
    ("", "rebuild mpi4py against the launcher's MPI"),
    ("podman/docker", "the image's mpiexec inside one container"),
    ("apptainer", "srun --mpi=pmi2"),
    ("kubernetes", "MPIJob's launcher pod"),
])
def test_another_mpis_launcher_names_the_loaded_library_and_the_containers_fix(container, fix):
    """Open MPI's mpirun starting ranks whose mpi4py loads MPICH (a host launcher and an image's MPI): every
    rank is a world of 1. The one line names both and the fix for where it runs."""
    env = read_launcher_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    with pytest.raises(LaunchError) as raised:
        check_launcher_agreement(0, 1, 0, env, "MPICH Version: 5.0.2", container)
    message = str(raised.value)
    assert "\n" not in message and "openmpi started 2 tasks" in message and fix in message, message
    assert "1 rank(s) (this process loaded MPICH Version: 5.0.2)" in message, message
    if container:
        assert "docs/containers.md#mpi-inside-vs-host-mpi-bind-mounted" in message


def test_an_mpi_library_mpi4py_cannot_load_is_one_line_naming_it(tmp_path):
    """MPI4PY_LIBMPI naming a library that is not MPI (what a non-MPICH-ABI host MPI bound in looks like)."""
    import subprocess
    import sys

    code = ("import sys\nfrom hpctrain.runtime.errors_exit import run_and_exit\n"
            "from hpctrain.runtime.launcher import import_mpi\nsys.exit(run_and_exit(lambda _: import_mpi()))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "MPI4PY_LIBMPI": str(tmp_path / "libnotmpi.so.12")})
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert len(lines) == 1 and "cannot load the MPI library for mpi4py" in lines[0], result.stderr
    assert f"MPI4PY_LIBMPI={tmp_path / 'libnotmpi.so.12'}" in lines[0] and "MPICH-ABI" in lines[0], lines


def test_resolve_sizes():
    assert resolve_sizes(8, tp=2, pp=2) == {"dp": 2, "pp": 2, "cp": 1, "tp": 2}
    assert resolve_sizes(8, dp=8) == {"dp": 8, "pp": 1, "cp": 1, "tp": 1}
    assert resolve_sizes(8, tp=2, cp=2) == {"dp": 2, "pp": 1, "cp": 2, "tp": 2}
    for kwargs, msg in [({"tp": 3}, "not divisible"), ({"dp": 3}, "launch 3 ranks"), ({"pp": -1}, "parallel.pp"),
                        ({"cp": 3}, r"tp\*pp\*cp = 1\*1\*3"), ({"cp": 0}, "parallel.cp"),
                        ({"dp": 2, "cp": 2}, r"dp\*pp\*cp\*tp = 2\*1\*2\*1 = 4")]:
        with pytest.raises(GridError, match=msg):
            resolve_sizes(8, **kwargs)


def test_layout_coordinates_follow_the_placement_order():
    # round-robin: node 0 holds 0,2,4,6 ; node 1 holds 1,3,5,7 -> order groups them by node
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    coords = layout_coordinates(order, {"dp": 2, "pp": 2, "cp": 1, "tp": 2})
    assert coords[0] == {"dp": 0, "pp": 0, "cp": 0, "tp": 0} and coords[2] == {"dp": 0, "pp": 0, "cp": 0, "tp": 1}
    assert coords[1] == {"dp": 1, "pp": 0, "cp": 0, "tp": 0} and coords[7] == {"dp": 1, "pp": 1, "cp": 0, "tp": 1}
    # cp sits between pp and tp: cp x tp blocks are consecutive in the placement order (inside a node)
    coords = layout_coordinates(list(range(8)), {"dp": 2, "pp": 1, "cp": 2, "tp": 2})
    assert [coords[r]["cp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [coords[r]["dp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
