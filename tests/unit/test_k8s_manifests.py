"""deploy/k8s: both overlays render, every object is valid for Kubernetes 1.32 (schemas of
the ``kubernetes-validate`` package, offline; cert-manager's objects against the vendored
CRD subset in tests/fixtures/k8s), every embedded router and listener config passes our
own ``config validate`` / ``--check`` with the pod's files in place, and the parts fit
together: probes, ports, grace periods, secret paths, certificates, network policies.

Rendering needs ``kubectl`` (its built-in kustomize); without it those tests skip and the
per-file checks still run. tests/integration/test_k8s_configs_run.py starts the real
processes on the same configs and asks their probe paths.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from listener import cli as listener_cli
from router import cli as router_cli
from tests.k8s_support import (
    K8S,
    OUTSIDE,
    OVERLAYS,
    ROOT,
    ContinuumContainer,
    Obj,
    absolute_paths,
    allowed,
    config_text,
    continuum_containers,
    find,
    lay_out,
    mounted_files,
    pod_labels,
    render,
    reroot,
)

K8S_VERSION = "1.32.0"
CERT_MANAGER_SCHEMA = json.loads(
    (ROOT / "tests" / "fixtures" / "k8s" / "cert-manager-v1.schema.json").read_text()
)
NODE = "gpu-node-a"  # the node the push overlay's router config names

needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (for kustomize) is not installed"
)


def validate_object(obj: Obj) -> None:
    if obj["apiVersion"].startswith("cert-manager.io/"):
        schema = {**CERT_MANAGER_SCHEMA[obj["kind"]], "$defs": CERT_MANAGER_SCHEMA["$defs"]}
        jsonschema.validate(obj, schema)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (for kustomize) is not installed")
    return {name: render(name, tmp_path_factory.mktemp(name)) for name in OVERLAYS}


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest, rendered: dict[str, list[Obj]]) -> Any:
    return request.param, rendered[request.param]


def manifest_files() -> list[Path]:
    return sorted(
        p
        for p in K8S.rglob("*.yaml")
        if p.name != "kustomization.yaml" and any("kind" in d for d in _docs(p))
    )


def _docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]


# --- each file on its own (no kubectl needed) ----------------------------------------------


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_file_is_valid(path: Path) -> None:
    for obj in _docs(path):
        validate_object(obj)


def test_the_validators_refuse_what_the_api_server_would() -> None:
    deployment = _docs(K8S / "base" / "router.yaml")[0]
    typo = json.loads(json.dumps(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(typo)
    cert = _docs(K8S / "overlays" / "push" / "certificates.yaml")[-1]
    for broken in ({"usages": ["client-auth"]}, {"secretName": None}):
        bad = json.loads(json.dumps(cert))
        bad["spec"].update(broken)
        bad["spec"] = {k: v for k, v in bad["spec"].items() if v is not None}
        with pytest.raises(jsonschema.ValidationError):
            validate_object(bad)


def test_no_token_is_committed() -> None:
    """The Secrets come from files make-secrets.sh writes; git ignores them."""
    for folder in (K8S / "base" / "secrets", K8S / "overlays" / "push" / "secrets"):
        assert (folder / ".gitignore").read_text().splitlines()[-2:] == ["*", "!.gitignore"]


# --- rendered overlays ----------------------------------------------------------------------


@needs_kubectl
def test_every_rendered_object_is_valid(overlay: Any) -> None:
    _, objs = overlay
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget"} <= kinds
    assert {"HorizontalPodAutoscaler", "NetworkPolicy"} <= kinds
    for obj in objs:
        validate_object(obj)
        assert obj["kind"] == "Namespace" or obj["metadata"]["namespace"] == "continuum"


def configs(objs: list[Obj]) -> list[tuple[ContinuumContainer, dict[str, Any]]]:
    return [(c, yaml.safe_load(config_text(objs, c, NODE))) for c in continuum_containers(objs)]


def _validate_in_pod(objs: list[Obj], c: ContinuumContainer, root: Path) -> tuple[int, str]:
    """Our own validator on the config, with the pod's mounted files under ``root``."""
    lay_out(mounted_files(objs, c.pod, c.container), root)
    config = reroot(yaml.safe_load(config_text(objs, c, NODE)), root)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        if c.program == "continuum-router":
            rc = router_cli.main(["config", "validate", str(path)])
        else:
            rc = listener_cli.main(["--config", str(path), "--check"])
    return rc, out.getvalue()


@needs_kubectl
def test_every_embedded_config_passes_our_validator(overlay: Any, tmp_path: Path) -> None:
    name, objs = overlay
    containers = continuum_containers(objs)
    programs = sorted(c.program for c in containers)
    expected = {"pull": 2, "push": 3}[name]  # router + sidecar (+ DaemonSet listener)
    assert len(containers) == expected and programs[-1] == "continuum-router"
    for i, c in enumerate(containers):
        rc, out = _validate_in_pod(objs, c, tmp_path / str(i))
        assert rc == 0, f"{c.name}: {out}"
        assert "ok (0 warning(s))" in out, f"{c.name}: {out}"


@needs_kubectl
def test_a_config_path_no_mount_provides_fails_validation(overlay: Any, tmp_path: Path) -> None:
    """The check above means something: drop the admin token's volume and it fails."""
    _, objs = overlay
    router = next(c for c in continuum_containers(objs) if c.program == "continuum-router")
    mounts = [m for m in router.container["volumeMounts"] if m["name"] != "admin-token"]
    broken = ContinuumContainer(
        router.workload,
        router.pod,
        {**router.container, "volumeMounts": mounts},
        router.program,
        router.config_path,
    )
    rc, out = _validate_in_pod(objs, broken, tmp_path)
    assert rc == 1 and "server.admin_token_file" in out


@needs_kubectl
def test_config_files_are_mounted_from_the_right_objects(overlay: Any) -> None:
    """Every absolute path a config names is a key of a volume mounted at its folder (or
    an emptyDir), so the Secrets' mount paths equal the configs' token and cert paths."""
    _, objs = overlay
    for c, config in configs(objs):
        files = mounted_files(objs, c.pod, c.container)
        for where, path in absolute_paths(config):
            assert path in files, f"{c.name}: {where} = {path} is not mounted"


@needs_kubectl
def test_probes_ask_the_health_route_on_the_listen_port(overlay: Any) -> None:
    _, objs = overlay
    # the routes the two servers register
    assert '("GET", "/health")' in (ROOT / "router" / "app.py").read_text()
    assert 'add_get("/health"' in (ROOT / "listener" / "sse_server.py").read_text()
    for c, config in configs(objs):
        listen = config["server"]["listen"] if c.program == "continuum-router" else config["listen"]
        host, port = listen.rsplit(":", 1)
        assert host == "0.0.0.0", f"{c.name}: the kubelet probes the pod IP"
        ports = {p["name"]: p["containerPort"] for p in c.container["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            get = c.container[probe]["httpGet"]
            assert get["path"] == "/health", c.name
            assert ports[get["port"]] == int(port), f"{c.name}: {probe}"


@needs_kubectl
def test_the_router_drains_within_the_grace_period(overlay: Any) -> None:
    _, objs = overlay
    for c, config in configs(objs):
        if c.program != "continuum-router":
            continue
        command = c.container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        pre_stop = float(command[1])
        grace_ms = config["server"]["shutdown_grace_ms"]
        period = c.pod["terminationGracePeriodSeconds"]
        assert period >= pre_stop + grace_ms / 1000, (period, pre_stop, grace_ms)


def _service_target(objs: list[Obj], url: str) -> tuple[Obj, int]:
    """The Service a URL's host names and the container port its port maps to."""
    parts = urlsplit(url)
    svc = find(objs, "Service", parts.hostname or "")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    entry = next(p for p in svc["spec"]["ports"] if p["port"] == port)
    return svc, entry["targetPort"]


def _container_serving(objs: list[Obj], svc: Obj, target: Any) -> int:
    """The containerPort of the Service's pods that a targetPort names."""
    selector = svc["spec"]["selector"]
    for workload, pod in ((o, o["spec"]["template"]) for o in objs if o["kind"] == "Deployment"):
        if all(pod["metadata"]["labels"].get(k) == v for k, v in selector.items()):
            for c in pod["spec"]["containers"]:
                for p in c.get("ports", []):
                    if target in (p.get("name"), p["containerPort"]):
                        return int(p["containerPort"])
            raise AssertionError(f"{workload['metadata']['name']}: no port {target}")
    raise AssertionError(f"Service {svc['metadata']['name']} selects no Deployment")


@needs_kubectl
def test_every_url_a_config_dials_reaches_the_port_its_server_listens_on(overlay: Any) -> None:
    _, objs = overlay
    cfgs = configs(objs)
    router = next(cfg for c, cfg in cfgs if c.program == "continuum-router")
    listeners = {
        s["backend_name"]: (c, cfg)
        for c, cfg in cfgs
        if c.program == "continuum-kv-listener"
        for s in cfg["sources"]
    }
    for b in router["backends"]:
        if b["name"] in listeners and listeners[b["name"]][0].workload["kind"] == "Deployment":
            svc, target = _service_target(objs, b["url"])
            assert _container_serving(objs, svc, target) == urlsplit(b["url"]).port
    for src in router["kv_cache_index"]["event_sources"]:
        assert src["backend_name"] in listeners, src
        if src.get("transport", "sse") == "sse":
            svc, target = _service_target(objs, src["endpoint"])
            _, lcfg = listeners[src["backend_name"]]
            assert _container_serving(objs, svc, target) == int(lcfg["listen"].rsplit(":")[1])
            assert urlsplit(src["endpoint"]).path == f"/events/{src['backend_name']}"
    bus = router.get("dynamo", {}).get("event_bus", {})
    for c, lcfg in listeners.values():
        if "event_bus" not in lcfg:
            assert not bus.get("enabled")
            continue
        svc, target = _service_target(objs, lcfg["event_bus"]["url"])
        assert _container_serving(objs, svc, target) == int(bus["listen"].rsplit(":")[1])
        broker = next(b for b in bus["brokers"] if b["id"] == lcfg["event_bus"]["client_id"])
        assert {s["backend_name"] for s in lcfg["sources"]} <= set(broker["backends"]), c.name


@needs_kubectl
def test_push_credentials_fit_together(rendered: dict[str, list[Obj]]) -> None:
    """The bus token's hash is the brokers' token_hash (make-secrets.sh writes it), each
    listener's client certificate names its client_id and is for client auth only, and
    the router's certificate names the host the listeners dial."""
    objs = rendered["push"]
    cfgs = configs(objs)
    router = next(cfg for c, cfg in cfgs if c.program == "continuum-router")
    token = next(
        o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == "continuum-bus-token"
    )
    digest = hashlib.sha256(base64.b64decode(token["data"]["token"]).strip()).hexdigest()
    brokers = router["dynamo"]["event_bus"]["brokers"]
    assert brokers and all(b["token_hash"] == f"sha256:{digest}" for b in brokers)
    certs = {o["spec"]["secretName"]: o for o in objs if o["kind"] == "Certificate"}
    router_c = next(c for c, _ in cfgs if c.program == "continuum-router")
    server = certs[_secret_at(router_c, "/etc/continuum/event-bus")]
    assert server["spec"]["usages"] == ["digital signature", "server auth"]
    for c, lcfg in cfgs:
        if c.program != "continuum-kv-listener":
            continue
        bus = lcfg["event_bus"]
        folder = str(Path(bus["client_cert_file"]).parent)
        client = certs[_secret_at(c, folder)]
        assert client["spec"]["dnsNames"] == [bus["client_id"]], c.name
        assert client["spec"]["usages"] == ["digital signature", "client auth"], c.name
        assert urlsplit(bus["url"]).hostname in server["spec"]["dnsNames"]
        assert client["spec"]["issuerRef"] == server["spec"]["issuerRef"]


def _secret_at(c: ContinuumContainer, mount_path: str) -> str:
    mount = next(m for m in c.container["volumeMounts"] if m["mountPath"] == mount_path)
    volume = next(v for v in c.pod["volumes"] if v["name"] == mount["name"])
    name: str = volume["secret"]["secretName"]
    return name


@needs_kubectl
def test_network_policies_open_only_what_each_part_needs(overlay: Any) -> None:
    name, objs = overlay
    router = pod_labels(objs, "continuum-router")
    engine = pod_labels(objs, "vllm-1")
    redis = pod_labels(objs, "redis")
    opened = {
        ("clients -> router http", allowed(objs, OUTSIDE, router, 8080)),
        ("router -> engine http", allowed(objs, router, engine, 8000)),
        ("router -> redis", allowed(objs, router, redis, 6379)),
    }
    assert all(ok for _, ok in opened), opened
    closed = {
        "clients -> redis": allowed(objs, OUTSIDE, redis, 6379),
        "clients -> engine http": allowed(objs, OUTSIDE, engine, 8000),
        "clients -> engine zmq": allowed(objs, OUTSIDE, engine, 5557),
        "router -> engine zmq": allowed(objs, router, engine, 5557),
        "router -> engine replay": allowed(objs, router, engine, 5600),
        "engine -> redis": allowed(objs, engine, redis, 6379),
        "clients -> router bus": allowed(objs, OUTSIDE, router, 9443),
        "clients -> listener sse": allowed(objs, OUTSIDE, engine, 7817),
    }
    if name == "pull":
        assert allowed(objs, router, engine, 7817)
        closed["engine -> router bus"] = allowed(objs, engine, router, 9443)
    else:
        node = pod_labels(objs, "kv-listener-node")
        assert allowed(objs, engine, router, 9443)
        assert allowed(objs, node, router, 9443)
        assert allowed(objs, engine, node, 5557)
        assert allowed(objs, node, engine, 8000)
        closed["router -> listener sse"] = allowed(objs, router, engine, 7817)
        closed["router -> node listener"] = allowed(objs, router, node, 7817)
        closed["node listener -> redis"] = allowed(objs, node, redis, 6379)
    assert not any(closed.values()), {k: v for k, v in closed.items() if v}


def test_resource_comments_cite_measured_figures() -> None:
    """Requests are sized from bench/RESULTS.md; the figures quoted must be there."""
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    for figure in ("319.5   B/entry", "149.3 MiB", "214.4 MiB", "    86   ", "   120   ", "89.6"):
        assert figure in results, figure
    text = (K8S / "base" / "router.yaml").read_text() + (K8S / "base" / "vllm-1.yaml").read_text()
    for quoted in ("319.5 B", "149-214 MiB", "86 plain, 120 streamed", "89.6 MiB RSS idle"):
        assert quoted in text, quoted


def test_make_secrets_keeps_existing_tokens_and_writes_the_hash(tmp_path: Path) -> None:
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("admin-token", "bus-token"))
    (tree / "overlays" / "push" / "secrets" / "bus-token").write_text("s3cret-bus-token\n")
    subprocess.run(["sh", str(tree / "make-secrets.sh")], check=True, capture_output=True)
    admin = (tree / "base" / "secrets" / "admin-token").read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", admin)
    assert (tree / "base" / "secrets" / "admin-token").stat().st_mode & 0o077 == 0
    digest = hashlib.sha256(b"s3cret-bus-token").hexdigest()
    router = yaml.safe_load((tree / "overlays" / "push" / "router.yaml").read_text())
    assert {b["token_hash"] for b in router["dynamo"]["event_bus"]["brokers"]} == {
        f"sha256:{digest}"
    }
    subprocess.run(["sh", str(tree / "make-secrets.sh")], check=True, capture_output=True)
    assert (tree / "base" / "secrets" / "admin-token").read_text() == admin
