"""What the Kubernetes manifest tests need: render an overlay, lay out a pod's files, and
decide whether the NetworkPolicies let one pod reach another.

Rendering is ``kubectl kustomize`` on a copy of ``deploy/k8s`` whose tokens were made by
its own ``make-secrets.sh`` (the overlays do not render without them, by design).

A container's files are laid out under a temporary root the way the kubelet would mount
them: ConfigMap and Secret keys as files under each ``mountPath``, empty dirs for
``emptyDir``, and for a Secret that cert-manager issues (a ``Certificate``'s
``secretName``) the three keys it writes, ``tls.crt``, ``tls.key`` and ``ca.crt``. A
config's absolute paths are then re-rooted under that root and the config validated by
our own loaders: a path that no mount provides does not exist there, and fails.

The policy check follows the NetworkPolicy semantics for one namespace: a pod selected by
no policy of a direction is open in it; a selected pod admits a connection some selected
policy's rule allows (peers by pod labels, ``ipBlock`` peers as "outside the namespace").
"""

from __future__ import annotations

import base64
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("pull", "push")

Obj = dict[str, Any]

# What cert-manager puts in a Certificate's Secret.
CERT_MANAGER_KEYS = ("tls.crt", "tls.key", "ca.crt")


def render(overlay: str, workdir: Path) -> list[Obj]:
    """``kubectl kustomize deploy/k8s/overlays/<overlay>`` on a copy with fresh tokens."""
    tree = workdir / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("admin-token", "bus-token"))
    subprocess.run(["sh", str(tree / "make-secrets.sh")], check=True, capture_output=True)
    out = subprocess.run(
        ["kubectl", "kustomize", str(tree / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    for o in objs:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return o
    raise KeyError(f"{kind}/{name}")


def pod_templates(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, pod spec) of every Deployment, DaemonSet and StatefulSet."""
    for o in objs:
        if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            yield o, o["spec"]["template"]["spec"]


@dataclass(frozen=True)
class ContinuumContainer:
    """A container that runs one of our console scripts, with its config's location."""

    workload: Obj
    pod: Obj
    container: Obj
    program: str  # continuum-router | continuum-kv-listener
    config_path: str

    @property
    def name(self) -> str:
        return f"{self.workload['metadata']['name']}/{self.container['name']}"


def continuum_containers(objs: list[Obj]) -> list[ContinuumContainer]:
    found = []
    for workload, pod in pod_templates(objs):
        for c in pod["containers"]:
            args = [*c.get("command", []), *c.get("args", [])]
            if args and args[0] in ("continuum-router", "continuum-kv-listener"):
                config = args[args.index("--config") + 1]
                found.append(ContinuumContainer(workload, pod, c, args[0], config))
    return found


class CertManagerStandIn:
    """Issues what cert-manager would put in each Certificate's Secret, with ``certs.pki``:
    one CA for the render, then per Certificate a leaf for its ``dnsNames`` and usages."""

    def __init__(self, workdir: Path) -> None:
        from certs import pki

        self._pki = pki
        self._dir = workdir
        self._ca = pki.make_ca(workdir, name="bus-ca")
        self._issued: dict[str, dict[str, bytes]] = {}

    def __call__(self, cert: Obj) -> dict[str, bytes]:
        name = cert["metadata"]["name"]
        if name not in self._issued:
            spec = cert["spec"]
            if spec.get("isCA"):
                pair = self._ca
            elif "server auth" in spec["usages"]:
                pair = self._pki.make_server_cert(
                    self._ca, self._dir, hostnames=spec["dnsNames"], ips=(), name=name
                )
            else:
                (client_id,) = spec["dnsNames"]
                pair = self._pki.make_client_cert(self._ca, self._dir, client_id, name=name)
            self._issued[name] = {
                "tls.crt": pair.cert.read_bytes(),
                "tls.key": pair.key.read_bytes(),
                "ca.crt": self._ca.cert.read_bytes(),
            }
        return self._issued[name]


def _placeholder_certs(cert: Obj) -> dict[str, bytes]:
    return {k: b"issued by cert-manager\n" for k in CERT_MANAGER_KEYS}


def _volume_files(
    objs: list[Obj], volume: Obj, issue: Callable[[Obj], dict[str, bytes]]
) -> dict[str, bytes] | None:
    """The files a volume shows (None: a directory of its own, like emptyDir)."""
    if "configMap" in volume:
        cm = find(objs, "ConfigMap", volume["configMap"]["name"])
        return {k: v.encode() for k, v in cm.get("data", {}).items()}
    if "secret" in volume:
        name = volume["secret"]["secretName"]
        for o in objs:
            if o["kind"] == "Secret" and o["metadata"]["name"] == name:
                files = {k: base64.b64decode(v) for k, v in o.get("data", {}).items()}
                files.update({k: v.encode() for k, v in o.get("stringData", {}).items()})
                return files
            if o["kind"] == "Certificate" and o["spec"]["secretName"] == name:
                return issue(o)
        if volume["secret"].get("optional"):
            return {}
        raise KeyError(f"volume {volume['name']}: no Secret or Certificate {name!r}")
    if "emptyDir" in volume:
        return None
    raise KeyError(f"volume {volume['name']}: unsupported kind")


def mounted_files(
    objs: list[Obj],
    pod: Obj,
    container: Obj,
    issue: Callable[[Obj], dict[str, bytes]] = _placeholder_certs,
) -> dict[str, bytes | None]:
    """Absolute path in the container -> file bytes (None: an empty directory mount).
    ``issue`` makes a cert-manager Secret's files (placeholders unless a
    :class:`CertManagerStandIn` is given)."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    files: dict[str, bytes | None] = {}
    for m in container.get("volumeMounts", []):
        content = _volume_files(objs, volumes[m["name"]], issue)
        if content is None:
            files[m["mountPath"]] = None
        else:
            for key, data in content.items():
                files[f"{m['mountPath']}/{key}"] = data
    return files


def config_text(objs: list[Obj], c: ContinuumContainer, node: str) -> str:
    """The config file the container reads: from its mounts, or what an init container
    renders into an emptyDir from a mounted ``.in`` template, on node ``node``."""
    files = mounted_files(objs, c.pod, c.container)
    data = files.get(c.config_path)
    if data is not None:
        return data.decode()
    for init in c.pod.get("initContainers", []):
        if c.config_path in " ".join(init.get("command", [])):
            templates = [
                v for k, v in mounted_files(objs, c.pod, init).items() if k.endswith(".in") and v
            ]
            assert len(templates) == 1, init["name"]
            assert {
                "name": "NODE_NAME",
                "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
            } in init["env"]
            return templates[0].decode().replace("__NODE_NAME__", node)
    raise AssertionError(f"{c.name}: nothing provides {c.config_path}")


def lay_out(files: Mapping[str, bytes | None], root: Path) -> None:
    for path, data in files.items():
        target = root / path.lstrip("/")
        if data is None:
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)


def absolute_paths(value: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """(YAML path, value) of every string in a config that is an absolute file path."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from absolute_paths(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from absolute_paths(v, f"{where}[{i}]")
    elif isinstance(value, str) and value.startswith("/"):
        yield where, value


def reroot(value: Any, root: Path) -> Any:
    """The config with every absolute path moved under ``root``."""
    if isinstance(value, dict):
        return {k: reroot(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [reroot(v, root) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        return str(root / value.lstrip("/"))
    return value


# --- NetworkPolicy evaluation -------------------------------------------------------------

OUTSIDE: dict[str, str] = {"__outside__": "true"}
"""Stands for a client outside the namespace (matched by rules without ``from`` or with
an ``ipBlock``)."""


def _selects(selector: Obj, labels: Mapping[str, str]) -> bool:
    if labels is OUTSIDE:
        return False
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        present = e["key"] in labels
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
        if e["operator"] == "NotIn" and labels.get(e["key"]) in e["values"]:
            return False
        if e["operator"] == "Exists" and not present:
            return False
        if e["operator"] == "DoesNotExist" and present:
            return False
    return True


def _peer_matches(peer: Obj, labels: Mapping[str, str]) -> bool:
    if "ipBlock" in peer or "namespaceSelector" in peer:
        return labels is OUTSIDE
    return _selects(peer.get("podSelector", {}), labels)


def _rule_allows(rule: Obj, peers_key: str, labels: Mapping[str, str], port: int) -> bool:
    ports = rule.get("ports")
    if ports and not any(p.get("port") == port for p in ports):
        return False
    peers = rule.get(peers_key)
    return not peers or any(_peer_matches(p, labels) for p in peers)


def _direction_allows(
    policies: list[Obj], kind: str, subject: Mapping[str, str], peer: Mapping[str, str], port: int
) -> bool:
    if subject is OUTSIDE:
        return True
    selecting = [
        p
        for p in policies
        if kind in p["spec"].get("policyTypes", ["Ingress"])
        and _selects(p["spec"]["podSelector"], subject)
    ]
    if not selecting:
        return True
    key, peers_key = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
    return any(
        _rule_allows(rule, peers_key, peer, port)
        for p in selecting
        for rule in p["spec"].get(key, [])
    )


def allowed(objs: list[Obj], src: Mapping[str, str], dst: Mapping[str, str], port: int) -> bool:
    """Whether a pod labelled ``src`` may open a TCP connection to ``dst`` on ``port``."""
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    return _direction_allows(policies, "Egress", src, dst, port) and _direction_allows(
        policies, "Ingress", dst, src, port
    )


def pod_labels(objs: list[Obj], workload: str) -> dict[str, str]:
    for o in objs:
        if o["metadata"]["name"] == workload and o["kind"] in ("Deployment", "DaemonSet"):
            labels: dict[str, str] = o["spec"]["template"]["metadata"]["labels"]
            return labels
    raise KeyError(workload)
