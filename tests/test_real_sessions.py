"""Every scheme on the real models: a session saves, loads in a fresh process and continues
bit-identically (through ``mlxkv demo --model``, which runs exactly that), and mlx-lm's batch
engine gives rows of Gemma 3's sliding-window rings, wrapped past the 512 window, the tokens
and log-probabilities they get alone."""

import copy
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from real_models import GEMMA3, SMOLLM2, TIER_DTYPE, loaded

import mlxkv
from mlxkv.models.seeded import SCHEMES

pytestmark = pytest.mark.real

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Gemma 3 270M has no chat template: a question long enough (with the tokens generated) to
#: pass the 32-token budgets of the eviction schemes and the bf16-first switch at 16
LONG_QUESTION = (
    "Here is a question about the weather and the light of the day, asked slowly and with many words so "
    "that it is long enough: why is the sky blue on a clear day, and why is it red at sunset?"
)


@pytest.mark.parametrize("name,question", [(SMOLLM2, None), (GEMMA3, LONG_QUESTION)])
def test_every_scheme_resumes_bit_identically_in_a_fresh_process(name, question):
    args = ["demo", "--model", name, "--dtype", TIER_DTYPE, "--before", "4", "--after", "4"]
    args += ["--question", question] if question else []
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "mlxkv.cli", *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[1]: line.split() for line in proc.stdout.splitlines() if line.startswith(name + " ")}
    assert sorted(rows) == sorted(SCHEMES), proc.stdout
    for scheme, row in rows.items():
        assert row[-2:] == ["yes", "0"], (scheme, row)
    kinds = proc.stdout
    if name == GEMMA3:  # the local layers stay rings under every scheme; five of every six
        assert "15 kv:rotating-plain + 3 kv:plain" in kinds and "15 kv:rotating-plain + 3 kv:tova" in kinds
    else:
        assert "30 kv:quant:4:64" in kinds and "30 kv:turboquant:8:3" in kinds


#: a batched row attends a key axis padded to the batch's longest row, so float32 attention sums
#: over a different length than the row alone does (the tokens are equal, the log-probabilities
#: within this)
LOGPROB_TOLERANCE = 1e-4


def _text_tokens(tokenizer, n):
    """A deterministic text of at least ``n`` tokens (without the BOS)."""
    words = [f"Line {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 100} stones." for i in range(n)]
    ids = tokenizer.encode(" ".join(words))
    assert len(ids) >= n
    return ids[:n]


def test_batch_rows_on_wrapped_gemma_rings_equal_serial_rows():
    """Two rows continue one 520-token prefix (every local layer's 512 ring has wrapped) with
    different tails, a third starts fresh (its rings far from full); all decode together.
    Tokens equal the serial ones exactly, log-probabilities within LOGPROB_TOLERANCE."""
    model, tokenizer = loaded(GEMMA3)
    prefix = _text_tokens(tokenizer, 520)
    tail = lambda text: tokenizer.encode(text, add_special_tokens=False)
    prompts = [tail(" So the red box"), tail(" Question: how many stones does the box of line 3 hold?"), prefix[:20]]
    head = mlxkv.make_cache(model, "bf16")
    mx.eval(model(mx.array([prefix]), cache=head))
    assert [c.kind for c in head].count("kv:rotating-plain") == 15 and head[0].offset == 520 > head[0].max_size
    starts = [lambda: copy.deepcopy(head)] * 2 + [lambda: mlxkv.make_cache(model, "bf16")]
    n = 6

    expected = []
    for p, start in zip(prompts, starts):
        steps = generate_step(mx.array(p), model, max_tokens=n, prompt_cache=start())
        expected.append([(int(t), lp) for t, lp in steps])

    gen = BatchGenerator(model, completion_batch_size=3, prefill_batch_size=3)
    uids = gen.insert(prompts, [n] * 3, caches=[start() for start in starts])
    got = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            got[r.uid].append((r.token, r.logprobs))
    gen.close()
    worst = []
    for row, (uid, want) in enumerate(zip(uids, expected)):
        assert [t for t, _ in got[uid]] == [t for t, _ in want], f"row {row}"
        worst.append(max(float(mx.abs(a - b).max()) for (_, a), (_, b) in zip(got[uid], want)))
    assert max(worst) <= LOGPROB_TOLERANCE, f"log-probabilities differ by {worst} per row"
