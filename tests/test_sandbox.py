"""The code sandbox (harness/rl/rewards/sandbox.py) contains what a reward's code sample may try: a fork bomb, an
endless loop, a memory hog, writes outside its scratch folder and a connection to a server this test opens on
127.0.0.1 outside the sandbox (each confinement layer on its own too: the network namespace, Landlock). Small
limits keep each case under a few seconds."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from harness.rl.rewards import landlock, sandbox

LIMITS = {"cpu_s": 1, "memory_mb": 256, "processes": 8, "file_mb": 1, "timeout_s": 6}
NOBODY = 65534


def nobody_processes() -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == NOBODY:
                    out.append(int(entry.name))
            except FileNotFoundError:
                pass
    return out


@pytest.fixture
def server():
    """A TCP server on 127.0.0.1 outside the sandbox; .hits counts the connections it accepted."""
    class Server:
        sock, hits = socket.socket(), []

        def getsockname(self):
            return self.sock.getsockname()

    srv, stop = Server(), threading.Event()
    srv.sock.bind(("127.0.0.1", 0))
    srv.sock.listen()
    srv.sock.settimeout(0.2)

    def accept():
        while not stop.is_set():
            try:
                conn, _ = srv.sock.accept()
                srv.hits.append(1)
                conn.close()
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield srv
    stop.set()
    thread.join()
    srv.sock.close()


def test_a_plain_program_runs_and_writes_its_scratch_folder():
    got = sandbox.run("open('out.txt', 'w').write('kept'); print(open('out.txt').read())", limits=LIMITS)
    assert got.ok and got.stdout == "kept\n", got


def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing_behind():
    before = set(nobody_processes())
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    got = sandbox.run(bomb, limits={**LIMITS, "timeout_s": 2})
    assert not got.ok
    assert got.wall_s < 2 + 4
    assert set(nobody_processes()) - before == set(), "fork bomb processes outlived the sandbox"


def test_an_endless_loop_is_killed_at_its_cpu_limit():
    got = sandbox.run("while True:\n    pass\n", limits=LIMITS)
    assert got.returncode in (128 + 24, 128 + 9) or got.timed_out, got  # SIGXCPU, then SIGKILL at the hard limit
    assert not got.ok


def test_a_memory_hog_gets_memory_error():
    got = sandbox.run("x = bytearray(1 << 30)\nprint(len(x))\n", limits=LIMITS)
    assert got.returncode == 1 and "MemoryError" in got.stderr, got


@pytest.mark.parametrize("target", ["/tmp/sandbox_escape.txt", "/dev/shm/sandbox_escape.txt",
                                    str(Path(__file__).resolve().parent / "sandbox_escape.txt")])
def test_writes_outside_the_scratch_folder_fail(target):
    got = sandbox.run(f"open({target!r}, 'w').write('x')\n", limits=LIMITS)
    assert got.returncode == 1 and "PermissionError" in got.stderr, got
    assert not os.path.exists(target)


def test_a_big_file_stops_at_the_file_size_limit():
    got = sandbox.run("open('big', 'wb').write(b'0' * (4 << 20))\n", limits=LIMITS)
    assert "File too large" in got.stderr, got


@pytest.mark.parametrize("layers", [{}, {"landlock": False}], ids=["all", "namespace-only"])
def test_no_connection_reaches_a_server_on_the_hosts_loopback(server, layers):
    if layers and not sandbox.status()["namespaces"]:
        pytest.skip("no network namespace on this machine (unshare refused): Landlock alone keeps TCP shut")
    port = server.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n"
    got = sandbox.run(code, limits={**LIMITS, **layers})
    assert got.returncode == 1 and "connected" not in got.stdout, got
    assert server.hits == []


def test_landlock_alone_refuses_tcp_and_outside_writes(server, tmp_path):
    """The layer a user without namespaces still gets: in a child confined by landlock.restrict only."""
    if landlock.abi() < 4:
        pytest.skip("Landlock ABI < 4: no TCP rules on this kernel")
    port, outside = server.getsockname()[1], tmp_path / "outside.txt"
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            landlock.restrict([str(tmp_path / "scratch")] if (tmp_path / "scratch").mkdir() is None else [])
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2)
                code |= 1
            except PermissionError:
                pass
            try:
                outside.write_text("x")
                code |= 2
            except PermissionError:
                pass
            (tmp_path / "scratch" / "ok.txt").write_text("ok")
        except BaseException:
            code |= 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert server.hits == [] and not outside.exists() and (tmp_path / "scratch" / "ok.txt").read_text() == "ok"
