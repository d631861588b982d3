"""A real ``redis-server`` (Debian's package; scripts/setup-cpu.sh installs it) on a free port in a folder of its
own, for the fleet tests: start it, kill it mid-test (SIGKILL, like a crash), start it again on the same port and
folder (with ``appendonly`` it comes back with its data: ``appendfsync always``, so a kill loses nothing it
acknowledged; without it, it comes back with the last snapshot :meth:`RedisServer.save` wrote, or empty), stop it
at the end. Its data lives on tmpfs (``/dev/shm``) where there is one: a killed process loses nothing there either,
and an fsync on CI's shared disk, busy with other lanes, has kept a reply waiting past the client's timeout. ``transport``: how :attr:`url` reaches
it: ``tcp`` (``redis://``), ``tls`` (``rediss://`` on a second port, with a self-signed certificate made by
``openssl``, its CA passed in the URL) or ``unix`` (``unix://`` socket). The plain port always answers too: the
fixture's own liveness check uses it."""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path



_PORT_LOCKS = Path("/tmp/hotwire-test-ports")  # not under TMPDIR: every lane and run on the machine sees them


def reserve_port_below_ephemeral_range() -> tuple[int, int]:
    """A free port below the kernel's ephemeral range, and the descriptor of a lock file that reserves it for the
    caller's life. The server is restarted on its port; while it is down, an outgoing connection could be given
    that port as its local port, but local ports are never taken from below the ephemeral range; another test's
    server (another lane: two pytest processes run at once) could, which the lock prevents: a port whose lock is
    held elsewhere is skipped."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    pick = random.Random(os.getpid() ^ time.monotonic_ns())
    _PORT_LOCKS.mkdir(parents=True, exist_ok=True)
    for _ in range(200):
        port = pick.randrange(max(1024, low - 12000), low)
        lock = os.open(_PORT_LOCKS / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
        except OSError:
            os.close(lock)
            continue
        return port, lock
    raise RuntimeError(f"no free port found below {low}")


def _holders(port: int) -> str:
    """What the kernel has on ``port`` (``ss``), for an error saying why a restart could not bind it."""
    try:
        return subprocess.run(["ss", "-tanp", f"( sport = :{port} or dport = :{port} )"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        return f"(ss failed: {error})"


class RedisServer:
    def __init__(self, workdir: Path, appendonly: bool = True, password: str | None = None, transport: str = "tcp"):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: apt-get install -y redis-server "
                               "(bash scripts/setup-cpu.sh does it on Debian and Ubuntu)")
        self.exe, self.workdir, self.appendonly, self.password = exe, workdir, appendonly, password
        assert transport in ("tcp", "tls", "unix"), transport
        self.transport = transport
        self.port, lock = reserve_port_below_ephemeral_range()
        self._port_locks = [lock]
        self.tls_port = None
        if transport == "tls":
            self.tls_port, lock = reserve_port_below_ephemeral_range()
            self._port_locks.append(lock)
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        shm = Path("/dev/shm")
        on_tmpfs = shm.is_dir() and os.access(shm, os.W_OK)
        self.datadir = Path(tempfile.mkdtemp(prefix="hotwire-redis-", dir=shm)) if on_tmpfs else workdir / "data"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.transport == "tls":
            return f"rediss://{auth}127.0.0.1:{self.tls_port}/0?ssl_ca_certs={self.workdir / 'tls' / 'cert.pem'}"
        if self.transport == "unix":
            return f"unix://{auth}{self.workdir / 'redis.sock'}?db=0"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _transport_args(self) -> list[str]:
        if self.transport == "unix":
            return ["--unixsocket", str(self.workdir / "redis.sock"), "--unixsocketperm", "700"]
        if self.transport != "tls":
            return []
        tls = self.workdir / "tls"
        if not (tls / "cert.pem").exists():
            tls.mkdir(parents=True, exist_ok=True)
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                            "-keyout", str(tls / "key.pem"), "-out", str(tls / "cert.pem")],
                           check=True, capture_output=True, timeout=60)
        return ["--tls-port", str(self.tls_port), "--tls-cert-file", str(tls / "cert.pem"),
                "--tls-key-file", str(tls / "key.pem"), "--tls-ca-cert-file", str(tls / "cert.pem"),
                "--tls-auth-clients", "no"]

    def start(self, timeout: float = 30.0, appendonly: bool | None = None) -> None:
        """``appendonly``: this start's setting, if not the server's."""
        assert self.proc is None, "already running"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        aof = self.appendonly if appendonly is None else appendonly
        self.datadir.mkdir(parents=True, exist_ok=True)
        cmd = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.datadir),
               "--save", "", "--appendonly", "yes" if aof else "no", "--appendfsync", "always", "--daemonize", "no",
               "--protected-mode", "no", "--logfile", str(self.workdir / f"redis-{self.starts}.log")]
        if self.password:
            cmd += ["--requirepass", self.password]
        cmd += self._transport_args()
        deadline = time.monotonic() + timeout

        def spawn() -> subprocess.Popen:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        self.proc = spawn()
        while not self._answers():
            if self.proc.poll() is not None:
                log = (self.workdir / f"redis-{self.starts}.log").read_text()
                if "Address already in use" in log and time.monotonic() < deadline:
                    # a socket of the killed server still closing (seen in CI, not reproduced): wait it out
                    time.sleep(0.5)
                    self.proc = spawn()
                    continue
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log[-2000:]}\n"
                                   f"on port {self.port}: {_holders(self.port)}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer within {timeout:.0f} s")
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                reply = sock.recv(64)
            return reply.startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def save(self) -> None:
        """Write a snapshot (``SAVE``: ``dump.rdb`` in the folder). Without ``appendonly`` a restart loads it: the
        data as it was now, as a Redis restored from an older snapshot or backup comes back."""
        import redis

        with redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=30) as client:
            client.save()

    def kill(self) -> None:
        """SIGKILL, as a crash would (the AOF keeps what Redis acknowledged; without it the data is gone)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def restart(self, wipe: bool = False, snapshot: bool = False) -> None:
        """Kill and start again on the same port; with ``wipe`` its append-only file and snapshot are deleted in
        between, as a Redis that lost its disk (or ran without persistence) comes back: empty. With ``snapshot``
        it comes back with the last snapshot (:meth:`save`) only, as one restored from an older backup: the
        append-only file is deleted, and turned on again once the snapshot is loaded."""
        self.kill()
        if wipe or snapshot:
            shutil.rmtree(self.datadir / "appendonlydir", ignore_errors=True)
        if wipe:
            for dump in self.datadir.glob("*.rdb"):
                dump.unlink()
        self.start(appendonly=False if snapshot else None)
        if snapshot and self.appendonly:
            import redis

            with redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=30) as client:
                client.config_set("appendonly", "yes")

    def stop(self) -> None:
        """Stop it and delete its data."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self.datadir, ignore_errors=True)
        for lock in self._port_locks:
            os.close(lock)
        self._port_locks = []
