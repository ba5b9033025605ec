"""harness.procs: READY parsing, failed starts that quote the child's log, stopping.

The children are tiny ``python -c`` programs, so each test shows one behaviour of the
launcher that every integration test and benchmark relies on.
"""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path

import pytest

from harness.procs import (
    BlockingChild,
    ChildExited,
    ChildProcess,
    ChildTimeout,
    Service,
    free_port,
    launch,
    parse_ready,
)

# Prints noise, then READY with both forms of field, then waits to be stopped.
SERVES = (
    "import sys, time\n"
    "print('warming up', flush=True)\n"
    "sys.stderr.write('starting\\n')\n"
    "print('READY 8123 http=127.0.0.1:8080 grpc=127.0.0.1:50051', flush=True)\n"
    "time.sleep(60)\n"
)
# Fails before READY, saying why on stderr.
FAILS = "import sys\nsys.stderr.write('bad config: no backends\\n')\nsys.exit(3)\n"
# Says something on stderr, then never gets ready.
HANGS = "import sys, time\nsys.stderr.write('still loading the model\\n')\ntime.sleep(60)\n"
# Ready, but ignores SIGTERM.
STUBBORN = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('READY', flush=True)\n"
    "time.sleep(60)\n"
)


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# -- READY lines ---------------------------------------------------------------------------


def test_ready_line_fields_words_and_url() -> None:
    ready = parse_ready("READY http=127.0.0.1:8080 grpc=127.0.0.1:50051\n")
    assert ready.url() == "http://127.0.0.1:8080"
    assert ready.fields["grpc"] == "127.0.0.1:50051"
    assert ready.words == ()
    assert parse_ready("READY 8123").port == 8123
    assert parse_ready("READY").words == ()


def test_ready_line_errors_name_the_line() -> None:
    with pytest.raises(ValueError, match="not a READY line"):
        parse_ready("READYNESS 1")
    with pytest.raises(ValueError, match="without http="):
        parse_ready("READY 8123").url()
    with pytest.raises(ValueError, match="without a port"):
        _ = parse_ready("READY http=127.0.0.1:1").port


# -- asyncio -------------------------------------------------------------------------------


async def test_launch_skips_lines_before_ready(tmp_path: Path) -> None:
    child = await launch("svc", py(SERVES), ready_timeout=20, log=tmp_path / "svc.log")
    try:
        assert child.ready.port == 8123
        assert child.ready.url() == "http://127.0.0.1:8080"
        assert child.ready.fields["grpc"] == "127.0.0.1:50051"
        assert child.running
    finally:
        assert await child.stop() == -signal.SIGTERM
    assert not child.ignored_signal
    assert "starting" in child.log()


async def test_exit_before_ready_quotes_the_log(tmp_path: Path) -> None:
    with pytest.raises(ChildExited) as err:
        await launch("router", py(FAILS), ready_timeout=20, log=tmp_path / "r.log")
    assert err.value.returncode == 3
    assert "router exited (3) before READY" in str(err.value)
    assert "bad config: no backends" in str(err.value)


async def test_timeout_quotes_the_log_and_stops_the_child(tmp_path: Path) -> None:
    child = await ChildProcess.start("embedder", py(HANGS), log=tmp_path / "e.log")
    with pytest.raises(ChildTimeout) as err:
        await child.wait_ready(0.5)
    assert "embedder: no READY within 0.5s" in str(err.value)
    assert "still loading the model" in str(err.value)
    assert not child.running


async def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    child = await launch("stubborn", py(STUBBORN), ready_timeout=20, log=tmp_path / "s.log")
    assert await child.stop(grace=0.5) == -signal.SIGKILL
    assert child.ignored_signal


async def test_service_restart_rewrites_config_and_appends_log(tmp_path: Path) -> None:
    # A module that prints its config's listen address as READY and logs each start.
    (tmp_path / "echo_service.py").write_text(
        "import sys, time, yaml\n"
        "cfg = yaml.safe_load(open(sys.argv[sys.argv.index('--config') + 1]))\n"
        "sys.stderr.write(f\"serving {cfg['listen']}\\n\")\n"
        "print(f\"READY http={cfg['listen']}\", flush=True)\n"
        "time.sleep(60)\n"
    )
    svc = Service(
        "echo",
        ["echo_service"],
        {"listen": "127.0.0.1:1"},
        tmp_path / "echo.yaml",
        log=tmp_path / "echo.log",
        env={"PYTHONPATH": str(tmp_path)},
    )
    async with svc:
        assert svc.url == "http://127.0.0.1:1"
    assert not svc.running
    svc.config["listen"] = "127.0.0.1:2"
    async with svc:
        assert svc.url == "http://127.0.0.1:2"
    assert svc.log().splitlines() == ["serving 127.0.0.1:1", "serving 127.0.0.1:2"]


# -- blocking ------------------------------------------------------------------------------


def test_blocking_child_ready_and_later_lines(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "print('READY 9000', flush=True)\n"
        "for line in sys.stdin:\n"
        '    print(\'{"echo": "%s"}\' % line.strip(), flush=True)\n'
    )
    child = BlockingChild("echo", py(code), log=tmp_path / "echo.log", stdin=True)
    try:
        assert child.wait_ready().port == 9000
        child.send("hello")
        assert child.expect(r"^\{").string == '{"echo": "hello"}'
    finally:
        child.stop()


def test_blocking_exit_before_ready_quotes_the_log(tmp_path: Path) -> None:
    child = BlockingChild("listener", py(FAILS), log=tmp_path / "l.log")
    with pytest.raises(ChildExited, match="bad config: no backends"):
        child.wait_ready()
    # The end of stdout stays visible: a second wait fails the same way, at once.
    with pytest.raises(ChildExited, match=r"listener exited \(3\)"):
        child.expect("anything")


def test_blocking_timeout_quotes_the_log_and_stops_the_child(tmp_path: Path) -> None:
    child = BlockingChild("sim", py(HANGS), log=tmp_path / "sim.log")
    with pytest.raises(ChildTimeout, match="still loading the model"):
        child.wait_ready(0.5)
    assert child.proc.poll() is not None


def test_blocking_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    child = BlockingChild("stubborn", py(STUBBORN), log=tmp_path / "s.log")
    child.wait_ready()
    assert child.stop(grace=0.5) == -signal.SIGKILL


def test_free_port_is_bindable_and_outside_the_ephemeral_range() -> None:
    """Outgoing connections take their source ports from the ephemeral range; a port
    handed out there can be taken before the child binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports)
    assert len(ports) > 1  # random, so two callers rarely get the same one
    for p in list(ports)[:3]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_free_port_does_not_hand_out_a_port_twice() -> None:
    """Two ports taken before either child binds (an engine's event and replay ports)
    must differ: a repeat made the second child fail with "Address already in use"."""
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)
