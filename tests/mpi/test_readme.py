"""Every shell command of README.md's Quick start, Training and Checkpoints blocks runs and exits 0.

The commands are read from README.md itself, so the README cannot silently rot. They run in one
temporary directory (with the repo's configs/ linked in), in README order, with the venv's bin first
on PATH; only sizes are shortened (step counts, message sizes, benchmark iterations), never the command or its
flags.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

from mpirun import run_many

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("Quick start", "Training", "Checkpoints")
SHORTER = [  # (pattern, replacement): smaller runs, same commands
    (r"train\.steps=\d+", "train.steps=3"), (r"--max-steps \d+", "--max-steps 2"),
    (r"--sizes \S+", "--sizes 1K,64K"), (r"step-00000100", "step-00000004"),
    (r"hpctrain bench comm", "hpctrain bench comm --iters 5 --rounds 1"),  # 5 s instead of 48 at 4 ranks
    (r"mpiexec -n 8 ", "mpiexec -n 4 "),  # the tp=2 x pp=2 layouts at dp=1: 4 rank start-ups fewer on 2 cores
    (r"mpiexec -n 4 hpctrain bench comm", "mpiexec -n 2 hpctrain bench comm"),  # --axis tp --tp 2 fits 2 ranks
]


def readme_commands() -> list[str]:
    """The commands of the README's bash blocks in SECTIONS, continuation lines joined."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = []
    for section in re.split(r"^## ", text, flags=re.M):
        if not section.startswith(SECTIONS):
            continue
        for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if line and not line.startswith(("#", "make ", ". ", "source ")):
                    commands.append(line)
    return commands


def shortened(command: str) -> str:
    for pattern, replacement in SHORTER:
        command = re.sub(pattern, replacement, command)
    if " train " in f" {command} " and "train.steps=" not in command:
        command += " train.steps=4"
    if " train " in f" {command} ":
        command += " data.max_bytes=200000 train.progress=false"
    if "--resume auto" in command:
        command = command.replace("--resume auto", "--resume auto train.steps=4")
    return command


def run(command: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["timeout", "-k", "5", "180", "bash", "-c", command], cwd=cwd, env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)


def test_readme_commands_run(tmp_path):
    commands = readme_commands()
    assert len(commands) >= 10, commands  # a restructured README must not make this test vacuous
    assert any("hpctrain train" in c for c in commands) and any("ckpt diff" in c for c in commands)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"],
               OMP_NUM_THREADS="1", MPIR_CVAR_CH4_PROGRESS_THROTTLE="1", PYTHONUNBUFFERED="1",
               HPCTRAIN_ERROR_GRACE_S="0.5", PYTHONPATH=str(ROOT))
    env.pop("SLURM_JOB_ID", None)
    # what the Checkpoints block reads: the demo's run (4 steps) and two identical runs to diff, both in one
    # launch (mpirun.run_many)
    run_many(2, [shortened(f"train --config configs/tiny.toml parallel.pp=1 train.run_dir={tmp_path / run_dir}")
                 .split() for run_dir in ("runs/a", "runs/b")])
    for command in commands:
        command = shortened(command)
        if "ckpt" in command and not (tmp_path / "runs/tiny/checkpoints/step-00000004").exists():
            done = run(shortened("mpiexec -n 4 hpctrain train --config configs/tiny.toml"), tmp_path, env)
            assert done.returncode == 0, done.stderr[-3000:]
        result = run(command, tmp_path, env)
        assert result.returncode == 0, f"README command failed: {command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
