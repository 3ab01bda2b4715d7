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
from real_models import GEMMA3, SMOLLM2, TIER_DTYPE, child_env, loaded, numpy_gemma3

import mlxkv
from mlxkv.models.seeded import SCHEMES

pytestmark = pytest.mark.real

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: chat turns that, with the tokens generated, pass the 32-token budgets of the eviction schemes
#: and the bf16-first switch at 16 (Gemma 3 270M has no chat template: its prompt is the text).
#: Prompt tokens are the cheap ones: a generated token also pays the output head (Gemma's
#: 262,144 rows are most of its step), so the checkpoint comes after BEFORE tokens and AFTER
#: more continue in the fresh process
QUESTIONS = {
    SMOLLM2: "Why is the sky blue?",
    GEMMA3: "A question about the light of the day, asked slowly and with many words, one by one: "
    "why is the sky so blue at noon?",
}
BEFORE, AFTER = 2, 2


def demo_processes() -> dict:
    """Both models' demos, started (MLX's CPU work is one thread each: two cores, two demos).
    ``conftest.py`` starts them as the session's collection ends when this module's demo test
    is selected, so they run beside the tier's other tests; the test waits for them."""
    env = child_env()  # OpenBLAS where installed: the demo compares only with its own resume
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    procs = {}
    for name, question in QUESTIONS.items():
        args = ["demo", "--model", name, "--dtype", TIER_DTYPE, "--before", str(BEFORE), "--after", str(AFTER)]
        args += ["--question", question]
        cmd = [sys.executable, "-m", "mlxkv.cli", *args]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return procs


def test_every_scheme_resumes_bit_identically_in_a_fresh_process(real_demos):
    procs = real_demos()
    outputs = {name: proc.communicate() for name, proc in procs.items()}
    for name, (out, err) in outputs.items():
        assert procs[name].returncode == 0, out + err
        assert "prompt tokens" in out and int(out.split(" prompt tokens")[0].split()[-1]) + BEFORE + AFTER > 32, out
        rows = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith(name + " ")}
        assert sorted(rows) == sorted(SCHEMES), out
        for scheme, row in rows.items():
            assert row[-2:] == ["yes", "0"], (name, scheme, row)
    gemma, smollm2 = outputs[GEMMA3][0], outputs[SMOLLM2][0]
    # the local layers stay rings under every scheme: five of every six
    assert "15 kv:rotating-plain + 3 kv:plain" in gemma and "15 kv:rotating-plain + 3 kv:tova:32:4" in gemma
    assert "30 kv:quant:4:64" in smollm2 and "30 kv:turboquant:8:3" in smollm2


#: a wrapped ring's batched row holds its positions oldest first, where mlx-lm's serial ring
#: holds them rotated: attention sums the same terms in another order, which float32 rounds
#: differently (7e-5 measured on the wrapped rows, 0 on the unwrapped one); tokens are equal
LOGPROB_TOLERANCE = 5e-4


def _text_tokens(tokenizer, n):
    """A deterministic text of at least ``n`` tokens (without the BOS)."""
    words = [f"Line {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 100} stones." for i in range(n)]
    ids = tokenizer.encode(" ".join(words))
    assert len(ids) >= n
    return ids[:n]


def test_batch_rows_on_wrapped_gemma_rings_equal_serial_rows():
    """Two rows continue one 520-token prefix (every local layer's 512 ring has wrapped) with
    different tails, a third starts fresh (its rings far from full); all decode together.
    Tokens equal the serial ones exactly, log-probabilities within LOGPROB_TOLERANCE.

    The prefix's keys and values are the real model's, from the numpy forward pass over the
    GGUF (tests/real_models.py; numpy's BLAS reads 520 positions in a few seconds where MLX's
    reference BLAS on this CPU takes most of a minute), written into the caches in one
    update as mlx-lm's prefill writes them; the rows continue through mlx-lm's model."""
    model, tokenizer = loaded(GEMMA3)
    prefix = _text_tokens(tokenizer, 520)
    tail = lambda text: tokenizer.encode(text, add_special_tokens=False)
    prompts = [tail(" So the red box"), tail(" Question: how many stones?"), prefix[:8]]
    head = mlxkv.make_cache(model, "bf16")
    for cache, (keys, values) in zip(head, numpy_gemma3(tuple(prefix))[1], strict=True):
        cache.update_and_fetch(mx.array(keys[None]), mx.array(values[None]))
    mx.eval([c.state for c in head])
    assert [c.kind for c in head].count("kv:rotating-plain") == 15 and head[0].offset == 520 > head[0].max_size
    starts = [lambda: copy.deepcopy(head)] * 2 + [lambda: mlxkv.make_cache(model, "bf16")]
    n = 4  # generated tokens per row: each pays Gemma's 262,144-row output head

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
