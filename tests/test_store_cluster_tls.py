"""The shared tier on a Redis Cluster over TLS (``rediss+cluster://``, the way managed
clusters are reached): 3 masters on loopback that speak TLS only, with a certificate of the
test's own authority (given with ``?ssl_ca_certs=``). A client that does not trust the
certificate, or that does not speak TLS, finds a failing tier: misses, never an error."""

import numpy as np
import pytest
from store_helpers import LocalCluster, build, forward, settled

from mlxkv import PromptStore
from mlxkv.models.seeded import prompt, tokenizer

BLOCK = 16
SECRET = "a-test-deployment-secret"


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(replicas=0, tls=True)
    yield c
    c.stop()


def _store(model, url):
    return PromptStore(model, tokenizer(), cap=64 << 20, redis=url, block_tokens=BLOCK, secret=SECRET)


def test_entries_are_shared_over_tls_and_an_untrusted_or_plain_connection_is_a_miss(models, cluster):
    nodes = ",".join(f"127.0.0.1:{p}" for p in cluster.ports[:2])
    url = f"rediss+cluster://{nodes}?ssl_ca_certs={cluster.ca}"
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
    for other, why in ((f"rediss+cluster://{nodes}", "CERTIFICATE_VERIFY_FAILED"), (f"redis+cluster://{nodes}", "")):
        store = _store(model, other)
        settled(store)
        assert store.take(tokens + [5]) is None
        health = store.counters()["tiers"]["redis"]
        assert not health["healthy"] and why in health["last_error"], health
        store.close()
