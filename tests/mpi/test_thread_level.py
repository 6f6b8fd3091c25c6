"""An MPI that gives less than MPI_THREAD_MULTIPLE: the features that call MPI from helper threads (the
watchdog, asynchronous saves) are refused by name on every rank (exit 2), and training works without
them. MPI4PY_RC_THREAD_LEVEL=serialized makes mpi4py ask for (and MPICH give) MPI_THREAD_SERIALIZED,
the default of Cray MPICH."""
from mpirun import run_mpi

FAST = ["--config", "configs/tiny.toml", "parallel.pp=1", "train.steps=2", "data.max_bytes=200000",
        "train.progress=false", "--resume", "none"]
SERIALIZED = {"MPI4PY_RC_THREAD_LEVEL": "serialized"}


def train(run_dir, *extra):
    return run_mpi(2, "hpctrain.cli", "train", *FAST, f"train.run_dir={run_dir}", *extra, module=True,
                   timeout=120, env=SERIALIZED, check=False)


def test_helper_thread_features_are_refused_by_name_without_thread_multiple(tmp_path):
    watchdog = train(tmp_path)
    assert watchdog.returncode == 2 and "MPI_THREAD_SERIALIZED" in watchdog.stderr, watchdog.output[-2000:]
    assert "comm.timeout_s=0" in watchdog.stderr and "MPICH_MAX_THREAD_SAFETY=multiple" in watchdog.stderr
    saves = train(tmp_path, "comm.timeout_s=0")
    assert saves.returncode == 2 and "checkpoint.async=false" in saves.stderr, saves.output[-2000:]
    plain = train(tmp_path, "comm.timeout_s=0", "checkpoint.async=false")
    assert plain.returncode == 0 and "done: 2 steps" in plain.stdout, plain.output[-2000:]


def test_cuda_training_needs_at_least_serialized_and_says_so(tmp_path):
    """On CUDA the dp bucket hooks run on autograd's device thread: MPI_THREAD_FUNNELED is refused when the
    grid prepares the device, before any CUDA call (so this CPU machine can check it)."""
    script = tmp_path / "use_cuda.py"
    script.write_text("from hpctrain.comm.grid import ProcessGrid\nfrom hpctrain.errors import HpcTrainError\n"
                      "from hpctrain.runtime.launcher import discover\n"
                      "grid = ProcessGrid.build(discover(), dp=2, timeout_s=0)\n"
                      "try:\n    grid.use_device('cuda:0')\nexcept HpcTrainError as exc:\n    print(f'REFUSED {exc}', flush=True)  # one write\n")
    result = run_mpi(2, str(script), env={"MPI4PY_RC_THREAD_LEVEL": "funneled"}, timeout=60)
    # both ranks refuse (their lines may interleave on the shared stdout)
    assert result.stdout.count("REFUSED training on CUDA") == 2, result.output
    assert result.stdout.count("needs MPI_THREAD_SERIALIZED, but this MPI provides MPI_THREAD_FUNNELED") == 2, \
        result.output
