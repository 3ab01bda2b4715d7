"""Real chat requests for the benchmarks that run a fetched model: user turns through the
model's chat template (its plain text without one), questions alone and questions about a
passage of a few paragraphs, so prompt lengths spread from a few dozen tokens to several
hundred."""

PASSAGE = [
    "The river rises in the hills north of the town and runs south for about forty miles "
    "before it reaches the sea. In spring the snow melts and the water climbs over the lower "
    "fields, so the farmers plant late and harvest in the first weeks of autumn.",
    "The town was built around a stone bridge that the Romans left behind. Merchants crossed "
    "it with salt, wool and wine, and a market grew on the eastern bank, where the ground was "
    "higher and dry through the floods.",
    "In the nineteenth century a railway line followed the valley, and a mill was built beside "
    "the weir. It spun cotton for sixty years, employed half of the town at its busiest, and "
    "closed when cheaper cloth came from abroad.",
    "Today the mill holds a museum, a bakery and a school of music. Visitors walk the old "
    "towpath to the estuary, where birds gather on the mud flats at low tide and the light "
    "changes quickly with the weather.",
]
QUESTIONS = [
    "Why is the sky blue?",
    "What is the capital of France, and what river runs through it?",
    "Write a short poem about the sea.",
    "Explain in simple words how a refrigerator keeps food cold.",
    "Give me three tips for learning a new language.",
    "What is the difference between weather and climate?",
    "How do plants make their food?",
    "Name four planets of the solar system and say one thing about each.",
]


def chat_requests(tokenizer, new, n=16):
    """(prompt, max_tokens) pairs of real chat turns through the model's chat template: every
    other request a question about a passage of 1 to 12 paragraphs (so prompt lengths spread
    from a few dozen to several hundred tokens), ``new`` to ``2 new`` new tokens."""
    out = []
    for i in range(n):
        question = QUESTIONS[i % len(QUESTIONS)]
        if i % 2:
            paragraphs = [PASSAGE[j % len(PASSAGE)] for j in range(1 + (i * 11) // (n - 1))]
            question = "Read this text and answer.\n\n" + "\n\n".join(paragraphs) + "\n\n" + question
        ids = turn(tokenizer, question)
        out.append((ids, new + (i * new * 7 // 5) % (new + 1)))
    order = [(i * 7) % n for i in range(n)]  # arrivals mix long and short prompts
    return [out[i] for i in order]


def text_tokens(tokenizer, n):
    """A prompt of ``n`` tokens: the passage's paragraphs over and over, as one user turn."""
    paragraphs = []
    while True:
        paragraphs.append(PASSAGE[len(paragraphs) % len(PASSAGE)])
        ids = turn(tokenizer, "Read this text.\n\n" + "\n\n".join(paragraphs))
        if len(ids) >= n:
            return ids[:n]


def turn(tokenizer, text):
    """The token ids of one user turn and the assistant's opening, by the model's template."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(text)
