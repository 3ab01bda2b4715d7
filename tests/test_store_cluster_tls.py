"""The shared tier on a Redis Cluster over TLS with a password (``rediss+cluster://``, the
way managed clusters are reached): 3 masters on loopback that speak TLS only and require
``AUTH``, with a certificate of the test's own authority (given with ``?ssl_ca_certs=``). A
client that does not trust the certificate, does not speak TLS or has no password finds a
failing tier: misses, never an error."""

import numpy as np
import pytest
from store_helpers import LocalCluster, build, forward, settled

from mlxkv import PromptStore
from mlxkv.models.seeded import prompt, tokenizer

BLOCK = 16
SECRET = "a-test-deployment-secret"
PASSWORD = "a-cluster-password"


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(replicas=0, tls=True, password=PASSWORD)
    yield c
    c.stop()


def _store(model, url):
    """A store whose lookups may wait 10 s (a first read opens TLS connections to a node,
    which on a loaded machine can outlast the default 0.5 s budget: a miss, not what is
    tested here)."""
    return PromptStore(model, tokenizer(), cap=64 << 20, redis=url, block_tokens=BLOCK, secret=SECRET, redis_budget=10)


def test_entries_are_shared_over_tls_and_an_untrusted_plain_or_anonymous_client_misses(models, cluster):
    nodes = ",".join(f"127.0.0.1:{p}" for p in cluster.ports[:2])
    url = f"rediss+cluster://:{PASSWORD}@{nodes}?ssl_ca_certs={cluster.ca}"
    model = models("llama")
    tokens = prompt(40, seed=1)
    with _store(model, url) as writer:
        writer.put(tokens, build(model, "bf16", {}, tokens, 40))
        assert len(writer.flush().uploaded) == 1
    assert cluster.keys_matching("mlxkv:*")
    reader = _store(model, url)
    settled(reader)
    hit = reader.take(tokens + [5])
    assert hit is not None and hit.tier == "redis" and hit.prefix_len == 40
    want = forward(model, build(model, "bf16", {}, [], 1), tokens + [5])
    np.testing.assert_array_equal(forward(model, hit.caches, [5]), want)
    reader.close()
    others = (
        (f"rediss+cluster://:{PASSWORD}@{nodes}", "CERTIFICATE_VERIFY_FAILED"),
        (f"redis+cluster://:{PASSWORD}@{nodes}", ""),
        (f"rediss+cluster://{nodes}?ssl_ca_certs={cluster.ca}", "authenticated"),
    )
    for other, why in others:
        store = _store(model, other)
        settled(store)
        assert store.take(tokens + [5]) is None
        health = store.counters()["tiers"]["redis"]
        assert not health["healthy"] and why in health["last_error"], health
        store.close()
