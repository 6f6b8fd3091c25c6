"""One table for ``benchmarks/gpu_session.sh quick``: the GPU tests' outcome, then hpctrain against the compiled
PyTorch loop per preset, each against issue #36's targets.

    python benchmarks/gpu_session_table.py --junit OUT/tests-gpu.xml OUT/quick-*.json

Reads pytest's JUnit XML (passed / failed / skipped, the failures named) and ``bench_gpu_train.py``'s JSON
files. Targets: hpctrain >= 1.05x the loop's tokens/s, peak memory <= the loop's, MFU >= 38% (gpt2-small),
44% (gpt2-medium), 47% (gpt2-xl). Exit 0 whatever the numbers (timings never gate); the table says which
targets are met.
"""
from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

MFU_TARGETS = {"gpt2-small": 0.38, "gpt2-medium": 0.44, "gpt2-xl": 0.47}
RATIO_TARGET = 1.05


def test_summary(junit: Path) -> list[str]:
    """Lines: the counts, then each failed test's name and first message line."""
    if not junit.exists():
        return [f"tests/gpu: no result ({junit} missing: the stage did not run or was cut short)"]
    root = ET.parse(junit).getroot()
    cases = list(root.iter("testcase"))
    failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    lines = [f"tests/gpu: {len(cases) - len(failed) - len(skipped)} passed, {len(failed)} failed, "
             f"{len(skipped)} skipped"]
    for case in failed:
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        message = (problem.get("message") or "").strip().splitlines()[:1] if problem is not None else []
        lines.append(f"  FAILED {case.get('classname')}::{case.get('name')}: {message[0][:160] if message else ''}")
    return lines


def bench_rows(paths: list[Path]) -> list[dict]:
    """One row per preset: hpctrain's and the loop's record side by side."""
    by_preset: dict[str, dict] = {}
    for path in paths:
        data = json.loads(path.read_text())
        for record in data if isinstance(data, list) else data.get("records", []):
            by_preset.setdefault(record["preset"], {})[record["impl"]] = record
    return [{"preset": p, **pair} for p, pair in by_preset.items()]


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def bench_table(rows: list[dict]) -> list[str]:
    head = (f"{'preset':<12} {'mb':>3} {'hpctrain ms':>11} {'MFU':>6} {'loop ms':>8} {'MFU':>6} {'ratio':>6} "
            f"{'GiB h/loop':>12} {'loss h/loop':>13}  targets (ratio>={RATIO_TARGET}, MFU, memory)")
    lines = [head]
    for row in rows:
        ours, loop = row.get("hpctrain"), row.get("torch")
        if ours is None or loop is None:
            lines.append(f"{row['preset']:<12} incomplete: {'hpctrain' if ours is None else 'torch'} did not finish")
            continue
        ratio = ours["tokens_per_s"] / loop["tokens_per_s"]
        mfu_target = MFU_TARGETS.get(row["preset"])
        targets = (verdict(ratio >= RATIO_TARGET),
                   verdict(None if mfu_target is None or ours["mfu"] is None else ours["mfu"] >= mfu_target),
                   verdict(ours["peak_memory_gib"] <= loop["peak_memory_gib"]))
        lines.append(f"{row['preset']:<12} {ours['micro_batch']:>3} {ours['step_ms']:>11.1f} {percent(ours['mfu']):>6} "
                     f"{loop['step_ms']:>8.1f} {percent(loop['mfu']):>6} {ratio:>5.2f}x "
                     f"{ours['peak_memory_gib']:>5.2f}/{loop['peak_memory_gib']:<6.2f} "
                     f"{ours['final_loss']:>6.3f}/{loop['final_loss']:<6.3f}  {' '.join(targets)}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path, required=True, help="pytest --junitxml of tests/gpu")
    parser.add_argument("bench", nargs="*", type=Path, help="bench_gpu_train.py --json files")
    args = parser.parse_args(argv)
    lines = test_summary(args.junit) + [""] + bench_table(bench_rows([p for p in args.bench if p.exists()]))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
