"""How the shared tier reaches Redis: the URL forms, the client each gives, its key layout
and the probe its breaker calls.

- ``redis://[user:password@]host[:port][/db]``, ``rediss://…`` (TLS), ``unix:///path.sock``:
  one Redis or Valkey server (``redis.Redis``), keys as :class:`~.redis_layout.KeyLayout`.
- ``redis+cluster://[user:password@]host[:port][,host[:port]…]``, ``rediss+cluster://…``
  (TLS): a Redis Cluster, or Valkey in cluster mode (``redis.RedisCluster``), keys as
  :class:`~.redis_layout.ClusterLayout`. The hosts are startup nodes: any one that answers
  tells the client every node and which slots it holds. redis-py follows ``MOVED`` and
  ``ASK`` redirections and refreshes its slot table on a node's failure; mlxkv handles none
  of that itself. The query string takes redis-py's URL options (``ssl_ca_certs=...``).

A cluster's client asks a node for the slot table when it is made, so it is made by the
tier's own thread as the store opens (lookups meanwhile are skipped, not waited for): a
cluster that is unreachable then is a failing tier (misses, logged, probed again), as one
server is, not a server that fails to start. Nothing is sent when a URL is only checked
(:func:`check_url`).
"""

import threading
from urllib.parse import unquote

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from ..errors import MLXKVError
from .redis_layout import ClusterLayout, KeyLayout

SERVER_SCHEMES = ("redis://", "rediss://", "unix://")
CLUSTER_SCHEMES = {"redis+cluster://": "redis://", "rediss+cluster://": "rediss://"}
#: how often a cluster command is tried again after a node's failure or CLUSTERDOWN (redis-py
#: refreshes its slot table between tries); its default of 10 would hold a writer for ten
#: connect timeouts on a partition
CLUSTER_RETRIES = 3
FORMS = "redis://host:6379/0, rediss://, unix:///path.sock, or redis+cluster://host:port,host:port (rediss+cluster://)"


def redacted(url: str) -> str:
    """A Redis URL without its password (for logs and the banner)."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


def _cluster_nodes(url: str) -> tuple[str, list[ClusterNode]]:
    """(redis-py's URL of the first startup node, the other startup nodes) of a
    ``redis+cluster://`` or ``rediss+cluster://`` URL."""
    scheme = next(s for s in CLUSTER_SCHEMES if url.startswith(s))
    rest = url[len(scheme) :]
    tail = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:tail], rest[tail:]
    auth, _, hosts = netloc.rpartition("@")
    nodes = []
    for item in hosts.split(","):
        host, port = item, "6379"
        if item.startswith("["):  # [::1]:7000
            host, _, after = item[1:].partition("]")
            if after:
                port = after.removeprefix(":")
        elif ":" in item:
            host, port = item.rsplit(":", 1)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise MLXKVError(f"{redacted(url)!r}: {item!r} is not host:port")
        nodes.append((unquote(host), int(port)))
    path = tail.split("?", 1)[0]
    if path not in ("", "/", "/0"):
        raise MLXKVError(f"{redacted(url)!r}: a Redis Cluster has one database (0), not {path!r}")
    host, port = nodes[0]
    first = f"{CLUSTER_SCHEMES[scheme]}{auth + '@' if auth else ''}{f'[{host}]' if ':' in host else host}:{port}{tail}"
    return first, [ClusterNode(h, p) for h, p in nodes[1:]]


def _describe(client) -> str:
    """Where a given client points, as a URL without credentials (its repr lists every
    connection option)."""
    if isinstance(client, RedisCluster):
        return "redis+cluster://" + ",".join(n.name for n in client.get_nodes())
    kw = client.connection_pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}"
    return f"redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


def check_url(url) -> None:
    """Refuse a URL that is not one of the forms above (nothing is sent)."""
    Connection(url, 1.0)


class Connection:
    """The tier's client of one server or cluster (given as a URL or a ``redis.Redis`` /
    ``redis.RedisCluster``), its key layout (``prefix``: the first part of every key) and
    its probe. ``timeout``: of every socket operation."""

    def __init__(self, url_or_client, timeout: float, prefix: str = "mlxkv"):
        self._lock = threading.Lock()
        self._client = None
        self._make = None
        if isinstance(url_or_client, RedisCluster | redis.Redis):
            self._client = url_or_client
            self.where = _describe(url_or_client)
            cluster = isinstance(url_or_client, RedisCluster)
        elif isinstance(url_or_client, str) and url_or_client.startswith(tuple(CLUSTER_SCHEMES)):
            self._make = self._cluster(url_or_client, timeout)
            self.where, cluster = redacted(url_or_client), True
        elif isinstance(url_or_client, str) and url_or_client.startswith(SERVER_SCHEMES):
            try:
                self._client = redis.Redis.from_url(
                    url_or_client, socket_timeout=timeout, socket_connect_timeout=timeout, health_check_interval=0
                )
            except ValueError as e:
                raise MLXKVError(f"cannot use the Redis URL {redacted(url_or_client)!r}: {e}") from None
            self.where, cluster = redacted(url_or_client), False
        else:
            shown = redacted(url_or_client) if isinstance(url_or_client, str) else url_or_client
            raise MLXKVError(f"--redis must be a Redis URL ({FORMS}), got {shown!r}")
        self.layout = ClusterLayout(prefix) if cluster else KeyLayout(prefix)

    @staticmethod
    def _cluster(url: str, timeout: float):
        first, others = _cluster_nodes(url)
        try:
            options = redis.connection.parse_url(first)
        except ValueError as e:
            raise MLXKVError(f"cannot use the Redis URL {redacted(url)!r}: {e}") from None
        if "path" in options or options.get("db", 0) != 0:
            raise MLXKVError(f"{redacted(url)!r}: a Redis Cluster has one database (0)")

        def make():
            return RedisCluster(
                url=first,
                startup_nodes=others,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), CLUSTER_RETRIES),
            )

        return make

    @property
    def made(self) -> bool:
        """Whether the client exists (one server's always does: it connects per command)."""
        return self._client is not None

    @property
    def client(self):
        """The client, made now if it is a cluster's first use (raises while no startup node
        answers)."""
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make()
                client = self._client
        return client

    def probe(self) -> None:
        """Raise unless the tier answers: a PING of the server, or of every primary of the
        cluster (a node that failed leaves the slot table once its replica is promoted)."""
        client = self.client
        if isinstance(client, RedisCluster):
            client.ping(target_nodes=RedisCluster.PRIMARIES)
        else:
            client.ping()
