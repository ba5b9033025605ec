"""The deployment kit's artifacts: alert rules, their promtool tests, the dashboard, the runbook.

What an operator relies on:

* ``deploy/prometheus/alerts.yaml`` loads in Prometheus (``promtool check rules``) and each
  alert fires when it should and stays quiet when it should not (``promtool test rules
  deploy/prometheus/alerts_test.yaml``, which covers every alert both ways);
* every alert carries ``for:``, a severity, a summary, a description and a runbook link
  to a section of ``deploy/README.md`` that exists;
* the dashboard imports (valid JSON, a Prometheus data source variable, a ``backend``
  variable), every panel has a query, and every query is PromQL that Prometheus's parser
  accepts, with ratios of rates aggregated with ``sum`` on both sides;
* every config recipe of the runbook is accepted by ``continuum-router config validate`` or
  ``continuum-kv-listener --check``.

promtool is Debian's ``prometheus`` package; without it these tests skip, except in CI
(``CONTINUUM_REQUIRE_REDIS=1``, set by ``.ci/run``, which installs it): there they fail.
That the queries name real series is checked against running processes in
``tests/integration/test_observability_metrics.py``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from certs import dev_bundle
from tests import promql
from tests.redis_fixture import require_redis

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts_test.yaml"
RUNBOOK = DEPLOY / "README.md"
SEVERITIES = {"critical", "warning", "info"}

SEED_PANELS = {
    "Overflow rate",
    "Load per backend",
    "Response cache hit rate",
    "Response cache bypass rate",
    "Redis p99 GET latency",
    "Redis errors",
    "Fallback active",
    "KV-aware routing rate",
    "Event drop rate per backend",
    "Overlap score p50",
    "Disconnected consumers",
    "Conversation routing decisions",
    "Held tokens routed to per backend",
    "Predicted vs delivered per backend",
    "Prediction error quantiles",
    "Accuracy per backend",
}
"""The panels the runbook's monitoring advice names."""


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        message = "promtool not installed (Debian package prometheus)"
        if require_redis():
            pytest.fail(message + "; CI installs it in .ci/run")
        pytest.skip(message)
    return found


def promtool_run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def run_promtool(*args: str, cwd: Path) -> str:
    """promtool's output; fails the test on a non-zero exit."""
    done = promtool_run(*args, cwd=cwd)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DEPLOY / "grafana" / "continuum.json").read_text())
    return data


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    anchors = set()
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6}\s+(.+?)\s*$", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).lower().replace("`", ""))
            anchors.add(text.replace(" ", "-"))
    return anchors


# -- alert rules ---------------------------------------------------------------------------


def test_rules_load_in_prometheus() -> None:
    out = run_promtool("check", "rules", ALERTS.name, cwd=ALERTS.parent)
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


def test_rules_unit_tests_pass() -> None:
    out = run_promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert "SUCCESS" in out


def test_rules_unit_tests_fail_when_an_alert_misbehaves(tmp_path: Path) -> None:
    """The promtool suite has teeth: with every ``for:`` dropped, alerts fire too early
    and the suite fails."""
    rules = re.sub(r"(?m)^(\s+)for: \S+$", r"\1for: 0s", ALERTS.read_text(encoding="utf-8"))
    (tmp_path / ALERTS.name).write_text(rules, encoding="utf-8")
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    done = promtool_run("test", "rules", ALERT_TESTS.name, cwd=tmp_path)
    assert done.returncode != 0
    for rule in alert_rules():
        assert rule["alert"] in done.stdout + done.stderr


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    doc = yaml.safe_load(ALERT_TESTS.read_text(encoding="utf-8"))
    firing: set[str] = set()
    quiet: set[str] = set()
    for test in doc["tests"]:
        for case in test.get("alert_rule_test") or []:
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert names - firing == set(), "never tested firing"
    assert names - quiet == set(), "never tested quiet"


def test_every_alert_has_for_severity_annotations_and_a_runbook_section() -> None:
    anchors = github_anchors(RUNBOOK.read_text(encoding="utf-8"))
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {
        "ContinuumResponseCacheFallback",
        "ContinuumKvIndexFallback",
        "ContinuumKvConsumerDisconnected",
        "ContinuumKvEventsDropped",
        "ContinuumKvAwareRateCollapse",
        "ContinuumBackendEjected",
        "ContinuumPredictionErrorHigh",
    }
    for rule in rules:
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        notes = rule["annotations"]
        assert notes["summary"].strip() and notes["description"].strip(), name
        path, _, anchor = notes["runbook_url"].partition("#")
        assert path == "deploy/README.md", name
        assert anchor == name.lower() and anchor in anchors, f"{name}: no runbook section"


# -- dashboard -----------------------------------------------------------------------------


def test_dashboard_imports_with_its_variables_and_a_query_per_panel() -> None:
    dash = dashboard()
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    backend = variables["backend"]
    assert backend["type"] == "query" and backend["includeAll"] and backend["multi"]
    panels = promql.dashboard_panels(dash)
    ids = [p["id"] for p in promql.walk_panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        targets = p["targets"]
        assert targets, f"panel {p['title']!r} has no query"
        assert len({t["refId"] for t in targets}) == len(targets), p["title"]
        for t in targets:
            assert t["expr"].strip(), p["title"]
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
    assert SEED_PANELS <= {p["title"] for p in panels}


def test_dashboard_and_rules_are_valid_promql(tmp_path: Path) -> None:
    """Prometheus's own parser reads every expression (as recording rules)."""
    exprs = promql.all_expressions()
    rules = {
        "groups": [
            {
                "name": "expressions",
                "rules": [
                    {"record": f"continuum:expr_{i}", "expr": e} for i, (_, e) in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "exprs.yaml"
    path.write_text(yaml.safe_dump(rules), encoding="utf-8")
    out = run_promtool("check", "rules", path.name, cwd=tmp_path)
    assert f"SUCCESS: {len(exprs)} rules found" in out


def test_promql_check_rejects_a_broken_expression(tmp_path: Path) -> None:
    rules = {"groups": [{"name": "g", "rules": [{"record": "r", "expr": "sum(rate(x[5m])"}]}]}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(rules), encoding="utf-8")
    done = promtool_run("check", "rules", "bad.yaml", cwd=tmp_path)
    assert done.returncode != 0


def test_ratios_of_rates_are_aggregated_on_both_sides() -> None:
    """``rate(a) / rate(b)`` divides series by series and breaks when a label differs;
    every ratio here is ``sum(rate(a)) / sum(rate(b))`` (by whatever it is per)."""
    for where, expr in promql.all_expressions():
        flat = " ".join(expr.split())
        if "/" not in flat:
            continue
        for side in flat.split("/"):
            side = side.strip().lstrip("(").strip()
            if "rate(" in side:
                assert side.startswith("sum"), f"{where}: {expr}"


def test_every_expression_names_continuum_series() -> None:
    for where, expr in promql.all_expressions():
        refs = promql.references(expr)
        assert refs.selectors, where
        for sel in refs.selectors:
            assert sel.metric.startswith("continuum_"), f"{where}: {sel}"


# -- the PromQL scanner the metric check relies on -----------------------------------------


def test_scanner_reads_selectors_grouping_and_matchers() -> None:
    refs = promql.references(
        'sum by (backend, le) (rate(a_bucket{backend=~"x|y", le="-1024.0"}[5m]))\n'
        "/ on (backend) group_left (kind) max without (instance) (b) > bool 0.5 offset 1h"
    )
    assert [s.metric for s in refs.selectors] == ["a_bucket", "b"]
    assert refs.selectors[0].matchers == {("backend", "=~", "x|y"), ("le", "=", "-1024.0")}
    assert refs.grouping == {"backend", "le", "kind", "instance"}


@pytest.mark.parametrize(
    "expr",
    ['a{b="x}', "a{b}", 'a{b="x"', "rate(a[5m)", "sum by (a-b) (x)", "a ? b"],
)
def test_scanner_refuses_what_it_cannot_read(expr: str) -> None:
    with pytest.raises(promql.PromqlError):
        promql.references(expr)


_names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True).filter(
    lambda n: n not in promql.RESERVED
)
_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=12)


@given(
    metric=_names,
    matchers=st.dictionaries(_names, st.tuples(st.sampled_from(["=", "!=", "=~", "!~"]), _values)),
    by=st.lists(_names, max_size=3),
)
def test_scanner_round_trips_generated_selectors(
    metric: str, matchers: dict[str, tuple[str, str]], by: list[str]
) -> None:
    body = ", ".join(f"{k}{op}{json.dumps(v)}" for k, (op, v) in matchers.items())
    expr = f"sum by ({', '.join(by)}) (rate({metric}{{{body}}}[5m]))"
    refs = promql.references(expr)
    assert refs.selectors == [
        promql.Selector(metric, frozenset((k, op, v) for k, (op, v) in matchers.items()))
    ]
    assert refs.grouping == set(by)


# -- runbook -------------------------------------------------------------------------------


def recipes() -> list[tuple[str, str]]:
    """``(first line, yaml)`` of every config block of the runbook."""
    text = RUNBOOK.read_text(encoding="utf-8")
    return [
        (block.splitlines()[0], block)
        for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)
    ]


def _materialise(block: str, root: Path) -> str:
    """The block with ``/etc/continuum/`` moved under ``root``, every file it names there:
    certificates from a fresh development CA, tokens as random text."""
    bundle = dev_bundle(root / "pki", hostnames=("router-a.example.com",), clients=("listener",))
    text = block.replace("/etc/continuum/", f"{root}/etc/continuum/")
    for raw in re.findall(rf"{re.escape(str(root))}/etc/continuum/[\w./-]+", text):
        path = Path(raw)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix in (".crt", ".pem"):
            source = bundle["ca"].cert if "ca" in path.name else bundle["server"].cert
            shutil.copy(source, path)
        elif path.suffix == ".key":
            shutil.copy(bundle["server"].key, path)
        else:
            path.write_text("rotate-me-0123456789abcdef\n", encoding="utf-8")
    return text


def test_runbook_has_the_tiered_recipes() -> None:
    heads = [head for head, _ in recipes()]
    assert len([h for h in heads if h.startswith("# continuum-router:")]) == 5, heads
    assert len([h for h in heads if h.startswith("# continuum-kv-listener:")]) == 2, heads
    text = RUNBOOK.read_text(encoding="utf-8")
    assert "`k8s/`" in text


@pytest.mark.parametrize("index", range(len(recipes())), ids=[h for h, _ in recipes()])
def test_runbook_recipe_is_a_valid_config(index: int, tmp_path: Path) -> None:
    head, block = recipes()[index]
    path = tmp_path / "config.yaml"
    path.write_text(_materialise(block, tmp_path), encoding="utf-8")
    if head.startswith("# continuum-router:"):
        cmd = [sys.executable, "-m", "router", "config", "validate", str(path)]
    elif head.startswith("# continuum-kv-listener:"):
        cmd = [sys.executable, "-m", "listener", "--config", str(path), "--check"]
    else:
        pytest.fail(f"a runbook YAML block must say whose config it is: {head!r}")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
