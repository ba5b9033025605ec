"""The Containerfile, read as a builder would: two stages, a final stage on python:3.11-slim
that runs as a non-root user with no build tools, copies only files that exist and that
.containerignore lets into the context, checks /health, exposes the ports the Kubernetes
manifests use, and by default runs the router on /etc/continuum/config.yaml.

The image itself is built in tests/integration/test_image.py where a builder works.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "Containerfile"
BUILD_TOOLS = ("gcc", "g++", "cc", "make", "build-essential", "apt-get", "apt", "pip")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Containerfile; continuation lines joined."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    logical = re.sub(r"\\\n", " ", text)
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op = op.upper()
        rest = rest.strip()
        if op == "FROM":
            parts = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], parts[0])
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base, name))
        elif op == "ARG" and not stages:
            key, _, value = rest.partition("=")
            args[key] = value
        else:
            stages[-1].instructions.append((op, rest))
    return args, stages


def build_tools_in(stage: Stage) -> list[str]:
    words = set(re.split(r"[\s;&|()]+", " ".join(stage.all("RUN"))))
    return [tool for tool in BUILD_TOOLS if tool in words]


def _parsed() -> tuple[dict[str, str], list[Stage]]:
    return parse(CONTAINERFILE.read_text())


def test_two_stages_and_a_slim_python_311_final_stage() -> None:
    _, stages = _parsed()
    assert len(stages) == 2
    builder, final = stages
    assert builder.name == "builder"
    assert final.base == builder.base
    assert re.fullmatch(r"(docker\.io/library/)?python:3\.11-slim", final.base)


def test_the_final_stage_has_no_build_tools_and_runs_unprivileged() -> None:
    _, (_, final) = _parsed()
    assert build_tools_in(final) == []
    (user,) = final.all("USER")
    uid = user.split(":")[0]
    assert uid not in ("0", "root") and uid.isdigit(), "numeric, so runAsNonRoot can check it"
    copies = final.all("COPY")
    assert any(c.startswith("--from=builder /opt/continuum ") for c in copies)
    # The builder's pip is removed from the virtualenv that is copied over.
    assert "pip uninstall -y pip" in " ".join(_builder_runs())


def _builder_runs() -> list[str]:
    _, (builder, _) = _parsed()
    return builder.all("RUN")


def test_the_builder_checks_both_console_scripts() -> None:
    runs = " ".join(_builder_runs())
    assert "continuum-router --help" in runs and "continuum-kv-listener --help" in runs


def _ignored(path: str, patterns: list[str]) -> bool:
    """.containerignore semantics (last matching pattern wins, ``!`` re-includes)."""
    verdict = False
    for p in patterns:
        negate = p.startswith("!")
        pat = p[1:] if negate else p
        pat = pat.rstrip("/")
        parts = path.split("/")
        hit = any(fnmatch.fnmatch("/".join(parts[: i + 1]), pat) for i in range(len(parts)))
        if pat.startswith("**/"):
            hit = hit or any(fnmatch.fnmatch(x, pat[3:]) for x in parts)
        if hit:
            verdict = not negate
    return verdict


def test_every_copied_path_exists_and_is_in_the_build_context() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".containerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    _, stages = _parsed()
    sources = []
    for stage in stages:
        for copy in stage.all("COPY"):
            words = shlex.split(copy)
            if any(w.startswith("--from=") for w in words):
                continue
            sources += [w for w in words[:-1] if not w.startswith("--")]
    assert sources
    for src in sources:
        path = ROOT / src
        assert path.exists(), src
        files = [path] if path.is_file() else [p for p in path.rglob("*.py")]
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            assert not _ignored(rel, patterns), f"{rel} is excluded by .containerignore"
    # and what must never be sent: local secrets, the virtualenv, the git directory
    for private in (
        "deploy/k8s/base/secrets/admin-token",
        ".venv/bin/python",
        ".git/config",
        "router/__pycache__/app.cpython-311.pyc",
    ):
        assert _ignored(private, patterns), private


def test_healthcheck_ports_and_default_command() -> None:
    _, (_, final) = _parsed()
    (check,) = final.all("HEALTHCHECK")
    assert "CONTINUUM_HEALTH_URL" in check
    env = " ".join(final.all("ENV"))
    assert "CONTINUUM_HEALTH_URL=http://127.0.0.1:8080/health" in env
    exposed = {int(p) for e in final.all("EXPOSE") for p in e.split()}
    manifest_ports = set()
    for f in (ROOT / "deploy" / "k8s").rglob("*.yaml"):
        for doc in yaml.safe_load_all(f.read_text()):
            if isinstance(doc, dict) and doc.get("kind") in ("Deployment", "DaemonSet"):
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    if c["image"].startswith("continuum:"):
                        manifest_ports |= {
                            p["containerPort"] for p in c.get("ports", []) if "hostPort" not in p
                        }
    assert manifest_ports == exposed == {8080, 9443, 7817}
    (cmd,) = final.all("CMD")
    assert yaml.safe_load(cmd) == [
        "continuum-router",
        "serve",
        "--config",
        "/etc/continuum/config.yaml",
    ]


def test_the_parser_sees_a_build_tool_in_a_final_stage() -> None:
    bad = CONTAINERFILE.read_text() + "\nRUN apt-get install -y gcc\n"
    _, (_, final) = parse(bad)
    assert build_tools_in(final) == ["gcc", "apt-get"]
