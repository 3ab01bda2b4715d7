"""What each live family is called: the kind its caches report (exact, or the prefix its
parameters follow) and the scheme strings that name it.

The live caches read their kinds from here (``KVCache.kind``, ``QuantizedKVCache.kind_prefix``)
and the kind records do too, so a header read, a verification or ``mlxkv schemes`` reaches
every family's name without importing a live cache class (which subclasses mlx-lm's, and with
it imports mlx-lm and transformers). Nothing here imports anything.
"""

PLAIN_KIND = "kv:plain"
AFFINE_KIND_PREFIX = "kv:quant:"  # kv:quant:<bits>:<group>
RING_KIND = "kv:rotating-plain"
AFFINE_RING_KIND_PREFIX = "kv:rotating-quant:"  # kv:rotating-quant:<bits>:<group>
RECURRENT_KIND = "ssm"
TURBO_KIND_PREFIX = "kv:turboquant:"  # kv:turboquant:<k bits>:<v bits>
TOVA_KIND_PREFIX = "kv:tova:"  # kv:tova:<budget>:<sink>
QFILTERS_KIND_PREFIX = "kv:qfilters:"  # kv:qfilters:<budget>:<sink>:<recent>

#: the scheme strings each family parses (``make_cache(model, scheme)``), as regular expressions
PLAIN_SCHEME = r"bf16|fp16|plain"
AFFINE_SCHEME = r"kv(?P<bits>\d+)(?:-g(?P<group>\d+))?(?:-start(?P<start>\d+))?"
TURBO_SCHEME = r"turbo-k(?P<k>\d+)v(?P<v>\d+)(?:-start(?P<start>\d+))?"
TOVA_SCHEME = r"tova-b(?P<budget>\d+)-s(?P<sink>\d+)"
QFILTERS_SCHEME = r"qfilters-b(?P<budget>\d+)-s(?P<sink>\d+)-r(?P<recent>\d+)"
