"""hpctrain/runtime/stale_shm.py: before MPI starts, a Slurm step's ranks remove the MPICH segment a killed
earlier attempt of the SAME job step left, and nothing else (other steps, other users, files in use)."""
import os
import subprocess
import sys

import pytest

from hpctrain.runtime.stale_shm import mpich_segment_id, remove_stale_mpich_segments, slurm_pmi_job_id

STEP = {"SLURM_JOB_ID": "200857", "SLURM_STEP_ID": "0"}


def test_the_segment_id_is_mpichs_hash_of_the_pmi_job_id():
    # /dev/shm/mpich_shm_d00d557d_{0,1}: left on this machine by Slurm job 200857, step 0, killed in MPI_Init
    assert mpich_segment_id("200857.0") == "d00d557d"
    assert slurm_pmi_job_id(STEP) == "200857.0"
    assert slurm_pmi_job_id({**STEP, "SLURM_PMI2_PMI_JOBID": "x.7"}) == "x.7"
    assert slurm_pmi_job_id({"SLURM_JOB_ID": "200857"}) is None  # the batch script, not an srun step


def test_only_this_steps_unused_segments_are_removed(tmp_path):
    names = ["mpich_shm_d00d557d_0", "mpich_vci_d00d557d_1", "mpich_shm_d00d557d_1",  # this step
             "mpich_shm_7380e22c_0", "ucx_shm_posix_1", "mpich_shar_tmpAbC123"]  # another step; not MPICH's node segment
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    held = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); print(1, flush=True); "
                             "time.sleep(60)", str(tmp_path / "mpich_shm_d00d557d_1")], stdout=subprocess.PIPE)
    try:
        assert held.stdout.readline().strip() == b"1"  # a live rank holds node 1's segment open
        removed = remove_stale_mpich_segments(str(tmp_path), STEP)
    finally:
        held.kill()
        held.wait()
    assert sorted(os.path.basename(p) for p in removed) == ["mpich_shm_d00d557d_0", "mpich_vci_d00d557d_1"]
    assert sorted(os.listdir(tmp_path)) == sorted(set(names) - {"mpich_shm_d00d557d_0", "mpich_vci_d00d557d_1"})


def test_nothing_is_removed_outside_an_srun_step_or_for_another_user(tmp_path):
    (tmp_path / "mpich_shm_d00d557d_0").write_bytes(b"x")
    assert remove_stale_mpich_segments(str(tmp_path), {}) == []
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(tmp_path / "mpich_shm_d00d557d_0", 65534, 65534)
    assert remove_stale_mpich_segments(str(tmp_path), STEP) == []
    assert (tmp_path / "mpich_shm_d00d557d_0").exists()
