"""Shared tools of the prompt-store tests: cache cases of every kind, a redis-server."""

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import warnings

import mlx.core as mx
import numpy as np
import redis

from mlxkv.caches.schemes import make_cache, parse_scheme
from mlxkv.errors import SchemeError

# (id, arch, scheme, make_cache options, prompt length, prefill chunk)
KIND_CASES = [
    ("plain", "llama", "bf16", {}, 40, 16),
    ("affine", "llama", "kv4", {}, 40, 16),
    ("affine-g32", "llama", "kv8-g32", {}, 40, 16),
    ("bf16-first-pending", "llama", "kv4-start64", {}, 40, 16),
    ("bf16-first-converted", "llama", "kv4-start16", {}, 40, 16),
    ("ring-unwrapped", "llama", "bf16", {"max_kv_size": 64}, 40, 16),
    ("ring-wrapped", "llama", "bf16", {"max_kv_size": 24}, 40, 8),
    ("affine-ring-wrapped", "llama", "kv4", {"max_kv_size": 24}, 40, 8),
    ("sliding-rings", "gemma3", "bf16", {}, 40, 16),
    ("recurrent", "hybrid", "bf16", {}, 40, 16),
    ("turboquant", "llama", "turbo-k8v3", {}, 40, 16),
    ("tova-evicted", "llama", "tova-b32-s4", {}, 40, 16),
    ("tova-under-budget", "llama", "tova-b64-s4", {}, 40, 16),
    ("qfilters-evicted", "llama", "qfilters-b32-s4-r8", {"calib_tokens": 16}, 40, 16),
    ("qfilters-warming", "llama", "qfilters-b64-s4-r8", {"calib_tokens": 48}, 40, 16),
]


def accepted(scheme):
    try:
        parse_scheme(scheme)
        return True
    except SchemeError:
        return False


def build(model, scheme, opts, tokens, chunk):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caches = make_cache(model, scheme, **opts)
    forward(model, caches, tokens, chunk)
    return caches


def forward(model, caches, tokens, chunk=None):
    """Forward ``tokens`` in chunks; returns the last logits, float32 numpy."""
    chunk = chunk or len(tokens)
    logits = None
    for i in range(0, len(tokens), chunk):
        logits = model(mx.array([tokens[i : i + chunk]]), cache=caches)[0, -1]
        mx.eval(logits, [c.state for c in caches])
    return None if logits is None else np.array(logits.astype(mx.float32))


def continuation(model, caches, tokens):
    """Logits of forwarding ``tokens`` one by one, then all of them again as one block is
    not possible (state moved); so: one by one."""
    return np.stack([forward(model, caches, [t]) for t in tokens])


def snapshot_arrays(arrays: dict) -> dict:
    return {k: np.array(v.view(mx.uint16) if v.dtype == mx.bfloat16 else v) for k, v in arrays.items()}


def same_arrays(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


class RedisServer:
    """A private redis-server on a unix socket in a temporary directory, ready once it
    answers PING (the socket file exists a moment before the server accepts on it: a client
    then got "connection refused" on a loaded machine). ``restart()`` starts it again on the
    same socket (after a SIGKILL, say), empty."""

    def __init__(self, *extra):
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            raise RuntimeError(
                "redis-server is not installed: the Redis tier tests need it. Install it with "
                "`apt-get install -y redis-server` (Debian/Ubuntu) or `brew install redis` (macOS)"
            )
        self.extra = extra
        self.dir = tempfile.mkdtemp(prefix="mlxkv-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.proc = None
        self._start()

    def _start(self, timeout=30.0):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                "0",
                "--unixsocket",
                self.socket,
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING within {timeout:g} s")
            time.sleep(0.02)

    def answers(self) -> bool:
        """Does the server answer PING on its socket now?"""
        import redis

        if not os.path.exists(self.socket):
            return False
        client = redis.Redis(unix_socket_path=self.socket, socket_timeout=2, socket_connect_timeout=2)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def restart(self):
        """Start the server again on the same socket (the old process must have ended)."""
        if self.proc.poll() is None:
            raise RuntimeError("redis-server is still running: stop or kill it first")
        self._start()

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def client(self):
        return redis.Redis.from_url(self.url)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def free_ports(n):
    """``n`` TCP ports on loopback that were free a moment ago (the OS picks them)."""
    import socket

    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalCluster:
    """A Redis Cluster on loopback: ``masters`` masters with ``replicas`` replicas each, on
    private ports chosen free at start, built with ``redis-cli --cluster create``; ready when
    every node says ``cluster_state:ok`` and every replica's link to its master is up.
    ``cluster-node-timeout`` is ``node_timeout_ms``, so a killed master's replica takes over
    within a few seconds."""

    def __init__(self, masters=3, replicas=1, node_timeout_ms=1000, extra=(), timeout=60.0, tls=False, password=None):
        for exe in ("redis-server", "redis-cli", *(["openssl"] if tls else [])):
            if shutil.which(exe) is None:
                raise RuntimeError(
                    f"{exe} is not installed: the cluster tests need it (apt-get install -y redis-server)"
                )
        self.dir = tempfile.mkdtemp(prefix="mlxkv-cluster-")
        self.procs = {}
        self.ca = self._certificates() if tls else None
        self.password = password
        n = masters * (1 + replicas)
        ports = free_ports(2 * n)
        self.ports, buses = ports[:n], ports[n:]
        try:
            for port, bus in zip(self.ports, buses):
                self._start(port, bus, node_timeout_ms, extra)
            for port in self.ports:
                self._wait(lambda p=port: self.node(p).ping(), timeout)
            out = subprocess.run(
                ["redis-cli", *self._cli_tls(), "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
                + ["--cluster-replicas", str(replicas), "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise

    def _certificates(self) -> str:
        """A certificate authority and a certificate for 127.0.0.1 that every node presents;
        returns the authority's path."""
        d = os.path.join(self.dir, "tls")
        os.makedirs(d)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

        def run(*args):
            subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

        run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=mlxkv test CA")
        run("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=127.0.0.1")
        with open(os.path.join(d, "san"), "w") as f:
            f.write("subjectAltName=IP:127.0.0.1\n")
        sign = ["-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2", "-extfile", "san"]
        run("x509", "-req", "-in", "node.csr", *sign, "-out", "node.crt")
        return os.path.join(d, "ca.crt")

    def _tls_args(self):
        if self.ca is None:
            return []
        d = os.path.dirname(self.ca)
        files = ["--tls-cert-file", os.path.join(d, "node.crt"), "--tls-key-file", os.path.join(d, "node.key")]
        return ["--tls-cluster", "yes", "--tls-replication", "yes", "--tls-auth-clients", "no", *files] + [
            "--tls-ca-cert-file",
            self.ca,
        ]

    def _cli_tls(self):
        auth = [] if self.password is None else ["-a", self.password, "--no-auth-warning"]
        return auth + ([] if self.ca is None else ["--tls", "--cacert", self.ca])

    def _start(self, port, bus, node_timeout_ms, extra):
        d = os.path.join(self.dir, str(port))
        os.makedirs(d)
        listen = ["--port", "0", "--tls-port", str(port)] if self.ca else ["--port", str(port)]
        self.procs[port] = subprocess.Popen(
            ["redis-server", *listen, "--bind", "127.0.0.1", "--dir", d, *self._tls_args()]
            + ([] if self.password is None else ["--requirepass", self.password, "--masterauth", self.password])
            + ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus)]
            + ["--cluster-node-timeout", str(node_timeout_ms), "--cluster-replica-validity-factor", "0"]
            + ["--repl-diskless-sync-delay", "0", "--save", "", "--appendonly", "no", *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    @staticmethod
    def _wait(ready, timeout):
        deadline = time.time() + timeout
        while True:
            try:
                if ready():
                    return
            except Exception:
                pass
            if time.time() > deadline:
                raise RuntimeError("the cluster did not become ready")
            time.sleep(0.05)

    def node(self, port):
        """A plain client of one node (not cluster-aware)."""
        tls = {} if self.ca is None else {"ssl": True, "ssl_ca_certs": self.ca}
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, password=self.password, **tls)

    def alive(self):
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def ready(self) -> bool:
        """Every live node says cluster_state:ok and knows every live node's role; every
        live replica's link is up; every slot has a live master."""
        live = self.alive()
        for p in live:
            r = self.node(p)
            if r.cluster("info")["cluster_state"] != "ok":
                return False
            info = r.info("replication")
            if info["role"] == "slave" and info.get("master_link_status") != "up":
                return False
        covered = 0
        for start, end, master, *_ in self.node(live[0]).execute_command("CLUSTER SLOTS"):
            if int(master[1]) not in live:
                return False
            covered += end - start + 1
        return covered == 16384

    def wait_ok(self, timeout=60.0):
        self._wait(self.ready, timeout)

    def wait_replicated(self, timeout=30.0):
        """Until every live master's replicas have acknowledged all it wrote."""

        def caught_up():
            for port in self.masters():
                info = self.node(port).info("replication")
                replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
                if any(r["offset"] != info["master_repl_offset"] for r in replicas):
                    return False
            return True

        self._wait(caught_up, timeout)

    def masters(self):
        """{port: (first slot, last slot) ranges} of the live masters holding slots."""
        out = {}
        for start, end, master, *_ in self.node(self.alive()[0]).execute_command("CLUSTER SLOTS"):
            out.setdefault(int(master[1]), []).append((start, end))
        return out

    def master_of(self, key) -> int:
        slot = self.node(self.alive()[0]).cluster("keyslot", key)
        for port, ranges in self.masters().items():
            if any(a <= slot <= b for a, b in ranges):
                return port
        raise AssertionError(f"no master holds slot {slot}")

    def node_id(self, port) -> str:
        return self.node(port).cluster("myid").decode()

    def begin_move(self, key) -> tuple[int, int, int]:
        """Start moving ``key``'s slot to another master, as ``redis-cli --cluster reshard``
        moves each slot (``CLUSTER SETSLOT ... IMPORTING`` on the target, ``MIGRATING`` on
        the source, then ``MIGRATE`` of the keys the slot has); returns (slot, source,
        target). Until :meth:`end_move`, the slot is the source's and a command on a key it
        no longer has is answered ``ASK``."""
        slot = self.node(self.alive()[0]).cluster("keyslot", key)
        source = self.master_of(key)
        target = next(p for p in sorted(self.masters()) if p != source)
        src, dst = self.node(source), self.node(target)
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", self.node_id(source))
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", self.node_id(target))
        keys = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100_000)
        if keys:
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
        return slot, source, target

    def end_move(self, slot, source, target):
        """The slot is the target's (``CLUSTER SETSLOT ... NODE`` on every master); a client
        whose slot table is older is answered ``MOVED``."""
        for port in [target, *(p for p in self.masters() if p != target)]:  # the target first
            self.node(port).execute_command("CLUSTER SETSLOT", slot, "NODE", self.node_id(target))

    def keys_in_slot(self, port, slot) -> int:
        return self.node(port).execute_command("CLUSTER COUNTKEYSINSLOT", slot)

    def redirections(self) -> dict:
        """{"ASK": n, "MOVED": n}: the redirections the masters answered since their last
        ``CONFIG RESETSTAT``."""
        out = {"ASK": 0, "MOVED": 0}
        for port in self.masters():
            stats = self.node(port).info("errorstats")
            for name in out:
                out[name] += stats.get(f"errorstat_{name}", {}).get("count", 0)
        return out

    def reset_stats(self):
        for port in self.masters():
            self.node(port).config_resetstat()

    def kill(self, port):
        """SIGKILL one node."""
        proc = self.procs[port]
        proc.kill()
        proc.wait()

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def client(self):
        """A cluster client whose KEYS, FLUSHALL and DBSIZE span every master (as one
        server's do)."""
        return _WholeCluster(host="127.0.0.1", port=self.alive()[0], socket_timeout=5)

    def flushall(self):
        for port in self.masters():
            self.node(port).flushall()

    def keys_matching(self, pattern="*"):
        return [k for port in self.masters() for k in self.node(port).keys(pattern)]

    def stop(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class _WholeCluster(redis.RedisCluster):
    def keys(self, pattern="*", **kw):
        return super().keys(pattern, target_nodes=self.PRIMARIES, **kw)

    def flushall(self, *args, **kw):
        return super().flushall(*args, target_nodes=self.PRIMARIES, **kw)

    def dbsize(self, **kw):
        return super().dbsize(target_nodes=self.PRIMARIES, **kw)


def settled(store, timeout=30.0):
    """Until a store's shared tier has made its client (a cluster's learns the slot table as
    the store opens), or failed to: a lookup then asks the tier at once."""
    starting = store._redis.health._starting
    if starting is not None:
        starting.result(timeout)
    return store


def masters_of(server):
    """Plain clients of a RedisServer, or of each master of a LocalCluster."""
    if isinstance(server, LocalCluster):
        return [server.node(p) for p in server.masters()]
    return [server.client()]
