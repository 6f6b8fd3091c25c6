"""Every benchmark command quoted in the docs parses with its script's own argument parser.

A command is `python benchmarks/<name>.py ARGS` (any python path, `-m mpi4py`, an `mpiexec`/`mpirun`/`srun`
prefix and `VAR=value` words before it) in README.md, docs/*.md or slurm/README.md: in a code block (a
backslash-newline continues the line, `#` starts a comment) or an inline code span. ARGS go to the script's
`parse_args` when it has one, else through its `__main__` with `argparse.ArgumentParser.parse_args` patched to
stop right after parsing: nothing is run. `$VAR`, `${VAR}` and `<placeholder>` words stand for a value ("1"),
`[--opt value]` is an optional part (parsed with it), `{a,b}` takes its first choice. A fenced block whose
first line is `# historical: <why>` is skipped: a command kept as an older version of a script took it.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "slurm" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPT = re.compile(r"(?:^|/)benchmarks/([A-Za-z0-9_]+)\.py$")
SHELL_PUNCTUATION = ";&|<>()"
PYTHON = re.compile(r"(^|/)python(3(\.\d+)?)?$|^\$\{?PYTHON\}?$")


def code_snippets(text: str) -> list[str]:
    """Code blocks' logical lines and inline code spans of one Markdown file, continuations joined."""
    snippets, prose, block, fence, indented = [], [], [], None, False
    for line in text.splitlines():
        stripped = line.strip()
        if fence is not None:
            if stripped.startswith(fence):
                if not (block and block[0].strip().startswith("# historical:")):
                    snippets += logical_lines(block)
                block, fence = [], None
            else:
                block.append(line)
            continue
        if stripped.startswith("```") or stripped.startswith("~~~"):
            fence = stripped[:3]
            continue
        if line.startswith("    ") and (indented or not prose or not prose[-1].strip()) and stripped:
            block.append(line)  # an indented code block (after a blank line, or continuing one)
            indented = True
            continue
        if indented:
            snippets += logical_lines(block)
            block, indented = [], False
        prose.append(line)
    snippets += logical_lines(block)
    flowing = re.sub(r"\\\n\s*", " ", "\n".join(prose))
    snippets += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", flowing)]
    return snippets


def logical_lines(lines: list[str]) -> list[str]:
    return re.sub(r"\\\n", " ", "\n".join(lines)).splitlines()


def words(snippet: str) -> list[str]:
    snippet = re.sub(r"<[A-Za-z_][\w .:-]*>", "1", snippet)  # a <placeholder>, not a redirection
    lexer = shlex.shlex(snippet, posix=True, punctuation_chars=SHELL_PUNCTUATION)
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # an unbalanced quote: prose, not a command
        return []


def benchmark_commands(snippet: str) -> list[tuple[str, list[str]]]:
    """(script name, argv) for each `python benchmarks/<name>.py ...` in one snippet."""
    found, w = [], words(snippet)
    for i, word in enumerate(w):
        match = SCRIPT.search(word)
        if not match:
            continue
        j = i - 1
        if j >= 1 and w[j - 1] == "-m" and w[j] == "mpi4py":
            j -= 2
        if j < 0 or not PYTHON.search(w[j]):
            continue  # a mention of the file, not a python command line
        argv = []
        for arg in w[i + 1:]:
            if set(arg) <= set(SHELL_PUNCTUATION):  # | && ; > < ( ): the command ends
                if argv and argv[-1].isdigit() and arg[0] in "<>":
                    argv.pop()  # the 2 of 2>&1
                break
            argv.append(arg)
        found.append((match.group(1), normalise(argv)))
    return found


def normalise(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        arg = arg.strip("[]") if arg.startswith("[") or arg.endswith("]") else arg
        arg = re.sub(r"\{([^{},]*),[^{}]*\}", r"\1", arg)
        out.append(re.sub(r"\$\{?\w+\}?", "1", arg))
    return [a for a in out if a]


def quoted_commands() -> list[tuple[str, str, list[str]]]:
    commands = []
    for doc in DOCS:
        for snippet in code_snippets(doc.read_text(encoding="utf-8")):
            for name, argv in benchmark_commands(snippet):
                commands.append((str(doc.relative_to(ROOT)), name, argv))
    return commands


class Parsed(BaseException):
    """Raised by the patched ``parse_args`` once a script's arguments parsed (a BaseException: the scripts'
    ``run_benchmark`` turns an ``Exception`` into an exit)."""


def parse_with_script(name: str, argv: list[str]) -> None:
    """Parse ``argv`` with benchmarks/<name>.py's own parser without running the benchmark; an error exits 2."""
    path = ROOT / "benchmarks" / f"{name}.py"
    assert path.is_file(), f"benchmarks/{name}.py does not exist"
    source = path.read_text(encoding="utf-8")
    if "from hpctrain.cli import main" in source:  # a front for `hpctrain bench comm`: dispatch's parsing
        from hpctrain.cli import build_parser

        parser = build_parser()
        _, extra = parser.parse_known_args(["bench", "comm", *argv])
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return
    if "parse_args" not in source:
        assert not argv, f"benchmarks/{name}.py takes no arguments, the docs pass {argv}"
        return
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    environ, old_argv = dict(os.environ), sys.argv
    sys.argv = [str(path), *argv]
    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[method-assign]
    try:
        if re.search(r"^def parse_args\(argv", source, re.M):
            spec = importlib.util.spec_from_file_location(f"_doc_command_{name}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)  # the scripts guard on __main__: nothing runs
            module.parse_args(argv)
        else:  # the parser is built inside main(): run it as __main__, stopped right after parsing
            runpy.run_path(str(path), run_name="__main__")
        pytest.fail(f"benchmarks/{name}.py finished without parsing its arguments")
    except Parsed:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        sys.argv = old_argv
        os.environ.clear()
        os.environ.update(environ)


COMMANDS = quoted_commands()


def test_the_docs_quote_benchmark_commands():
    names = {name for _, name, _ in COMMANDS}
    assert len(COMMANDS) >= 30 and {"bench_train", "bench_gpu_train", "bench_checkpoint"} <= names, COMMANDS


@pytest.mark.parametrize("doc,name,argv", COMMANDS, ids=[f"{d}:{n}:{i}" for i, (d, n, _) in enumerate(COMMANDS)])
def test_quoted_benchmark_command_parses(doc, name, argv):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_with_script(name, argv)
    except SystemExit as exc:
        pytest.fail(f"{doc}: `python benchmarks/{name}.py {shlex.join(argv)}` does not parse "
                    f"(exit {exc.code}): {err.getvalue().strip().splitlines()[-1:]}")


def test_an_unknown_flag_fails():
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parse_with_script("bench_train", ["--json", "x.json", "--no-such-flag"])
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parse_with_script("bench_monitor", ["--rounds", "2", "--bogus", "1"])


def test_the_extraction_reads_continuations_comments_and_placeholders():
    text = ("Run\n\n```bash\nOMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_train.py --json $OUT/a.json \\\n"
            "    --rounds <n>   # x3\n```\n\nand `python -m mpi4py benchmarks/bench_checkpoint.py --parts io\n"
            "[--writers mpio] 2>&1 | tee log` or `benchmarks/bench_lora.py` alone, `mpiexec -n {2,4} python x.py`.\n\n"
            "```\n# historical: an older script\npython benchmarks/bench_gpu_train.py --batch 8\n```\n")
    found = [c for s in code_snippets(text) for c in benchmark_commands(s)]
    assert found == [("bench_train", ["--json", "1/a.json", "--rounds", "1"]),
                     ("bench_checkpoint", ["--parts", "io", "--writers", "mpio"])]


def test_the_readme_stays_short():
    """Issue #51: the README is under 120 lines and no prose line is over 200 characters (code blocks aside)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 120, f"README.md has {len(lines)} lines: move detail to docs/"
    in_code, long = False, []
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            in_code = not in_code
        elif not in_code and len(line) > 200:
            long.append(number)
    assert not long, f"README.md lines over 200 characters: {long}"
