"""Every `hpctrain` command quoted in the docs is checked (issue #51: run, checked, or marked illustrative).

Each `hpctrain SUBCOMMAND ...` (or `python -m hpctrain.cli ...`, after any `mpiexec -n N`/`srun`/`VAR=value`
prefix) in README.md, docs/*.md and slurm/README.md parses with hpctrain's own parser. A `train` command is also
checked by `hpctrain check`'s code (``train/preflight.py``) at its stated rank count (`mpiexec -n N`, `srun -n N`
or `-N a --ntasks-per-node=b`; 1 without a launcher), and so is the `train` of each `sbatch ... slurm/train.sbatch
ARGS`. `apptainer exec [options] IMAGE` (or `singularity exec`, `podman run`, `docker run`) before or after the
launcher is a wrapper: the command after the image is checked; a `$ ` prompt and shell keywords (`until`, ...)
are skipped. A code block whose first line is `# illustrative: <why>` (a site's paths, a model no test machine holds)
or `# historical: <why>` is skipped; every other quoted command must pass. The tests that RUN quoted commands:
tests/mpi/test_readme.py (README's Quick start, Training, Checkpoints), tests/integration/ (the sbatch template).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_doc_commands import DOCS, ROOT, SHELL_PUNCTUATION, normalise, words

LAUNCHERS = ("mpiexec", "mpirun", "srun")
SKIP_MARKS = ("# illustrative:", "# historical:")
CONTAINER_FLAGS = ("--nv", "--rocm", "--cleanenv", "--contain", "--writable-tmpfs", "--rm", "-it", "-i", "-t", "--init",
                   "--privileged")  # apptainer exec's and podman/docker run's flags without a value
SHELL_KEYWORDS = ("until", "while", "if", "then", "do", "exec", "env", "nohup", "!")


def code_lines(text: str) -> list[str]:
    """The logical lines of a Markdown file's fenced code blocks (continuations joined), minus the blocks
    marked illustrative or historical."""
    lines, block, fence = [], [], None
    for line in text.splitlines():
        stripped = line.strip()
        if fence is None:
            if stripped.startswith(("```", "~~~")):
                fence, block = stripped[:3], []
            continue
        if stripped.startswith(fence):
            if not (block and block[0].strip().startswith(SKIP_MARKS)):
                lines += re.sub(r"\\\n\s*", " ", "\n".join(block)).splitlines()
            fence = None
            continue
        block.append(line)
    return lines


def _launcher(word: str) -> bool:
    """mpiexec, mpirun, srun, or a wrapper script named after one (``/tmp/hpctrain-ns/mpiexec-2hosts``)."""
    return word in LAUNCHERS or re.fullmatch(r"(\S*/)?(mpiexec|mpirun)[\w.-]*", word) is not None


def _container(w: list[str], i: int, mounts: dict[str, str]) -> int:
    """Where the command inside ``apptainer|singularity exec [opts] IMAGE`` or ``podman|docker run [opts] IMAGE``
    starting at ``w[i]`` begins (``i`` when there is none): options with a value take the next word unless
    written ``--opt=value``. A ``-v $PWD/SRC:DST`` mount goes into ``mounts`` (DST -> SRC, the checkout's path)."""
    if w[i:i + 2] not in (["apptainer", "exec"], ["singularity", "exec"], ["podman", "run"], ["docker", "run"]):
        return i
    k = i + 2
    while k < len(w) and w[k].startswith("-"):
        if w[k] in ("-v", "--volume") and k + 1 < len(w) and w[k + 1].startswith("$PWD/"):
            source, target = w[k + 1].split(":")[:2]
            mounts[target] = source.removeprefix("$PWD/")
        k += 1 if "=" in w[k] or w[k] in CONTAINER_FLAGS else 2
    return k + 1  # after the image


def _unmount(arg: str, mounts: dict[str, str]) -> str:
    """``arg`` (a path, or ``key=path``) with a container's mount point replaced by the checkout's path."""
    key, sep, value = arg.rpartition("=")
    for target, source in mounts.items():
        if value == target or value.startswith(target + "/"):
            return key + sep + source + value[len(target):]
    return arg


def commands(line: str) -> list[tuple[int, int, list[str]]]:
    """(ranks, ranks per node or 0, hpctrain argv) of each hpctrain command on one shell line (after a ``$ ``
    prompt, shell keywords, ``VAR=value`` words, launchers and their options, and one container wrapper)."""
    found = []
    line = re.sub(r"^\s*\$ ", "", line)
    for part in re.split(r"\s(?:&&|\|\||;|\|)\s", line.split(" # ")[0]):
        part = re.sub(r"\b[A-Z_][A-Z0-9_]*=\$\([^)]*\)", "", part)  # VAR=$(command) prefixes
        w = [x for x in words(part) if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", x)]  # VAR=value prefixes
        ranks, per_node, nodes = 1, 0, 0
        i = 0
        while i < len(w) and w[i] in SHELL_KEYWORDS:
            i += 1
        mounts: dict[str, str] = {}
        while i < len(w):
            inside = _container(w, i, mounts)
            if inside != i:
                i = inside
                continue
            if not (_launcher(w[i]) or w[i] in ("timeout", "time") or w[i].startswith("-")
                    or (i > 0 and w[i - 1] in ("-n", "-np", "-N", "--ntasks", "--nodes", "-ppn"))
                    or re.fullmatch(r"\d+[smh]?", w[i])):
                break
            if w[i] in ("-n", "-np", "--ntasks") and i + 1 < len(w):
                ranks = int(w[i + 1]) if w[i + 1].isdigit() else ranks
            if w[i] in ("-N", "--nodes") and i + 1 < len(w) and w[i + 1].isdigit():
                nodes = int(w[i + 1])
            if w[i].startswith("--ntasks-per-node="):
                per_node = int(w[i].split("=", 1)[1])
            i += 1
        if per_node:  # srun inside an allocation: -N nodes (1 unless given) x --ntasks-per-node
            ranks = max(nodes, 1) * per_node
        rest = [_unmount(x, mounts) for x in w[i:]]
        if rest[:1] == ["hpctrain"]:
            argv = rest[1:]
        elif len(rest) >= 3 and re.search(r"(^|/)python3?$", rest[0]) and rest[1:3] == ["-m", "hpctrain.cli"]:
            argv = rest[3:]
        elif rest[:1] == ["sbatch"]:
            j = next((k for k, x in enumerate(rest) if x.endswith("slurm/train.sbatch")), None)
            if j is None:
                continue
            for x in rest[1:j]:
                if x.startswith("--ntasks-per-node="):
                    per_node = int(x.split("=", 1)[1])
            n = next((int(rest[k + 1]) for k in range(1, j) if rest[k] in ("-N", "--nodes")
                      and rest[k + 1].isdigit()), 1)
            script = [x for x in rest[j + 1:] if not x.startswith(("--restarts", "--spare-nodes"))]
            argv, ranks = ["train", *script], n * (per_node or 4)  # the template's --ntasks-per-node=4
        else:
            continue
        cut = next((k for k, x in enumerate(argv) if set(x) <= set(SHELL_PUNCTUATION)), len(argv))
        found.append((ranks, per_node, normalise(argv[:cut])))
    return found


def quoted() -> list[tuple[str, int, int, list[str], frozenset]]:
    """(where, ranks, ranks per node, argv, the files earlier commands of the same doc write with --out)."""
    out = []
    for doc in DOCS:
        made: set[str] = set()
        for line in code_lines(doc.read_text(encoding="utf-8")):
            for ranks, per_node, argv in commands(line):
                if argv and not argv[0].startswith("-") and not argv[0].endswith(":"):  # not a printed line
                    out.append((f"{doc.relative_to(ROOT)}: {line.strip()[:150]}", ranks, per_node, argv,
                                frozenset(made)))
                    made |= {argv[k + 1] for k in range(len(argv) - 1) if argv[k] == "--out"}
    return out


QUOTED = quoted()


def test_the_docs_quote_hpctrain_commands():
    assert len(QUOTED) > 40 and sum(q[3][0] == "train" for q in QUOTED) > 10, len(QUOTED)


@pytest.mark.parametrize("where, ranks, per_node, argv, made", QUOTED, ids=[q[0][:80] for q in QUOTED])
def test_each_quoted_hpctrain_command_parses_and_trains_pass_check(where, ranks, per_node, argv, made, monkeypatch):
    from hpctrain.cli import build_parser

    monkeypatch.chdir(ROOT)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `hpctrain {' '.join(argv)}` does not parse")
    if extra and not (getattr(args, "overrides", None) is not None and all("=" in e for e in extra)):
        pytest.fail(f"{where}: unrecognized arguments {extra}")
    if argv[0] != "train":
        return
    from hpctrain.config.load import read_config
    from hpctrain.train.preflight import check_job

    overrides = list(args.overrides) + list(extra)
    report = check_job(read_config(args.config, overrides), ranks, per_node, resume=None)
    problems = [p for p in report.problems  # a corpus an earlier command of the doc prepares (--out) is there
                if not any(p.startswith(f"data source {path!r}: path does not exist") for path in made)]
    assert not problems, f"{where}: at {ranks} ranks: {problems}"


def test_the_extraction_sees_through_prompts_loops_wrappers_and_containers():
    assert commands("$ mpiexec -n 4 hpctrain train --config configs/tiny.toml") == [
        (4, 0, ["train", "--config", "configs/tiny.toml"])]
    assert commands("until mpiexec -n 8 hpctrain train --resume auto; [ $? -ne 75 ]; do :; done")[0] == (
        8, 0, ["train", "--resume", "auto"])
    assert commands("/tmp/ns/mpiexec-2hosts -n 4 -ppn 2 hpctrain info") == [(4, 0, ["info"])]
    assert commands("srun --mpi=pmi2 -N 2 --ntasks-per-node=4 apptainer exec --nv --bind /a:/a img.sif "
                    "hpctrain train x.y=1") == [(8, 4, ["train", "x.y=1"])]
    assert commands('podman run --rm -v "$PWD/configs:/configs:ro" img mpiexec -n 2 hpctrain train '
                    "--config /configs/tiny.toml") == [(2, 0, ["train", "--config", "configs/tiny.toml"])]
    assert commands("X=$(mktemp -d) mpiexec -n 2 hpctrain bench comm") == [(2, 0, ["bench", "comm"])]
