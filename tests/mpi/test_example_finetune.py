"""The worked fine-tuning example (examples/sft/finetune.sh, docs/models-and-data.md) runs end to end as a
user runs it: a transformers-made Llama imported, the shipped SFT file prepared, LoRA on tp=2 x pp=2 from
the HF directory, the adapter exported and loaded by peft, whose greedy answer equals ``hpctrain generate
--chat``'s; the fine-tuned model answers a training question right. The test trains 150 steps, not the
example's 300 (the docs show those), to keep CI short: enough to learn "Paris.", not yet "42"."""
import os
import re
import sys
import subprocess

import pytest

from mpirun import ROOT, mpi_env

pytest.importorskip("peft")
pytest.importorskip("transformers")


def test_the_worked_fine_tuning_example_runs_end_to_end(tmp_path):
    env = {**mpi_env(), "PATH": os.path.dirname(sys.executable) + os.pathsep + mpi_env()["PATH"], "STEPS": "150"}
    work = tmp_path / "work"
    result = subprocess.run(["bash", "examples/sft/finetune.sh", str(work)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=400, stdin=subprocess.DEVNULL)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    peft_answer = re.search(r"^peft \+ transformers: (.+)$", out, re.M)
    assert peft_answer and f"hpctrain generate:   {peft_answer.group(1)}\n" in out, out  # the same greedy answer
    assert "stopped at <|end|>]" in result.stderr + out and out.rstrip().splitlines()[-2] == "Paris."
    assert f"checkpoints refer to the frozen base {work / 'base'}" in out
    again = subprocess.run(["bash", "examples/sft/finetune.sh", str(work)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert again.returncode == 2 and "exists; give another WORK_DIR" in again.stderr  # never overwrites
