"""What the image's builder stage does, and the image itself where it can be built.

``test_the_wheel_installs_with_both_console_scripts`` runs everywhere: ``pip wheel .``, the
wheel installed into a fresh virtualenv (its dependencies reached through this venv, as
the builder reaches them from the index), both console scripts' ``--help`` and a
``config validate`` from the installed package, not the source tree.

``test_the_image_builds_runs_unprivileged_and_serves_health`` builds the Containerfile
with ``make image`` and runs it with ``buildah run``; it is skipped unless buildah is
installed and the base image is in its local storage (``CONTINUUM_BASE_IMAGE`` names
another base, e.g. the one ``make image-base`` makes on machines without registry
access). ``BUILDAH`` is the buildah command, as for ``make image`` (e.g. ``buildah
--storage-driver vfs`` inside a container, with ``BUILDAH_ISOLATION=chroot``).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BASE = "docker.io/library/python:3.11-slim"
BUILDAH = shlex.split(os.environ.get("BUILDAH", "buildah"))

pytestmark = pytest.mark.slow


def test_the_wheel_installs_with_both_console_scripts(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("continuum-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"router/cli.py", "listener/cli.py", "bus/config.py", "certs/pki.py"} <= set(names)
    assert not [n for n in names if n.startswith(("tests/", "bench/", "harness/"))]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = Path(
        subprocess.run(
            [
                str(venv / "bin" / "python"),
                "-c",
                "import sysconfig; print(sysconfig.get_path('purelib'))",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # The dependencies: this venv's site-packages as a plain path (its .pth files, the
    # editable install of the source tree among them, are not processed).
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
    )
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import router, listener; print(router.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout
    assert where.startswith(str(site)), where
    for script in ("continuum-router", "continuum-kv-listener"):
        out = subprocess.run(
            [str(venv / "bin" / script), "--help"], capture_output=True, text=True, cwd=tmp_path
        )
        assert out.returncode == 0 and out.stdout.startswith(f"usage: {script}"), out
    check = subprocess.run(
        [
            str(venv / "bin" / "continuum-router"),
            "config",
            "validate",
            str(ROOT / "deploy" / "config.example.yaml"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert check.returncode == 0, check.stderr


def _buildah(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BUILDAH, *args], capture_output=True, text=True, **kw)  # type: ignore[call-overload]


def _base_image() -> str:
    if shutil.which(BUILDAH[0]) is None:
        pytest.skip("no image builder: buildah is not installed")
    base = os.environ.get("CONTINUUM_BASE_IMAGE", DEFAULT_BASE)
    if _buildah("inspect", "--type", "image", base).returncode != 0:
        pytest.skip(f"base image {base} is not in buildah's storage (set CONTINUUM_BASE_IMAGE)")
    return base


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_image_builds_runs_unprivileged_and_serves_health(tmp_path: Path) -> None:
    base = _base_image()
    image = "localhost/continuum:test"
    make = ["make", "-C", str(ROOT), "image", f"IMAGE={image}", f"PYTHON_IMAGE={base}"]
    make.append(f"BUILDAH={shlex.join(BUILDAH)}")
    ca = os.environ.get("PIP_CERT")
    if ca and Path(ca).is_file():
        make.append(f"BUILD_CA={ca}")
    build = subprocess.run(make, capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    container = _buildah("from", image, check=True).stdout.strip()
    try:
        config = json.loads(_buildah("inspect", "--type", "image", image, check=True).stdout)
        docker = config["Docker"]["config"]
        assert docker["User"] == "10001:10001"
        assert docker["Cmd"] == [
            "continuum-router",
            "serve",
            "--config",
            "/etc/continuum/config.yaml",
        ]
        test = docker["Healthcheck"]["Test"]
        assert test[0] == "CMD"

        def run(*cmd: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
            flags = [f"--env={k}={v}" for k, v in (env or {}).items()]
            return _buildah("run", *flags, container, "--", *cmd)

        assert run("id", "-u").stdout.strip() == "10001"
        for script in ("continuum-router", "continuum-kv-listener"):
            assert run(script, "--help").returncode == 0, script
        compilers = run("sh", "-c", "command -v gcc cc c++ make ld || true")
        assert compilers.stdout.strip() == "", compilers.stdout

        port = _free_port()
        cfg = tmp_path / "config.yaml"
        cfg.write_text(
            f'server:\n  listen: "127.0.0.1:{port}"\n'
            'backends:\n  - {name: e1, url: "http://127.0.0.1:9", type: vllm}\n'
        )
        # `timeout 120` inside: a SIGTERM to `buildah run` does not always reach the
        # process in a chroot-isolated container, so it bounds its own life.
        proc = subprocess.Popen(
            [
                *BUILDAH,
                "run",
                f"--volume={cfg}:/etc/continuum/config.yaml:ro",
                container,
                "--",
                "timeout",
                "120",
                *docker["Cmd"],
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert proc.stdout is not None
            deadline = time.monotonic() + 60
            for line in proc.stdout:
                if line.startswith("READY") or time.monotonic() > deadline:
                    break
            assert line.startswith("READY"), line
            health = run(*test[1:], env={"CONTINUUM_HEALTH_URL": f"http://127.0.0.1:{port}/health"})
            assert health.returncode == 0, health.stderr
            closed = run(
                *test[1:], env={"CONTINUUM_HEALTH_URL": f"http://127.0.0.1:{_free_port()}/health"}
            )
            assert closed.returncode != 0
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        _buildah("rm", container)
        _buildah("rmi", image)
