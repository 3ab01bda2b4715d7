"""Requests ``mlxkv serve`` refuses, and what the others see meanwhile: the server on a
loopback port, the official ``openai`` client, 8 concurrent streams answered with exactly
``mlx_lm.generate``'s text while bad requests arrive (each a 400 that says what is wrong,
none reaching the generation thread the streams share); CORS off unless asked for."""

import http.client
import json
import os
import re
import socket
import threading
import time

import openai
import pytest
from serve_helpers import Running, openai_client, reference_answers, words

from mlxkv.models.seeded import VOCAB, build_model, prompt, save_model_dir
from mlxkv.serve.server import vocabulary_size

SCHEME = "bf16"
STREAM_TOKENS = 160
NO_EOS = {0: -100.0}  # the streams' logit_bias: token 0 (the end of sequence) is never sampled

# (endpoint, body, what the 400 says): each reached mlx-lm's generation thread and failed
# every request in flight there (or, for logit_bias, aborted the process), or named
# something the server does not serve
BAD = [
    ("completions", {"prompt": ""}, r"the prompt is empty: a request needs at least one prompt token"),
    ("chat", {"messages": [{"role": "user"}]}, r"the messages render to no token \(a message without content\?\)"),
    ("completions", {"prompt": "<01>", "stop": 5}, r"stop must be a string or a list of strings, got 5"),
    ("completions", {"prompt": "<01>", "stop": ["<02>", 3]}, r"stop must be a string or a list of strings"),
    (
        "completions",
        {"prompt": "<01>", "logit_bias": {"256": 3}},
        r"logit_bias has token id 256, outside the model's vocabulary: ids are 0 to 255",
    ),
    ("completions", {"prompt": "<01>", "logit_bias": {str(10**9): 3}}, r"logit_bias has token id 1000000000"),
    ("completions", {"prompt": "<01>", "logit_bias": {"-1": 3}}, r"logit_bias has token id -1"),
    (
        "completions",
        {"prompt": "<01>", "temperature": 0.7, "top_k": VOCAB},
        r"top_k must be below the model's vocabulary of 256 tokens",
    ),
    ("completions", {"prompt": "<01>", "seed": -1}, r"seed must be an integer in \[0, 2\*\*64\), got -1"),
    ("completions", {"prompt": "<01>", "model": "gpt-4"}, r"model 'gpt-4' is not served here"),
    ("completions", {"prompt": "<01>", "adapters": "/tmp"}, r"adapters '/tmp' is not served here"),
    ("completions", {"prompt": [1, 2]}, r"prompt must be a string"),
    ("chat", {"messages": []}, r"messages must be a non-empty list"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, r"messages\[0\]\.content must be a string"),
    ("chat", {"messages": ["hi"]}, r"messages\[0\] must be an object with a string role"),
    ("completions", {"prompt": "<01>", "stream_options": {"x": 1}}, r"stream_options must be an object"),
    ("completions", {"prompt": "<01>", "max_tokens": 0}, r"max_tokens must be at least 1"),  # mlx-lm's own
]


@pytest.fixture(scope="module")
def reference(llama_dir):
    return reference_answers(llama_dir, SCHEME)


@pytest.fixture(scope="module")
def server(llama_dir):
    s = Running("--model", llama_dir, "--scheme", SCHEME)
    yield s
    s.stop()


def send(client, endpoint, body):
    body = dict(body)
    common = {"model": body.pop("model", "default_model"), "max_tokens": body.pop("max_tokens", 4)}
    if endpoint == "chat":
        return client.chat.completions.create(messages=body.pop("messages"), extra_body=body, **common)
    return client.completions.create(prompt=body.pop("prompt"), extra_body=body, **common)


def raw_post(port, body: bytes, content_type="application/json", path="/v1/completions", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body, {"Content-Type": content_type, **(headers or {})})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response, json.loads(data)


@pytest.mark.parametrize("endpoint, body, says", BAD, ids=[re.sub(r"\W+", "-", b[2])[:40] for b in BAD])
def test_a_bad_request_gets_a_400_that_says_what_is_wrong(server, endpoint, body, says):
    with pytest.raises(openai.BadRequestError) as caught:
        send(openai_client(server.port), endpoint, body)
    assert caught.value.status_code == 400 and caught.value.type == "invalid_request_error"
    assert re.search(says, str(caught.value)), caught.value  # the client shows what is wrong


def test_bad_requests_among_eight_streams_leave_every_stream_its_answer(server, reference):
    """The bad requests arrive while 8 streams decode in one batch: each gets its 400, every
    stream gets exactly its ``mlx_lm.generate`` text, no generation failure."""
    prompts = [[1 + i] + prompt(20, seed=200 + i)[1:] for i in range(8)]
    client = openai_client(server.port)
    started = [threading.Event() for _ in prompts]
    texts, errors, last_chunk = [None] * 8, [None] * 8, [0.0] * 8
    failures = server.server.generator.failures

    def stream(i):
        try:
            text = ""
            events = client.completions.create(
                model="default_model",
                prompt=words(prompts[i]),
                max_tokens=STREAM_TOKENS,
                temperature=0.0,
                logit_bias={str(t): b for t, b in NO_EOS.items()},
                stream=True,
            )
            for event in events:
                text += event.choices[0].text if event.choices else ""
                last_chunk[i] = time.monotonic()
                started[i].set()
            texts[i] = text
        except Exception as e:  # reported below, with the stream it ended
            errors[i] = e
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started)
    answers = [None] * len(BAD)

    def bad(j):
        try:
            answers[j] = ("answered", send(client, BAD[j][0], BAD[j][1]))
        except openai.APIStatusError as e:
            answers[j] = (e.status_code, str(e))
        except Exception as e:  # reported below, with the request it ended
            answers[j] = (type(e).__name__, str(e))

    senders = [threading.Thread(target=bad, args=(j,)) for j in range(len(BAD))]
    for t in senders:
        t.start()
    for t in senders:
        t.join(300)
    refused_at = time.monotonic()
    for t in threads:
        t.join(300)
    assert errors == [None] * 8
    for (_, _, says), answer in zip(BAD, answers):
        assert answer is not None and answer[0] == 400 and re.search(says, answer[1]), (says, answer)
    in_flight = sum(t > refused_at for t in last_chunk)  # the first streams may have joined ahead of the rest
    assert in_flight >= 4, f"only {in_flight} streams outlived the bad requests: the test proves too little"
    for p, text in zip(prompts, texts):
        assert text == reference(p, STREAM_TOKENS, logit_bias=NO_EOS)
    assert server.server.generator.failures == failures


def test_a_number_that_is_not_finite_or_a_body_that_is_not_json_is_refused(server):
    response, data = raw_post(server.port, b'{"prompt": "<01>", "max_tokens": 3, "temperature": NaN}')
    assert response.status == 400 and data["error"]["message"] == "temperature must be a finite number, got nan"
    assert data["error"]["param"] == "temperature"
    response, data = raw_post(server.port, b'{"prompt": "<01>", "max_tokens": 3}', content_type="text/plain")
    assert response.status == 415 and "Content-Type: application/json" in data["error"]["message"]
    response, data = raw_post(server.port, b'{"prompt": "<01>", "max_tokens": 3')
    assert response.status == 400 and data["error"]["message"].startswith("the request body is not JSON")
    response, data = raw_post(server.port, b'{"prompt": "<01>", "max_tokens": 3}')
    assert response.status == 200 and data["usage"]["completion_tokens"] == 3


def test_cors_is_off_unless_origins_are_given(server, llama_dir):
    origin = {"Origin": "https://page.example"}
    response, _ = raw_post(server.port, b'{"prompt": "<01>", "max_tokens": 2}', headers=origin)
    assert response.status == 200 and response.getheader("Access-Control-Allow-Origin") is None
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("OPTIONS", "/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST"})
    preflight = conn.getresponse()
    preflight.read()
    assert preflight.getheader("Access-Control-Allow-Origin") is None
    assert preflight.getheader("Access-Control-Allow-Methods") is None
    allowed = Running("--model", llama_dir, "--scheme", SCHEME, "--allowed-origins", "https://page.example")
    try:
        response, _ = raw_post(allowed.port, b'{"prompt": "<01>", "max_tokens": 2}', headers=origin)
        assert response.getheader("Access-Control-Allow-Origin") == "https://page.example"
        other = {"Origin": "https://elsewhere.example"}
        response, _ = raw_post(allowed.port, b'{"prompt": "<01>", "max_tokens": 2}', headers=other)
        assert response.getheader("Access-Control-Allow-Origin") is None
    finally:
        allowed.stop()


def test_a_prompt_token_the_model_has_no_row_for_is_refused(tmp_path):
    """A tokenizer with more tokens than the model's embedding (256 words, 200 rows): a token
    past the rows would be read outside the embedding; it gets a 400, the rest is served."""
    small = Running("--model", save_model_dir("llama", str(tmp_path / "small"), vocab_size=200), "--scheme", SCHEME)
    try:
        client = openai_client(small.port)
        with pytest.raises(openai.BadRequestError, match="token id 255, outside the model's vocabulary of 200"):
            client.completions.create(model="default_model", prompt="<01> <ff>", max_tokens=3)
        with pytest.raises(openai.BadRequestError, match="token id 200, outside the model's vocabulary"):
            client.completions.create(model="default_model", prompt="<01>", max_tokens=3, logit_bias={"200": 1})
        answer = client.completions.create(
            model="default_model", prompt="<01> <c7>", max_tokens=3, logit_bias={"199": 1}
        )
        assert answer.usage.completion_tokens == 3
    finally:
        small.stop()


def test_every_name_of_the_served_model_joins_the_running_batch_and_never_reloads(tmp_path, llama_dir, reference):
    """mlx-lm reloads the model for another name of it (its real path, which /v1/models
    lists) and drains the batch for a request that names it differently: here every name of
    the served model is the one model, and the answer echoes the name sent."""
    link = tmp_path / "model"
    link.symlink_to(llama_dir)
    served = Running("--model", str(link), "--scheme", SCHEME)
    try:
        model = served.server.generator.model_provider.model
        client = openai_client(served.port)
        first_chunk, enough, ended = threading.Event(), threading.Event(), []

        def stream():  # far longer than the requests below; cut off once they are answered
            events = client.completions.create(
                model="default_model",
                prompt=words([3] + prompt(16, seed=300)[1:]),
                max_tokens=4000,
                logit_bias={str(t): b for t, b in NO_EOS.items()},
                stream=True,
            )
            for _ in events:
                first_chunk.set()
                if enough.is_set():
                    break
            events.close()
            ended.append(time.monotonic())

        thread = threading.Thread(target=stream)
        thread.start()
        assert first_chunk.wait(120)
        for i, name in enumerate((str(link), os.path.realpath(link), "default_model")):
            p = [4 + i] + prompt(9, seed=310 + i)[1:]
            answer = client.completions.create(model=name, prompt=words(p), max_tokens=4, temperature=0.0)
            assert answer.model == name and answer.choices[0].text == reference(p, 4)
        assert not ended, "a request waited for the batch to drain"
        enough.set()
        thread.join(300)
        assert served.server.generator.model_provider.model is model, "the model was loaded again"
    finally:
        served.stop()


def test_image_parts_for_a_model_without_images_are_refused_before_any_fetch(server):
    """mlx-lm fetches every http(s) image URL of a chat request before it finds the model
    takes none: any client could make the server open any URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(1.0)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/picture.png"
    parts = [{"type": "text", "text": "<01>"}, {"type": "image_url", "image_url": {"url": url}}]
    try:
        with pytest.raises(openai.BadRequestError, match="this model takes no images"):
            send(openai_client(server.port), "chat", {"messages": [{"role": "user", "content": parts}]})
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


def test_the_vocabulary_is_the_configs_or_measured_on_one_token():
    model = build_model("llama")  # its own copy: the config is edited below
    assert vocabulary_size(model) == VOCAB
    model.mlxkv_config = {k: v for k, v in model.mlxkv_config.items() if k != "vocab_size"}
    assert vocabulary_size(model) == VOCAB
