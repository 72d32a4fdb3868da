"""Engine outputs as OpenAI response bodies (workers/generation_results.py over
jobs/batches/response_bodies.py): n choices, best_of, echo, logprobs with alternatives, tool calls
forced or parsed from the model's own format. Every body is parsed by the openai client's own
types, so a shape OpenAI's SDK would not read fails here."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from nightshift.engine.types import Choice, GenerationOutput, RequestError
from nightshift.jobs.batches.openai_mapping import CHAT, COMPLETIONS
from nightshift.workers.generation_results import engine_sampling, generation_result, token_pieces

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer():
    from nightshift.engine import load_tokenizer

    return load_tokenizer("default")


def choice(tokenizer, index, text, finish="stop", logprobs=None, top=None):
    ids = tokenizer.encode(text, add_special_tokens=False)
    if logprobs is not None and not isinstance(logprobs, list):
        logprobs = [logprobs] * len(ids)
    if top is not None:
        top = [[(t, -0.1 * (k + 1)) for k, t in enumerate(top)] for _ in ids]
    return Choice(index, ids, text, finish, logprobs, top)


def output(choices, prompt_tokens=12, error=None):
    return GenerationOutput("7", choices, prompt_tokens, 4, sum(len(c.token_ids) for c in choices), 100.0, 101.5,
                            0.25, error)


def result(body, out, tokenizer, endpoint=CHAT, tool_format=None, row_id=7, prompt_ids=(1, 2, 3)):
    row = SimpleNamespace(id=row_id, body=body, prompt_token_ids=list(prompt_ids))
    return generation_result(row, out, endpoint, "SmolLM2-135M-Instruct", tokenizer, tool_format)


def test_n_choices_with_top_logprobs(tokenizer):
    body = {"messages": MESSAGES, "n": 3, "logprobs": True, "top_logprobs": 2}
    alternatives = tokenizer.encode(" yes no", add_special_tokens=False)
    out = output([choice(tokenizer, i, f"Answer {i}!", logprobs=-0.5, top=alternatives) for i in (2, 0, 1)])
    r = result(body, out, tokenizer)
    parsed = ChatCompletion.model_validate(r.response_body)
    assert [c.index for c in parsed.choices] == [0, 1, 2]
    assert [c.message.content for c in parsed.choices] == ["Answer 0!", "Answer 1!", "Answer 2!"]
    assert parsed.usage.prompt_tokens == 12 and parsed.usage.completion_tokens == out.completion_tokens
    assert parsed.usage.total_tokens == 12 + out.completion_tokens
    for c in parsed.choices:
        assert "".join(t.token for t in c.logprobs.content) == c.message.content
        for t in c.logprobs.content:
            assert [a.token for a in t.top_logprobs] == [" yes", " no"]
            assert [a.logprob for a in t.top_logprobs] == [-0.1, -0.2] and t.top_logprobs[0].bytes == list(b" yes")
    assert r.finish_reason == "stop" and r.completion_tokens == out.completion_tokens


def test_no_alternatives_asked_gives_empty_top_logprobs(tokenizer):
    r = result({"messages": MESSAGES, "logprobs": True}, output([choice(tokenizer, 0, "Hi", logprobs=-1.0)]), tokenizer)
    content = ChatCompletion.model_validate(r.response_body).choices[0].logprobs.content
    assert [t.top_logprobs for t in content] == [[]] * len(content)
    assert result({"messages": MESSAGES}, output([choice(tokenizer, 0, "Hi", logprobs=-1.0)]),
                  tokenizer).response_body["choices"][0]["logprobs"] is None


def test_a_named_function_answers_with_its_call(tokenizer):
    body = {"messages": MESSAGES, "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = result(body, output([choice(tokenizer, 0, '{"city":"Paris"}')]), tokenizer)
    c = ChatCompletion.model_validate(r.response_body).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", '{"city":"Paris"}')
    assert call.id.startswith("call_") and call.id == result(body, output([choice(tokenizer, 0, '{"city":"Paris"}')]),
                                                             tokenizer).response_body["choices"][0]["message"][
        "tool_calls"][0]["id"]                                            # the same id on a re-run
    assert r.finish_reason == "tool_calls"
    # cut by max_tokens: still the call, its arguments a prefix, and "length"
    cut = result(body, output([choice(tokenizer, 0, '{"city":"Pa', "length")]), tokenizer).response_body
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city":"Pa'


def test_required_answers_with_every_call_each_with_its_own_id(tokenizer):
    body = {"messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": "required", "n": 2}
    text = '[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"get_time","arguments":{}}]'
    r = result(body, output([choice(tokenizer, 0, text), choice(tokenizer, 1, text[:40], "length")]), tokenizer)
    first, second = ChatCompletion.model_validate(r.response_body).choices
    assert [(t.function.name, t.function.arguments) for t in first.message.tool_calls] == [
        ("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
    assert first.finish_reason == "tool_calls"
    ids = [t.id for t in first.message.tool_calls] + [t.id for t in second.message.tool_calls]
    assert len(set(ids)) == len(ids) == 3
    assert second.finish_reason == "length" and second.message.tool_calls[0].function.arguments == '{"cit'


def test_auto_parses_the_models_own_format(tokenizer):
    body = {"messages": MESSAGES, "tools": [WEATHER, TIME]}
    text = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    c = ChatCompletion.model_validate(result(body, output([choice(tokenizer, 0, text)]), tokenizer,
                                             tool_format="hermes").response_body).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "I will check."
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [
        ("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
    # parallel_tool_calls false: one call
    c = ChatCompletion.model_validate(result({**body, "parallel_tool_calls": False}, output([choice(tokenizer, 0, text)]),
                                             tokenizer, tool_format="hermes").response_body).choices[0]
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    # no call, or a call of a function that was not offered: the answer is content
    for plain in ("It is sunny in Paris.", '<tool_call>\n{"name": "send_email", "arguments": {}}\n</tool_call>'):
        c = ChatCompletion.model_validate(result(body, output([choice(tokenizer, 0, plain)]), tokenizer,
                                                 tool_format="hermes").response_body).choices[0]
        assert (c.message.content, c.message.tool_calls, c.finish_reason) == (plain, None, "stop")
    # tool_choice none: never parsed
    c = ChatCompletion.model_validate(result({**body, "tool_choice": "none"}, output([choice(tokenizer, 0, text)]),
                                             tokenizer, tool_format="hermes").response_body).choices[0]
    assert c.message.content == text and c.message.tool_calls is None


def test_deprecated_functions_answer_with_function_call(tokenizer):
    body = {"messages": MESSAGES, "functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}}
    c = ChatCompletion.model_validate(result(body, output([choice(tokenizer, 0, '{"city":"Oslo"}')]),
                                             tokenizer).response_body).choices[0]
    assert c.finish_reason == "function_call" and c.message.tool_calls is None and c.message.content is None
    assert (c.message.function_call.name, c.message.function_call.arguments) == ("get_weather", '{"city":"Oslo"}')


def test_completions_top_logprobs_are_one_object_per_position(tokenizer):
    body = {"prompt": "The sky is", "n": 2, "logprobs": 2}
    alternatives = tokenizer.encode(" blue red", add_special_tokens=False)
    out = output([choice(tokenizer, i, " blue today", logprobs=-0.3, top=alternatives) for i in range(2)])
    parsed = Completion.model_validate(result(body, out, tokenizer, COMPLETIONS).response_body)
    assert [c.index for c in parsed.choices] == [0, 1]
    lp = parsed.choices[0].logprobs
    assert "".join(lp.tokens) == " blue today"
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert lp.top_logprobs == [{" blue": -0.1, " red": -0.2}] * len(lp.tokens)
    body["logprobs"] = 0
    parsed = Completion.model_validate(result(body, out, tokenizer, COMPLETIONS).response_body)
    assert parsed.choices[0].logprobs.top_logprobs is None


def test_best_of_returns_the_n_likeliest_best_first_and_counts_all(tokenizer):
    body = {"prompt": "Once", "n": 2, "best_of": 4}
    sums = {0: -9.0, 1: -1.0, 2: -5.0, 3: -2.0}
    choices = [choice(tokenizer, i, f" story {i}", logprobs=[sums[i] / 3] * 3) for i in range(4)]
    out = output(choices)
    body_out = result(body, out, tokenizer, COMPLETIONS).response_body
    parsed = Completion.model_validate(body_out)
    assert [(c.index, c.text) for c in parsed.choices] == [(0, " story 1"), (1, " story 3")]
    assert parsed.choices[0].logprobs is None                           # not asked for: used to rank only
    assert parsed.usage.completion_tokens == out.completion_tokens      # all four ran
    body["logprobs"] = 0
    parsed = Completion.model_validate(result(body, out, tokenizer, COMPLETIONS).response_body)
    assert parsed.choices[0].logprobs.token_logprobs[0] == pytest.approx(-1 / 3)


def test_echo_puts_the_prompt_first(tokenizer):
    out = output([choice(tokenizer, 0, " upon a time")])
    assert Completion.model_validate(result({"prompt": "Once", "echo": True}, out, tokenizer, COMPLETIONS)
                                     .response_body).choices[0].text == "Once upon a time"
    ids = tokenizer.encode("Once", add_special_tokens=False)
    assert result({"prompt": ids, "echo": True}, out, tokenizer, COMPLETIONS,
                  prompt_ids=ids).response_body["choices"][0]["text"] == "Once upon a time"
    assert result({"prompt": "Once"}, out, tokenizer, COMPLETIONS).response_body["choices"][0]["text"] == " upon a time"


def test_an_engine_refusal_is_an_error_body_naming_the_field(tokenizer):
    err = RequestError("invalid_request", "Unimplemented keys: [\"if\"]", "response_format.json_schema.schema")
    r = result({"messages": MESSAGES}, output([], error=err), tokenizer)
    assert r.response_status_code == 400 and r.finish_reason == "error"
    assert r.response_body == {"error": {"message": err.message, "type": "invalid_request_error",
                                         "param": "response_format.json_schema.schema", "code": "invalid_request"}}


def test_the_sampling_dict_becomes_the_engines_params():
    from nightshift.engine.types import StructuredOutput

    params = engine_sampling({"max_tokens": 5, "n": 2, "logit_bias": {3: 1.0},
                              "structured": {"kind": "json_object", "spec": None, "param": "response_format"}})
    assert params.structured == StructuredOutput("json_object", None, "response_format") and params.n == 2
    assert engine_sampling({"max_tokens": 5, "structured": None}).structured is None


def test_token_pieces_without_a_tokenizer():
    assert token_pieces(None, [1, 2]) == (None, None)
