"""docs/monitoring/: the alert rules and the Grafana dashboard name only metrics and labels hpctrain exports
(hpctrain/config/metric_names.py), cover what a centre watches, and pass promtool: `check rules`, and
`test rules` on synthetic series (each alert fires when it should and not before)."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpctrain.config.metric_names import CONSTANT_LABELS, METRICS

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "monitoring" / "hpctrain-alerts.yml"
DASHBOARD = ROOT / "docs" / "monitoring" / "grafana-dashboard.json"
TARGET_LABELS = ("job", "instance")  # what Prometheus adds to every scraped series
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not on PATH (apt install prometheus)")
GRAFANA_VARIABLES = {"$run": ".*", "$job_id": ".*", "$__rate_interval": "5m", "$__interval": "1m"}


def labels_of(name: str) -> set[str]:
    """Labels a series of metric ``name`` can carry (``up`` is Prometheus' own target metric)."""
    own = METRICS[name].labels if name in METRICS else ()
    return set(CONSTANT_LABELS) | set(own) | set(TARGET_LABELS)


def expr_problems(expr: str) -> list[str]:
    """What in a PromQL expression names a metric hpctrain does not export or a label it lacks."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals cannot name metrics or labels
    names = set(re.findall(r"\bhpctrain_[a-zA-Z0-9_]+", bare))
    problems = [f"{expr!r}: {n} is not in METRICS" for n in sorted(names - set(METRICS))]
    for metric, body in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}", bare):
        for label in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", body):
            if label not in labels_of(metric):
                problems.append(f"{expr!r}: {metric} has no label {label!r}")
    known = set().union(*(labels_of(n) for n in names)) if names else set(TARGET_LABELS)
    for clause, body in re.findall(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", bare):
        for label in filter(None, (x.strip() for x in body.split(","))):
            if label not in known:
                problems.append(f"{expr!r}: {clause} ({label}) names a label none of its metrics has")
    return problems


def dashboard_targets():
    """(panel, target) of every query on the dashboard, rows' nested panels included."""
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for top in dash["panels"] for p in [top, *top.get("panels", [])]]
    return [(p, t) for p in panels for t in p.get("targets", [])]


def test_every_dashboard_query_names_exported_metrics_and_labels():
    targets = dashboard_targets()
    assert len(targets) >= 10
    problems = [p for _, t in targets for p in expr_problems(t["expr"])]
    for panel, t in targets:
        kept = re.search(r"\bby\s*\(([^)]*)\)", t["expr"])  # an aggregation keeps only its by-labels
        known = ({x.strip() for x in kept.group(1).split(",")} if kept else
                 set().union(*(labels_of(n) for n in re.findall(r"\bhpctrain_[a-z_]+", t["expr"]))))
        problems += [f"{panel['title']}: legend {{{{{label}}}}} is not a label of {t['expr']!r}"
                     for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")) if label not in known]
        for selector in re.findall(r"hpctrain_[a-z_]+\s*\{[^}]*\}", t["expr"]):  # every query follows the pickers
            if 'run=~"$run"' not in selector or 'job_id=~"$job_id"' not in selector:
                problems.append(f"{panel['title']}: {selector} ignores the run/job_id variables")
        if t.get("datasource", panel.get("datasource")) != {"type": "prometheus", "uid": "${datasource}"}:
            problems.append(f"{panel['title']}: query does not use the $datasource variable")
    assert not problems, "\n".join(problems)


def test_the_dashboard_shows_what_a_centre_watches():
    targets = dashboard_targets()
    exprs = " ".join(t["expr"] for _, t in targets)

    def panels_with(*needles):
        return [p for p, t in targets if all(n in t["expr"] for n in needles)]

    def shown_together(*names):  # one panel draws all of these metrics
        return any(all(n in " ".join(t["expr"] for t in p["targets"]) for n in names) for p in panels_with(names[0]))
    stacked_phases = [p for p in panels_with("hpctrain_step_seconds", 'phase!="total"')
                      if p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"]
    required = {
        "loss and validation loss": shown_together("hpctrain_loss{", "hpctrain_val_loss{"),
        "tokens/s": bool(panels_with("hpctrain_tokens_per_second")),
        "MFU in percent": any(p["fieldConfig"]["defaults"]["unit"] == "percentunit"
                              for p in panels_with("hpctrain_mfu_ratio")),
        "step phases, stacked, without the total": bool(stacked_phases),
        "comm bytes rate by group": any(re.search(r"\bby\s*\([^)]*\bgroup\b", t["expr"])
                                        for _, t in targets if "rate(hpctrain_comm_bytes_total" in t["expr"]),
        "checkpoint age": "time() - hpctrain_last_checkpoint_timestamp_seconds" in exprs,
        "checkpoint seconds by phase": bool(panels_with("hpctrain_checkpoint_seconds")),
        "stragglers by rank": any("{{rank}}" in t["legendFormat"] and "{{which}}" in t["legendFormat"]
                                  for _, t in targets if "hpctrain_rank_step_seconds" in t["expr"]),
        "straggler ratio": "hpctrain_straggler_ratio" in exprs,
    }
    assert all(required.values()), [what for what, ok in required.items() if not ok]
    missing = [name for name in METRICS if not re.search(rf"\b{name}\b", exprs)]
    assert not missing, f"exported metrics without a panel on the dashboard: {missing}"


def test_the_dashboard_variables_pick_a_prometheus_run_and_job():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert 36 <= dash["schemaVersion"] <= 41
    for name in ("run", "job_id"):
        query = variables[name]["query"]["query"]
        metric, label = re.fullmatch(r"label_values\((\w+)(?:\{[^}]*\})?,\s*(\w+)\)", query).groups()
        assert metric in METRICS and label == name and label in CONSTANT_LABELS, query
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def load_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_every_alert_names_exported_metrics_and_says_what_and_where():
    rules = load_rules()
    names = {rule["alert"] for rule in rules}
    assert {"HpctrainStalled", "HpctrainLossNotFinite", "HpctrainStraggler", "HpctrainCheckpointStale"} <= names
    problems = []
    for rule in rules:
        problems += expr_problems(rule["expr"])
        where = rule["alert"]
        if not re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))):
            problems.append(f"{where}: no `for:` duration")
        if rule.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
            problems.append(f"{where}: severity must be critical, warning or info")
        notes = rule.get("annotations", {})
        if not (notes.get("summary") and notes.get("description")):
            problems.append(f"{where}: needs a summary and a description")
        known = set().union(*(labels_of(n) for n in re.findall(r"\b(hpctrain_[a-z_]+|up)\b", rule["expr"])))
        problems += [f"{where}: annotation uses $labels.{label}, which its series lack"
                     for text in notes.values() for label in re.findall(r"\$labels\.(\w+)", text) if label not in known]
    assert not problems, "\n".join(problems)


@needs_promtool
def test_promtool_accepts_the_rules_and_every_dashboard_query(tmp_path):
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    queries = []  # the dashboard's queries as recording rules: promtool parses each one
    for i, (_, t) in enumerate(dashboard_targets()):
        expr = t["expr"]
        for variable, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
            expr = expr.replace(variable, value)
        queries.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": queries}]}))
    check = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


RUN = {"run": "r1", "job_id": "4242", "layout": "dp2-pp1-tp1"}


def series(name: str, values: str, **labels) -> dict:
    body = ",".join(f'{k}="{v}"' for k, v in {**RUN, **labels}.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def severity(alert: str) -> str:
    return next(rule["labels"]["severity"] for rule in load_rules() if rule["alert"] == alert)


def fires(alert: str, at: str, value: str = None, **labels) -> dict:
    """promtool's expectation: ``alert`` firing at ``at`` (value None: not firing) with ``{{ $value }}``."""
    expected = [] if value is None else [{"exp_labels": {**RUN, **labels, "severity": severity(alert)},
                                          "exp_annotations": {"value": value}}]
    return {"eval_time": at, "alertname": alert, "exp_alerts": expected}


@needs_promtool
def test_each_alert_fires_on_the_series_it_watches_and_not_before(tmp_path):
    """The rules as shipped, with each annotation replaced by ``{{ $value }}`` (promtool compares
    annotations exactly): the value an alert reports is the age or the ratio, not a 1 from ``and``."""
    rules = yaml.safe_load(RULES.read_text())
    for rule in (r for group in rules["groups"] for r in group["rules"]):
        rule["annotations"] = {"value": "{{ $value }}"}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    down = {"job": "hpctrain", "instance": "node7:9400"}
    up_series = {"series": 'up{job="hpctrain",instance="node7:9400",run="r1",job_id="4242"}',  # file_sd labels
                 "values": "1 1 0x30"}
    tests = [{"interval": "1m", "input_series": [
        series("hpctrain_up", "1x90"),
        series("hpctrain_last_step_timestamp_seconds", "0+60x10 600x80"),  # steps stop at 10 min
        series("hpctrain_loss", "2.5 2.4 NaN NaN NaN NaN NaN Inf"),
        series("hpctrain_straggler_ratio", "1.1x5 1.5x30"),
        series("hpctrain_last_checkpoint_timestamp_seconds", "0x90"),  # one checkpoint at t=0
        up_series,
        # an ended run (hpctrain_up 0) is never stalled nor stale
        series("hpctrain_up", "0x90", run="done"),
        series("hpctrain_last_step_timestamp_seconds", "0x90", run="done"),
        series("hpctrain_last_checkpoint_timestamp_seconds", "0x90", run="done"),
    ], "alert_rule_test": [
        fires("HpctrainStalled", "24m"),  # 840 s without a step, for 4 of the 5 minutes
        fires("HpctrainStalled", "30m", "1200"),
        fires("HpctrainLossNotFinite", "2m"),
        fires("HpctrainLossNotFinite", "5m", "NaN"),
        fires("HpctrainStraggler", "14m"),
        fires("HpctrainStraggler", "16m", "1.5"),
        fires("HpctrainCheckpointStale", "70m"),
        fires("HpctrainCheckpointStale", "72m", "4320"),
        {"eval_time": "8m", "alertname": "HpctrainTargetDown", "exp_alerts": [
            {"exp_labels": {"run": "r1", "job_id": "4242", **down, "severity": severity("HpctrainTargetDown")},
             "exp_annotations": {"value": "0"}}]},
    ]}]
    path = tmp_path / "tests.yml"
    path.write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


DOC = ROOT / "docs" / "monitoring.md"


def doc_block(language: str, containing: str) -> str:
    """The first fenced ``language`` block of docs/monitoring.md that contains ``containing``."""
    blocks = re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.S)
    return next(b for b in blocks if containing in b)


def test_the_doc_metric_table_is_metrics():
    rows = [f"| `{m.name}` | {m.kind} | {', '.join(f'`{x}`' for x in m.labels) or '-'} | {m.help} |"
            for m in METRICS.values()]
    table = "\n".join(["| metric | kind | labels | meaning |", "|---|---|---|---|", *rows])
    shown = re.search(r"<!-- metrics:begin[^>]*-->\n(.*?)\n<!-- metrics:end -->", DOC.read_text(), re.S).group(1)
    assert shown == table, f"docs/monitoring.md: replace the metric table with\n{table}"


def test_hpctrain_runs_file_sd_lists_running_scraped_runs(tmp_path):
    """`hpctrain runs --file-sd` (the doc's way to feed file_sd): a running scraped job on another node is a
    target, a finished job and a textfile-only run are not (a stand-in squeue says which job runs)."""
    runs = {"live": ("101", 9400), "ended": ("102", 9401), "textfile": ("103", 0)}
    for run, (job, port) in runs.items():
        (tmp_path / "runs" / run).mkdir(parents=True)
        (tmp_path / "runs" / run / "monitor.json").write_text(json.dumps({
            "host": f"node-{run}", "port": port, "addr": "0.0.0.0", "url": f"http://node-{run}:{port}/metrics",
            "textfile": "", "job_id": job, "run": run, "pid": 1, "started": 0,
            "labels": {"run": run, "job_id": job, "layout": "dp1-pp1-tp1"}}))
    (tmp_path / "bin").mkdir()
    squeue = tmp_path / "bin" / "squeue"
    squeue.write_text('#!/bin/sh\n[ "$3" = 101 ] && echo RUNNING\nexit 0\n')
    squeue.chmod(0o755)
    command = doc_block("bash", "--file-sd").split("\n")[0].split()
    assert command[:2] == ["hpctrain", "runs"]
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, "-m", "hpctrain.cli", "runs", str(tmp_path / "runs"), "--file-sd",
                          str(tmp_path / "targets.json")], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "targets.json").read_text()) == [
        {"targets": ["node-live:9400"], "labels": {"run": "live", "job_id": "101", "layout": "dp1-pp1-tp1"}}]
    assert "live" in out.stdout and "ended" in out.stdout


@needs_promtool
def test_the_doc_prometheus_config_loads_the_rules(tmp_path):
    config = yaml.safe_load(doc_block("yaml", "scrape_configs"))
    assert config["scrape_configs"][0]["job_name"].startswith("hpctrain")  # what HpctrainTargetDown matches
    config["rule_files"] = [str(RULES)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("env, expected", [
    ({}, []),
    ({"HPCTRAIN_PROM_DIR": "/textfiles/", "SLURM_JOB_PARTITION": "gpu"},
     ["monitor.prometheus_textfile=/textfiles/hpctrain-123456.prom", "monitor.labels=partition=gpu,user=ann"]),
    ({"HPCTRAIN_PROM_PORT": "auto", "HPCTRAIN_PROM_LABELS": "cluster=frontier"},
     ["monitor.prometheus_port=23456", "monitor.prometheus_addr=0.0.0.0",
      "monitor.labels=partition=none,user=ann,cluster=frontier"]),
])
def test_train_sbatch_publishes_the_job_for_prometheus(tmp_path, env, expected):
    """slurm/train.sbatch run by bash with a stand-in srun that prints its arguments (no Slurm needed)."""
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    srun.chmod(0o755)
    base = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HPCTRAIN_DIR": str(tmp_path), "VIRTUAL_ENV": "x",
            "SLURM_JOB_ID": "123456", "SLURM_JOB_USER": "ann", "HPCTRAIN_CHECK": "0"}  # my.toml does not exist
    out = subprocess.run(["bash", str(ROOT / "slurm" / "train.sbatch"), "--config", "my.toml", "train.steps=9"],
                         capture_output=True, text=True, env={**base, **env}, timeout=60)
    assert out.returncode == 0, out.stderr
    args = out.stdout.splitlines()
    train = args.index("train")
    assert args[train + 1:] == [*expected, "--config", "my.toml", "train.steps=9"]
