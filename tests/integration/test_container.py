"""The CPU image (containers/build_cpu_image.sh: debootstrap, podman import, podman build) trains the demo
like the same run outside it (float64, every loss equal), and a container's bad setup is one line with its
fix: a /dev/shm too small for MPI (never a bus error), a read-only run directory, another MPI's launcher
or a host MPI mpi4py cannot load. Needs root, podman and
debootstrap; skipped with the reason elsewhere (CI machines have neither). The root file system is cached in
~/.cache/hpctrain/containers, so a rebuild takes about a minute."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from mpirun import ROOT, mpi_env

IMAGE = "localhost/hpctrain:cpu"
RUNC = ROOT / "tests" / "containers" / "runc-no-rlimits"
ARGS = ["--config", "configs/tiny.toml", "parallel.pp=1", "parallel.tp=1", "train.dtype=float64", "train.steps=4",
        "train.seq_len=32", "model.n_layers=2", "--resume", "none"]
DATA = "docs/architecture.md"  # the same bytes inside and out (the builtin corpus is the Python's own sources)


def podman_args() -> list[str]:
    """Global podman flags that start a container on this host: none, or (a sandbox that refuses setrlimit
    and hybrid cgroups) runc through the tests' wrapper."""
    plain = subprocess.run(["podman", "run", "--rm", IMAGE, "true"], capture_output=True, text=True, timeout=120)
    if plain.returncode == 0:
        return []
    if shutil.which("runc") and ("setrlimit" in plain.stderr or "cgroups in hybrid mode" in plain.stderr):
        return ["--runtime", str(RUNC)]
    pytest.skip(f"podman cannot start a container here: {plain.stderr.strip()[-300:]}")


@pytest.fixture(scope="module")
def podman():
    if os.geteuid() != 0 or not shutil.which("podman") or not shutil.which("debootstrap"):
        pytest.skip("the container tests need root, podman and debootstrap (apt-get install podman debootstrap)")
    env = dict(os.environ, PYTHON=sys.executable)
    if subprocess.run(["podman", "image", "exists", IMAGE]).returncode == 0:  # the runtime decides how to build
        env["PODMAN_ARGS"] = " ".join(podman_args())
    build = subprocess.run(["bash", "containers/build_cpu_image.sh", "--no-check"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
    if build.returncode != 0 and "setrlimit" in build.stdout + build.stderr and shutil.which("runc"):
        env["PODMAN_ARGS"] = f"--runtime {RUNC}"
        build = subprocess.run(["bash", "containers/build_cpu_image.sh", "--no-check"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return ["podman", *podman_args()]


def in_container(podman, runs, *cmd, shm="1g", runs_mode="rw"):
    return subprocess.run([*podman, "run", "--rm", f"--shm-size={shm}", "-v", f"{runs}:/runs:{runs_mode}",
                           "-v", f"{ROOT}:/src:ro", "-w", "/src", IMAGE, *cmd],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_the_image_trains_the_demo_like_the_same_run_outside(podman, tmp_path):
    outside = subprocess.run(["timeout", "-k", "5", "120", shutil.which("mpiexec", path=os.path.dirname(sys.executable)),
                              "-n", "2", sys.executable, "-m", "hpctrain.cli", "train", *ARGS,
                              f"data.source={ROOT / DATA}", f"train.run_dir={tmp_path / 'outside'}"],
                             capture_output=True, text=True, env=mpi_env(), cwd=ROOT, stdin=subprocess.DEVNULL)
    assert outside.returncode == 0, outside.stderr[-3000:]
    (tmp_path / "runs").mkdir()
    inside = in_container(podman, tmp_path / "runs", "mpiexec", "-n", "2", "hpctrain", "train", *ARGS,
                          f"data.source=/src/{DATA}", "train.run_dir=/runs/inside")
    assert inside.returncode == 0, inside.stdout[-3000:] + inside.stderr[-3000:]
    assert "2 ranks on 1 node(s)" in inside.stdout
    assert losses(tmp_path / "runs" / "inside") == losses(tmp_path / "outside") and len(losses(tmp_path / "outside")) == 4


def test_a_small_dev_shm_and_a_read_only_run_dir_are_one_line_with_the_fix(podman, tmp_path):
    (tmp_path / "runs").mkdir()
    small = in_container(podman, tmp_path / "runs", "mpiexec", "-n", "2", "hpctrain", "train", *ARGS,
                         "train.run_dir=/runs/x", shm="1m")
    errors = [line for line in small.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert small.returncode == 2 and len(errors) == 1 and "--shm-size=1g" in errors[0], small.stderr[-2000:]
    assert "Bus error" not in small.stdout + small.stderr
    read_only = in_container(podman, tmp_path / "runs", "mpiexec", "-n", "2", "hpctrain", "train", *ARGS,
                             "train.run_dir=/runs/x", runs_mode="ro")
    assert read_only.returncode == 2, read_only.stdout[-2000:] + read_only.stderr[-2000:]
    assert "not writable" in read_only.stderr and "-v HOST_DIR:/runs, without :ro" in read_only.stderr, read_only.stderr
    assert not (tmp_path / "runs" / "x").exists()


def test_another_mpis_launcher_and_a_host_mpi_mpi4py_cannot_load_are_one_line_with_the_fix(podman, tmp_path):
    """What a host MPI that does not match the image's looks like from inside: Open MPI's mpirun starting the
    image's MPICH (its OMPI_* variables; MPICH then makes every rank a world of 1), and an Open MPI library
    (libmpi.so.40, not MPICH-ABI) named by MPI4PY_LIBMPI. Each is one line naming the cause and the fix."""
    (tmp_path / "runs").mkdir()
    foreign = in_container(podman, tmp_path / "runs", "env", "OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_RANK=1",
                           "hpctrain", "train", *ARGS, "train.run_dir=/runs/x")
    errors = [line for line in foreign.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert foreign.returncode == 2 and len(errors) == 1, foreign.stderr[-2000:]
    assert "openmpi started 2 tasks" in errors[0] and "(this process loaded MPICH Version:" in errors[0], errors
    assert "the image's mpiexec inside one container" in errors[0] and "MPI4PY_LIBMPI" in errors[0], errors
    unloadable = in_container(podman, tmp_path / "runs", "env", "MPI4PY_LIBMPI=/opt/host-mpi/lib/libmpi.so.40",
                              "hpctrain", "train", *ARGS, "train.run_dir=/runs/x")
    errors = [line for line in unloadable.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert unloadable.returncode == 2 and len(errors) == 1, unloadable.stderr[-2000:]
    assert "cannot load the MPI library for mpi4py" in errors[0] and "libmpi.so.40" in errors[0], errors
    assert "must be MPICH-ABI" in errors[0] and "Traceback" not in unloadable.stderr, unloadable.stderr[-2000:]
    assert not (tmp_path / "runs" / "x").exists()


def test_two_containers_on_two_emulated_hosts_train_like_one_host(podman, tmp_path):
    """The Kubernetes MPIJob's pattern on two emulated hosts (network namespaces h1, h2 on a veth pair,
    hpctrain/tools/two_hosts.py): a worker container in h2 runs the image's sshd as mpiuser (the keys
    mounted at /home/mpiuser/.ssh, as the MPI Operator mounts them), the launcher container in h1 runs the
    image's mpiexec with the ssh launcher over TCP, the run directory is one host directory mounted in both
    (the shared volume). Every loss equals the same 2-rank run outside, bitwise (float64: a 2-rank sum is the
    same in any order), and the gradients crossed the wire (h1's veth counters)."""
    from hpctrain.tools.two_hosts import TwoHosts

    ok, reason = TwoHosts.available()
    if not ok:
        pytest.skip(reason)
    outside = subprocess.run(["timeout", "-k", "5", "120", shutil.which("mpiexec", path=os.path.dirname(sys.executable)),
                              "-n", "2", sys.executable, "-m", "hpctrain.cli", "train", *ARGS,
                              f"data.source={ROOT / DATA}", f"train.run_dir={tmp_path / 'outside'}"],
                             capture_output=True, text=True, env=mpi_env(), cwd=ROOT, stdin=subprocess.DEVNULL)
    assert outside.returncode == 0, outside.stderr[-3000:]
    keys, runs = tmp_path / "keys", tmp_path / "runs"
    keys.mkdir(mode=0o700)
    runs.mkdir(mode=0o777)
    runs.chmod(0o777)  # mpiuser (uid 1000) writes the run there
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "id_rsa")], check=True, timeout=60)
    shutil.copy(keys / "id_rsa.pub", keys / "authorized_keys")
    for path in (keys, *keys.iterdir()):
        os.chown(path, 1000, 1000)
    mounts = ["--user", "1000", "--shm-size=1g", "-v", f"{keys}:/home/mpiuser/.ssh", "-v", f"{runs}:/runs",
              "-v", f"{ROOT}:/src:ro"]
    worker = f"hpctrain-worker-{os.getpid()}"
    with TwoHosts("none", directory=tmp_path / "hosts", timeout=60).running() as hosts:
        try:
            started = subprocess.run([*podman, "run", "-d", "--rm", "--name", worker, "--network", "ns:/run/netns/h2",
                                      "--hostname", "h2", *mounts, IMAGE, "/usr/sbin/sshd", "-De", "-f",
                                      "/home/mpiuser/.sshd_config"], capture_output=True, text=True, timeout=120)
            assert started.returncode == 0, started.stderr[-2000:]
            before = hosts.counters()
            launched = subprocess.run(
                [*podman, "run", "--rm", "--network", "ns:/run/netns/h1", "--hostname", "h1", *mounts, IMAGE,
                 "mpiexec", "-launcher", "ssh", "-hosts", "10.200.0.1,10.200.0.2", "-ppn", "1", "-n", "2",
                 "-genv", "FI_PROVIDER", "tcp", "-genv", "FI_TCP_IFACE", "eth1", "hpctrain", "train",
                 *[a.replace("configs/", "/src/configs/") for a in ARGS], f"data.source=/src/{DATA}",
                 "train.run_dir=/runs/two"],
                capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
            sent = TwoHosts.delta(before, hosts.counters())["h1"]["tx_bytes"]
        finally:
            subprocess.run([*podman, "rm", "-f", worker], capture_output=True, timeout=120)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert "2 ranks on 2 node(s)" in launched.stdout, launched.stdout[-3000:]
    assert losses(runs / "two") == losses(tmp_path / "outside") and len(losses(runs / "two")) == 4
    assert sent > 4 * 1_000_000, sent  # 4 steps of a 1.19 MiB float64 gradient all-reduce, over TCP on eth1
    assert any((runs / "two" / "checkpoints").iterdir())
