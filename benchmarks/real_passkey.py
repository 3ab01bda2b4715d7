"""Where a fetched model's own context limit is: a 5-digit pass key hidden in filler text, asked
for at the end, at a few prompt lengths (docs/models.md, "Context").

Each trial hides a different key at a different depth of the filler ("The grass is green. The
sky is blue. ..."), asks in the model's chat template (plain text without one), and decodes
greedily on full-precision caches (mlx-lm's own); a trial passes when the key's digits appear
in the answer.

    python -m benchmarks.real_passkey [--model smollm2-135m] [--dtype bfloat16]
        [--lengths 256,512,768,1024] [--trials 3]
"""

import argparse
import random
import sys
import time

from .common import write_result

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


def prompt_tokens(tokenizer, length: int, key: int, depth: float) -> list[int]:
    """A prompt of about ``length`` tokens with the key sentence at ``depth`` (0..1) of the filler."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "

    def render(n: int) -> list[int]:
        at = int(n * depth)
        text = "There is a pass key hidden in this text. Find it and remember it. "
        text += FILLER * at + needle + FILLER * (n - at) + QUESTION
        if tokenizer.chat_template:
            return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return tokenizer.encode(text)

    n = 1
    while len(render(n + 1)) <= length:
        n += 1
    return render(n)


def main(argv=None) -> int:
    import mlx_lm

    from mlxkv.models import fetch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--lengths", default="256,512,768,1024")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--out", help="result file (default: benchmarks/results/real_passkey.json)")
    args = p.parse_args(argv)
    model, tokenizer = mlx_lm.load(str(fetch(args.model, dtype=args.dtype)))
    rng = random.Random(0)
    rows = []
    for length in map(int, args.lengths.split(",")):
        found, trials = 0, []
        for t in range(args.trials):
            key, depth = rng.randrange(10000, 100000), (t + 0.5) / args.trials
            ids = prompt_tokens(tokenizer, length, key, depth)
            t0 = time.perf_counter()
            answer = mlx_lm.generate(model, tokenizer, ids, max_tokens=10)
            ok = str(key) in answer.replace(" ", "")
            found += ok
            trials.append({"tokens": len(ids), "key": key, "depth": depth, "answer": answer, "found": ok})
            print(
                f"{length}: {len(ids)} tokens, depth {depth:.2f}: {answer!r} {'ok' if ok else 'miss'} "
                f"({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        rows.append({"length": length, "found": found, "trials": trials})
        print(f"{args.model} {args.dtype}: ~{length} tokens: {found}/{args.trials}")
    print(write_result("real_passkey", {"model": args.model, "dtype": args.dtype, "rows": rows}, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
