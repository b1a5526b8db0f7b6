"""`tierlm serve` speaks the OpenAI API that real clients send (`tierlm.commands.openai_api`): the `openai` SDK's
completions and chat completions with n, stop, seed, logprobs / top_logprobs and echo, each honoured — checked
against the model itself (transformers' own model of the exported folder for the log-probs) — or refused with a 400
naming the field; and lm-evaluation-harness's own API models against the server agree with `tierlm eval --harness`.
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from conftest import live_server  # noqa: E402
from tierlm.commands.chat import Chatbot  # noqa: E402
from tierlm.commands.generation import Sampling  # noqa: E402

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def sft(tiny_runs):
    bot = Chatbot(tiny_runs / "sft", "cpu", chat_only=False)
    yield bot
    bot.close()


def client_of(bot: Chatbot):
    """The `openai` SDK talking to the app in this process (FastAPI's test client is an httpx client)."""
    from fastapi.testclient import TestClient

    from tierlm.commands.serve import create_app

    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=TestClient(create_app(bot)))


@pytest.fixture(scope="module")
def client(sft):
    return client_of(sft)


def test_vllms_top_k_and_min_p_are_honoured(sft, client):
    """vLLM's sampling extensions: top_k 1, or min_p 1, leave the likeliest token alone, so a sampled reply is the
    greedy one; their no-op values (-1, 0) sample what a request without them samples under the same seed."""
    ask = dict(model=sft.name, messages=QUESTION, max_tokens=16)
    greedy = client.chat.completions.create(**ask, temperature=0).choices[0].message.content
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        hot = client.chat.completions.create(**ask, temperature=1.5, seed=3, n=2, extra_body=extra)
        assert [c.message.content for c in hot.choices] == [greedy, greedy]
    sampled = dict(ask, temperature=1.0, seed=11, n=3)
    plain = client.chat.completions.create(**sampled).choices
    off = client.chat.completions.create(**sampled, extra_body={"top_k": -1, "min_p": 0}).choices
    assert [c.message.content for c in off] == [c.message.content for c in plain]
    assert len({c.message.content for c in plain}) > 1  # sampling, not greedy


def test_penalties_are_honoured_as_the_engine_draws_them(sft, client):
    """presence / frequency penalties (OpenAI's) and repetition_penalty (vLLM's): the reply is what tierlm's engine
    draws with them, not the unpenalised one."""
    from tierlm.rollout.sampling import SamplingParams

    ask = dict(model=sft.name, messages=QUESTION, max_tokens=24, temperature=0)
    plain = client.chat.completions.create(**ask).choices[0].message.content
    prompt = sft.tokenizer.render_for_completion(QUESTION)
    for penalties in ({"frequency_penalty": 2.0, "presence_penalty": 1.0}, {"repetition_penalty": 2.0}):
        reply = client.chat.completions.create(**ask, extra_body=penalties).choices[0].message.content
        assert reply != plain, penalties
        mine = sft.chat_choices(QUESTION, Sampling(24, 0.0, **penalties))[0]
        [drawn] = sft.engine.generate(prompt, 1, 24, SamplingParams(0.0, **penalties))
        assert mine.text == reply and mine.tokens and drawn.tokens[: len(mine.tokens)] == mine.tokens


def test_n_seed_and_stop_in_both_endpoints(sft, client):
    greedy = client.chat.completions.create(model=sft.name, messages=QUESTION, temperature=0, max_tokens=24)
    text = greedy.choices[0].message.content
    assert text == sft.reply(QUESTION, temperature=0.0, max_new_tokens=24).text and len(text) > 8
    stop = text[5:8]  # a stop string the greedy reply contains (the fixture's model is barely trained)
    stopped = client.chat.completions.create(model=sft.name, messages=QUESTION, temperature=0, max_tokens=24, stop=stop)
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=sft.name, messages=QUESTION, temperature=0, max_tokens=24, stop=["#@!", stop], stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"

    sampled = dict(model=sft.name, messages=QUESTION, temperature=1.0, max_tokens=16, n=3, seed=7)
    first, again = client.chat.completions.create(**sampled), client.chat.completions.create(**sampled)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    other = client.chat.completions.create(**{**sampled, "seed": 8})
    assert [c.message.content for c in other.choices] != [c.message.content for c in first.choices]

    prompt = "What is 12 + 7? 12 + 7"
    plain = client.completions.create(model=sft.name, prompt=prompt, temperature=0, max_tokens=6)
    ids = [sft.tokenizer.document_separator_id, *sft.tokenizer.encode(prompt)]
    want = sft.complete(ids, Sampling(6, 0.0))[0]
    assert plain.choices[0].text == want.text and plain.usage.completion_tokens == want.completion_tokens
    by_ids = client.completions.create(model=sft.name, prompt=[ids, ids], temperature=0, max_tokens=6, n=2)
    assert [c.text for c in by_ids.choices] == [want.text] * 4 and [c.index for c in by_ids.choices] == [0, 1, 2, 3]
    streamed = client.completions.create(model=sft.name, prompt=prompt, temperature=0, max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_logprobs_are_the_models_own(sft, client, tiny_runs):
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_runs / "sft" / "model").eval()
    response = client.chat.completions.create(
        model=sft.name, messages=QUESTION, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    prompt = sft.tokenizer.render_for_completion(QUESTION)
    reply = sft.chat_choices(QUESTION, Sampling(12, 0.0, top_logprobs=0))[0]
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + reply.tokens])).logits[0].log_softmax(-1)
    expected = [float(logits[len(prompt) - 1 + i, t]) for i, t in enumerate(reply.tokens)]
    assert [t.logprob for t in content] == pytest.approx(expected, abs=1e-4)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy: the top token

    echoed = client.completions.create(
        model=sft.name, prompt="What is 2 + 3?", temperature=0, max_tokens=3, logprobs=1, echo=True
    )
    choice = echoed.choices[0]
    assert choice.text.startswith("What is 2 + 3?") and choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == echoed.usage.prompt_tokens + echoed.usage.completion_tokens
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs[1:])


def test_vllm_bench_serve_request_bodies(sft, tiny_runs):
    """The bodies `vllm bench serve` posts (vLLM's `vllm/benchmarks/lib/endpoint_request_func.py`, backends `openai`
    and `openai-chat`), read back as that client reads them: text from the chunks with choices, the completion
    tokens from the usage event."""
    import json

    from fastapi.testclient import TestClient

    from tierlm.commands.serve import create_app

    http, stop_ids = TestClient(create_app(sft)), sft.engine.stop_ids
    completions = {
        "model": sft.name, "prompt": "What is 2 + 3?", "repetition_penalty": 1.0, "max_tokens": 40, "logprobs": None,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0,
    }  # fmt: skip
    chat = {
        "model": sft.name, "messages": [{"role": "user", "content": [{"type": "text", "text": "What is 2 + 3?"}]}],
        "max_completion_tokens": 40, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
        "temperature": 0,
    }  # fmt: skip

    def reply(choice: dict) -> str:
        return choice["text"] if "text" in choice else choice["message"]["content"]

    for path, body, piece in [
        ("/v1/completions", completions, lambda choice: choice["text"]),
        ("/v1/chat/completions", chat, lambda choice: choice["delta"].get("content")),
    ]:
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        events = [line.removeprefix("data:").strip() for line in response.text.splitlines() if line.startswith("data:")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        text = "".join(piece(c["choices"][0]) or "" for c in chunks if c["choices"])
        usage = [c["usage"] for c in chunks if not c["choices"]]
        whole = http.post(path, json={**body, "stream": False, "stream_options": None}).json()
        assert text == reply(whole["choices"][0]) and usage == [whole["usage"]]
        assert usage[0]["completion_tokens"] == 40 and whole["choices"][0]["finish_reason"] == "length"

    # ignore_eos on either path of a bot: its engine alone (the fixture's) and the continuous batch. The fixture's
    # barely trained model seldom ends a turn, so its greedy reply's third token is made a stop token meanwhile.
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    batched = Chatbot(tiny_runs / "sft", "cpu", chat_only=False, batch_rows=4)
    try:
        for bot in (sft, batched):
            bot.engine.stop_ids = {bot.chat_choices(question, Sampling(40, 0.0, ignore_eos=True))[0].tokens[2]}
            asked = {**chat, "stream": False, "stream_options": None}
            answers = TestClient(create_app(bot))
            ended, past = (answers.post("/v1/chat/completions", json={**asked, "ignore_eos": i}).json() for i in (0, 1))
            assert ended["choices"][0]["finish_reason"] == "stop" and ended["usage"]["completion_tokens"] <= 3
            assert past["choices"][0]["finish_reason"] == "length" and past["usage"]["completion_tokens"] == 40
            assert reply(past["choices"][0]).startswith(reply(ended["choices"][0]))
    finally:
        sft.engine.stop_ids = batched.engine.stop_ids = stop_ids
        batched.close()

    refused = http.post("/v1/completions", json={**completions, "repetition_penalty": 2.5})  # vLLM's range: (0, 2]
    assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("repetition_penalty")


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),  # OpenAI's range: [-2, 2]
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 99}, "n"),
    ],
)
def test_a_field_the_server_does_not_honour_is_a_400_naming_it(sft, client, extra, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=sft.name, messages=QUESTION, max_tokens=4, **extra)
    assert refused.value.status_code == 400 and refused.value.body["message"].startswith(field)


def test_what_newer_clients_send_usage_in_a_stream_text_parts_and_the_developer_role(sft, client):
    """`stream_options.include_usage` (vLLM's benchmark client and many SDK users send it), content as a list of
    text parts and the `developer` role (OpenAI's system turn since o1), as OpenAI's API takes them."""
    asked = dict(model=sft.name, messages=QUESTION, temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**asked)
    chunks = list(client.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason is not None
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
    plain = list(client.chat.completions.create(**asked, stream=True))
    assert all(c.choices and c.usage is None for c in plain)  # not asked: no usage event

    asked = dict(model=sft.name, prompt=["What is 2 + 3?", "What is 4 + 4?"], temperature=0, max_tokens=5, n=2)
    whole = client.completions.create(**asked)
    chunks = list(client.completions.create(**asked, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage and whole.usage.prompt_tokens > 10

    for extra, message in [
        ({"stream_options": {"include_usage": True}}, "stream_options: only with stream: true"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=sft.name, messages=QUESTION, max_tokens=4, **extra)
        assert refused.value.body["message"].startswith(message)

    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "Answer with the sum."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is 2"}, {"type": "text", "text": "+ 3?"}]},
    ]
    plain = [{"role": "system", "content": "Answer with the sum."}, {"role": "user", "content": "What is 2\n+ 3?"}]
    got = client.chat.completions.create(model=sft.name, messages=parts, temperature=0, max_tokens=12)
    assert got.usage.prompt_tokens == len(sft.tokenizer.render_for_completion(plain))
    assert got.choices[0].message.content == sft.reply(plain, temperature=0.0, max_new_tokens=12).text
    with pytest.raises(openai.BadRequestError) as refused:
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        client.chat.completions.create(model=sft.name, messages=[{"role": "user", "content": [image]}], max_tokens=4)
    assert refused.value.body["message"].startswith("messages.0.content")


def test_a_base_model_serves_completions_and_refuses_chat(tiny_runs, tmp_path):
    """A model folder whose tokenizer has no chat template (a base model's, as the Hub has many)."""
    import json

    from tierlm.checkpoint.verify import MODEL_META_FILE, file_manifest

    folder = shutil.copytree(tiny_runs / "pre" / "model", tmp_path / "base")
    (folder / "chat_template.jinja").unlink()
    meta = json.loads((folder / MODEL_META_FILE).read_text())
    meta["manifest"] = file_manifest(folder, exclude=(MODEL_META_FILE,))  # the folder as saved without a template
    (folder / MODEL_META_FILE).write_text(json.dumps(meta))
    bot = Chatbot(folder, "cpu", chat_only=False)
    try:
        client = client_of(bot)
        with pytest.raises(openai.BadRequestError, match="suffix is not supported"):
            client.completions.create(model=bot.name, prompt="What is 2 + 3?", max_tokens=4, suffix="x")
        done = client.completions.create(model=bot.name, prompt="What is 2 + 3?", max_tokens=4, temperature=0)
        assert done.choices[0].finish_reason in ("stop", "length") and done.usage.completion_tokens > 0
        with pytest.raises(openai.BadRequestError, match="no chat template: send its prompts to /v1/completions"):
            client.chat.completions.create(model=bot.name, messages=QUESTION, max_tokens=4)
    finally:
        bot.close()


def responses(results: dict, task: str) -> list:
    """The harness's filtered response to each document of `task`, in document order."""
    samples = sorted(results["samples"][task], key=lambda sample: sample["doc_id"])
    return [sample["filtered_resps"] for sample in samples]


def test_lm_eval_api_models_against_the_server_agree_with_the_harness(sft, tiny_runs, tmp_path):
    """lm-evaluation-harness's own `local-completions` (multiple choice by log-likelihood, generation) and
    `local-chat-completions` (generation) run against `tierlm serve` on local arithmetic tasks, and score and
    answer as `tierlm eval --harness` (the harness on `TierlmLM`) does on the same model."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("uvicorn")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from test_harness import write_tasks
    from tierlm.commands.harness import TierlmLM
    from tierlm.commands.serve import create_app

    folder = tmp_path / "model"
    shutil.copytree(tiny_runs / "sft" / "model", folder)
    manager = TaskManager(include_path=str(write_tasks(tmp_path / "tasks")), include_defaults=False)  # its 14,659: 10 s
    tasks = ["tierlm_sums_mc", "tierlm_sums_gen"]
    lm = TierlmLM(sft.engine.model, sft.tokenizer)
    direct = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True)
    direct_chat = simple_evaluate(
        model=lm, tasks=tasks[1:], task_manager=manager, log_samples=True, apply_chat_template=True
    )
    with live_server(create_app(sft)) as base:
        url = f"{base}/v1"
        common = f"model={sft.name},num_concurrent=1,max_retries=1"
        served = simple_evaluate(
            model="local-completions",
            model_args=f"base_url={url}/completions,{common},tokenizer={folder},add_bos_token=True",
            tasks=tasks,
            task_manager=manager,
            log_samples=True,
        )
        chat = simple_evaluate(
            model="local-chat-completions",
            model_args=f"base_url={url}/chat/completions,{common}",
            tasks=tasks[1:],
            task_manager=manager,
            log_samples=True,
            apply_chat_template=True,
        )
    assert served["results"]["tierlm_sums_mc"]["acc,none"] == direct["results"]["tierlm_sums_mc"]["acc,none"]
    scores = [[score for score, _ in doc] for doc in responses(served, "tierlm_sums_mc")]  # each choice's
    assert scores == [
        [pytest.approx(score, abs=1e-4) for score, _ in doc] for doc in responses(direct, "tierlm_sums_mc")
    ]
    assert responses(served, "tierlm_sums_gen") == responses(direct, "tierlm_sums_gen")
    assert responses(chat, "tierlm_sums_gen") == responses(direct_chat, "tierlm_sums_gen")
