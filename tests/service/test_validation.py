"""Line validation: every OpenAI error code, one entry per bad line, limits; shard planning; body mapping."""
from __future__ import annotations

import orjson
import pytest

from nightshift.jobs.batches.openai_mapping import RequestBodyError, sampling_kwargs
from nightshift.jobs.batches.response_bodies import ChoiceOutput, TokenLogprob, response_body
from nightshift.jobs.batches.shard_planning import plan_shards
from nightshift.jobs.batches.validation import validate_lines

CHAT = "/v1/chat/completions"
MODELS = {"default", "SmolLM2-135M-Instruct"}


def line(custom_id="a", method="POST", url=CHAT, body=None, **extra):
    obj = {"custom_id": custom_id, "method": method, "url": url,
           "body": body if body is not None else {"model": "default", "messages": [{"role": "user", "content": "hi"}]}}
    obj.update(extra)
    return orjson.dumps(obj)


def run(lines, endpoint=CHAT, max_lines=100, max_bytes=10**6):
    return validate_lines(lines, endpoint, MODELS, max_lines=max_lines, max_bytes=max_bytes)


def test_valid_file_keeps_lines_and_model():
    r = run([line("a"), b"", line("b")])
    assert r.ok and [(v.line, v.custom_id) for v in r.lines] == [(1, "a"), (3, "b")]
    assert r.model == "default"


@pytest.mark.parametrize("raw, code, param", [
    (b"{not json", "invalid_json_line", None),
    (b"\xff\xfe{}", "invalid_json_line", None),
    (b"[1, 2]", "invalid_json_line", None),
    (orjson.dumps({"method": "POST", "url": CHAT, "body": {"model": "default", "messages": [{"role": "user", "content": "x"}]}}),
     "missing_required_parameter", "custom_id"),
    (line(method="GET"), "invalid_request", "method"),
    (line(url="/v1/embeddings"), "invalid_url", "url"),
    (line(body=[1]), "invalid_request", "body"),
    (line(body={"model": "default", "messages": [{"role": "user", "content": "x"}], "stream": True}),
     "streaming_unsupported", "body.stream"),
    (line(body={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), "model_not_found", "body.model"),
    (line(body={"messages": [{"role": "user", "content": "x"}]}), "invalid_request", "body.model"),
    (line(body={"model": "default"}), "invalid_request", "body.messages"),
])
def test_each_bad_line_names_line_code_and_param(raw, code, param):
    r = run([line("ok"), raw])
    assert not r.ok
    assert r.errors == [{"code": code, "param": param, "line": 2, "message": r.errors[0]["message"]}]
    assert r.errors[0]["message"]


def test_n_and_other_body_fields_are_judged_per_request_not_at_validation():
    # n (1-128), tools, response_format, sampling values: a bad one fails only its request, in the engine worker
    bodies = [{"model": "default", "messages": [{"role": "user", "content": "x"}], "n": 3},
              {"model": "default", "messages": [{"role": "user", "content": "x"}], "n": 500},
              {"model": "default", "messages": [{"role": "user", "content": "x"}], "tools": "nonsense"},
              {"model": "default", "messages": [{"role": "user", "content": "x"}], "no_such_field": 1}]
    assert run([line(str(i), body=b) for i, b in enumerate(bodies)]).ok
    assert sampling_kwargs(bodies[0], CHAT, 5, 2048, 256, 16)["n"] == 3
    with pytest.raises(RequestBodyError) as e:
        sampling_kwargs(bodies[1], CHAT, 5, 2048, 256, 16)
    assert e.value.param == "n" and "between 1 and 128" in e.value.message


def test_an_assistant_message_that_calls_tools_may_leave_content_out():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    body = {"model": "default", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": calls},
                                             {"role": "tool", "tool_call_id": "call_1", "content": "42"}]}
    assert run([line(body=body)]).ok
    body["messages"][1] = {"role": "assistant"}
    assert [e["param"] for e in run([line(body=body)]).errors] == ["body.messages.1"]


def test_missing_method_and_url_give_one_error_each():
    raw = orjson.dumps({"custom_id": "x", "body": {"model": "default", "messages": [{"role": "user", "content": ""}]}})
    r = run([raw])
    assert sorted(e["param"] for e in r.errors) == ["method", "url"]
    assert {e["code"] for e in r.errors} == {"missing_required_parameter"}


def test_duplicate_custom_id_and_mixed_models_and_several_bad_lines():
    other = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}]}
    r = run([line("a"), line("a"), line("b", body=other), b"oops", line("c")])
    assert [(e["line"], e["code"]) for e in r.errors] == [(2, "duplicate_custom_id"), (3, "invalid_request"),
                                                          (4, "invalid_json_line")]
    assert "line 1" in r.errors[0]["message"]
    assert r.errors_object()["object"] == "list"


def test_completions_prompt_rules():
    ep = "/v1/completions"
    good = line(url=ep, body={"model": "default", "prompt": "Once upon"})
    ids = line("i", url=ep, body={"model": "default", "prompt": [1, 2, 3]})
    bad = line("b", url=ep, body={"model": "default", "prompt": {"x": 1}})
    missing = line("m", url=ep, body={"model": "default"})
    r = run([good, ids, bad, missing], endpoint=ep)
    assert [(e["line"], e["param"]) for e in r.errors] == [(3, "body.prompt"), (4, "body.prompt")]


def test_limits_and_empty_file():
    r = run([line(str(i)) for i in range(5)], max_lines=3)
    assert r.errors[-1]["code"] == "too_many_tasks" and r.errors[-1]["line"] == 4
    r = run([line(str(i)) for i in range(5)], max_bytes=200)
    assert r.errors[-1]["code"] == "file_too_large"
    r = run([b"", b"  "])
    assert r.errors == [{"code": "empty_file", "message": "The input file contains no requests.", "param": None,
                         "line": None}]


def test_error_list_is_bounded():
    r = run([b"bad"] * 1500, max_lines=5000)
    data = r.errors_object()["data"]
    assert len(data) == 1001 and data[-1]["code"] == "too_many_errors" and "500 more" in data[-1]["message"]


# --- shard planning -------------------------------------------------------------------

def test_shards_group_shared_prefixes_and_respect_budget():
    sys_a, sys_b = [1] * 20, [2] * 20
    prompts = [sys_a + [i] for i in range(10)] + [sys_b + [i] for i in range(10)]
    prompts = prompts[::2] + prompts[1::2]  # interleave the two groups
    plan = plan_shards(prompts, [10] * 20, token_budget=10 * 31, max_requests=100)
    assert sum(len(s.members) for s in plan) == 20
    assert sorted(i for s in plan for i in s.members) == list(range(20))
    for s in plan:
        assert s.planned_tokens <= 310
        assert len({prompts[i][0] for i in s.members}) == 1  # one prefix group per shard


def test_shard_cut_moves_to_group_boundary():
    prompts = [[1] * 10 + [i] for i in range(6)] + [[2] * 10 + [i] for i in range(6)]
    plan = plan_shards(prompts, [0] * 12, token_budget=11 * 8, max_requests=100)  # 8 fit; the group boundary is at 6
    assert [len(s.members) for s in plan] == [6, 6]


def test_oversized_request_gets_its_own_shard():
    plan = plan_shards([[1] * 50, [2] * 5, [3] * 5], [100, 1, 1], token_budget=20, max_requests=100)
    assert [len(s.members) for s in plan] == [1, 2]


def test_shards_hold_at_most_max_requests_and_cut_at_a_group_boundary():
    prompts = [[1] * 10 + [i] for i in range(6)] + [[2] * 10 + [i] for i in range(6)]
    plan = plan_shards(prompts, [0] * 12, token_budget=10 ** 6, max_requests=8)  # 8 fit; the boundary is at 6
    assert [len(s.members) for s in plan] == [6, 6]
    plan = plan_shards([[1, i] for i in range(10)], [4] * 10, token_budget=10 ** 6, max_requests=3)
    assert [len(s.members) for s in plan] == [3, 3, 3, 1]


# --- OpenAI body -> sampling, output -> body ------------------------------------------

def test_sampling_kwargs_defaults_and_clamp():
    kw = sampling_kwargs({"messages": []}, CHAT, prompt_len=2000, max_model_len=2048, default_chat=256,
                         default_completion=16)
    assert kw["max_tokens"] == 48 and kw["temperature"] == 1.0 and kw["stop"] == []
    kw = sampling_kwargs({"max_tokens": 5000, "temperature": 0, "stop": "\n", "seed": 3}, CHAT, 10, 2048, 256, 16)
    assert kw["max_tokens"] == 5000 and kw["temperature"] == 0.0 and kw["stop"] == ["\n"] and kw["seed"] == 3
    assert sampling_kwargs({"prompt": "x"}, "/v1/completions", 3, 2048, 256, 16)["max_tokens"] == 16


@pytest.mark.parametrize("body, param", [({"temperature": 3}, "temperature"), ({"top_p": -1}, "top_p"),
                                         ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "9"}, "max_tokens"),
                                         ({"stop": [1]}, "stop"), ({"seed": 1.5}, "seed")])
def test_bad_sampling_values_name_the_field(body, param):
    with pytest.raises(RequestBodyError) as e:
        sampling_kwargs(body, CHAT, 5, 2048, 256, 16)
    assert e.value.param == param


def test_response_bodies_have_openai_shape():
    chat = response_body(CHAT, "x1", 100, "m", [ChoiceOutput("hello", "length")], 10, 4, 2)
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == "hello"
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    comp = response_body("/v1/completions", "x2", 100, "m", [ChoiceOutput("t", "stop")], 1, 0, 1)
    assert comp["object"] == "text_completion" and comp["choices"][0]["text"] == "t"


# --- hostile lines: what cannot be stored, roles, the BOM, param paths ------------------

def json_nested(depth):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


def chat_body(**extra):
    return {"model": "default", "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize("raw, code, param, says", [
    (line("a\u0000b"), "invalid_request", "custom_id", "NUL"),
    (line("x" * 513), "invalid_request", "custom_id", "longer than 512"),
    (line(body={"model": "default", "messages": [{"role": "wizard", "content": "x"}]}), "invalid_value",
     "body.messages.0.role", "'wizard'"),
    (line(body={"model": "default", "messages": [{"role": "user", "content": "x"}, {"content": "no role"}]}),
     "invalid_request", "body.messages.1", "'role' and 'content'"),
    (line(body={"model": "default", "messages": [{"role": "user", "content": "a\u0000b"}]}), "invalid_request",
     "body.messages.0.content", "NUL"),
    (line(body=chat_body(metadata={"k\u0000": 1})), "invalid_request", "body.metadata.k\\u0000", "key"),
    (line(body=chat_body(deep=json_nested(70))), "invalid_request", "body.deep" + ".0" * 63, "nested more than 64"),
])
def test_hostile_line_names_line_param_and_reason(raw, code, param, says):
    r = run([line("ok"), raw])
    assert [(e["line"], e["code"], e["param"]) for e in r.errors] == [(2, code, param)]
    assert says in r.errors[0]["message"]
    assert "\x00" not in orjson.dumps(r.errors_object()).decode()   # the errors themselves can be stored


def test_nesting_within_the_limit_is_accepted():
    assert run([line(body=chat_body(deep=json_nested(60)))]).ok


def test_bom_before_the_first_line_is_accepted_but_not_elsewhere():
    bom = b"\xef\xbb\xbf"
    r = run([bom + line("a"), line("b")])
    assert r.ok and [v.custom_id for v in r.lines] == ["a", "b"]
    r = run([line("a"), bom + line("b")])
    assert [(e["line"], e["code"]) for e in r.errors] == [(2, "invalid_json_line")]


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool", "function"])
def test_every_openai_role_is_accepted(role):
    assert run([line(body={"model": "default", "messages": [{"role": role, "content": "x"}]})]).ok


@pytest.mark.parametrize("body, param, code, says", [
    ({"max_completion_tokens": -5}, "max_completion_tokens", "invalid_request",
     "'max_completion_tokens' must be at least 1 (got -5)"),
    ({"max_completion_tokens": "9"}, "max_completion_tokens", "invalid_request", "must be an integer"),
    ({"max_tokens": 0}, "max_tokens", "invalid_request", "'max_tokens' must be at least 1"),
    ({"max_tokens": 5, "max_completion_tokens": 0}, "max_completion_tokens", "invalid_request", "at least 1"),
    ({"frequency_penalty": 5}, "frequency_penalty", "invalid_request", "between -2 and 2"),
    ({"presence_penalty": -2.5}, "presence_penalty", "invalid_request", "between -2 and 2"),
    ({"presence_penalty": "x"}, "presence_penalty", "invalid_request", "must be a number"),
    ({"logit_bias": {"50256": 101}}, "logit_bias.50256", "invalid_request", "between -100 and 100"),
    ({"logit_bias": {"50256": -100.5}}, "logit_bias.50256", "invalid_request", "between -100 and 100"),
    ({"logit_bias": {"hello": 1}}, "logit_bias", "invalid_request", "not a token id"),
    ({"logit_bias": [1]}, "logit_bias", "invalid_request", "must be an object"),
    ({"top_logprobs": 2}, "top_logprobs", "invalid_request", "requires 'logprobs'"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_request", "between 0 and 20"),
    ({"logprobs": "yes"}, "logprobs", "invalid_request", "must be a boolean"),
])
def test_chat_values_openai_refuses_are_refused(body, param, code, says):
    with pytest.raises(RequestBodyError) as e:
        sampling_kwargs(body, CHAT, 5, 2048, 256, 16)
    assert (e.value.param, e.value.code) == (param, code) and says in e.value.message


@pytest.mark.parametrize("body, param, code", [
    ({"logprobs": 6}, "logprobs", "invalid_request"),
    ({"logprobs": -1}, "logprobs", "invalid_request"),
    ({"logprobs": True}, "logprobs", "invalid_request"),
])
def test_completion_logprobs_outside_0_to_5_are_refused(body, param, code):
    with pytest.raises(RequestBodyError) as e:
        sampling_kwargs(body, "/v1/completions", 5, 2048, 256, 16)
    assert (e.value.param, e.value.code) == (param, code)


def test_neutral_values_are_accepted_and_logprobs_asked_for():
    kw = sampling_kwargs({"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {"5": 0}, "logprobs": True,
                          "top_logprobs": 0, "max_completion_tokens": 7, "max_tokens": 99}, CHAT, 5, 2048, 256, 16)
    assert kw["logprobs"] is True and kw["max_tokens"] == 7        # max_completion_tokens wins
    assert (kw["frequency_penalty"], kw["presence_penalty"], kw["logit_bias"], kw["top_logprobs"]) == (0, 0, {}, 0)
    assert sampling_kwargs({}, CHAT, 5, 2048, 256, 16)["logprobs"] is False
    assert sampling_kwargs({"logprobs": 0}, "/v1/completions", 5, 2048, 256, 16)["logprobs"] is True


def test_penalties_bias_and_alternatives_reach_the_engine():
    # once refused (the engine could not apply them); now honoured
    kw = sampling_kwargs({"frequency_penalty": 0.5, "presence_penalty": -1.5, "logit_bias": {"7": 5, "50256": -100},
                          "logprobs": True, "top_logprobs": 3}, CHAT, 5, 2048, 256, 16)
    assert (kw["frequency_penalty"], kw["presence_penalty"]) == (0.5, -1.5)
    assert kw["logit_bias"] == {7: 5.0, 50256: -100.0} and all(isinstance(k, int) for k in kw["logit_bias"])
    assert (kw["logprobs"], kw["top_logprobs"]) == (True, 3)
    kw = sampling_kwargs({"logprobs": 2}, "/v1/completions", 5, 2048, 256, 16)
    assert (kw["logprobs"], kw["top_logprobs"]) == (True, 2)


def logprob_choice(text, finish, tokens, logprobs, token_bytes=None):
    raws = token_bytes or [None] * len(logprobs)
    return ChoiceOutput(text, finish, [TokenLogprob(t, b, lp) for t, b, lp in zip(tokens, raws, logprobs)])


def test_logprobs_bodies_carry_token_texts_or_nulls_consistently():
    chat = response_body(CHAT, "x", 1, "m", [logprob_choice("Hi!", "stop", ["Hi", "!"], [-0.5, -0.25])], 3, 0, 2)
    content = chat["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []},
                       {"token": "!", "logprob": -0.25, "bytes": [33], "top_logprobs": []}]
    split = response_body(CHAT, "x", 1, "m", [logprob_choice("日", "stop", ["\ufffd", "\ufffd"], [-0.5, -0.25],
                                                             [b"\xe6\x97", b"\xa5"])], 3, 0, 2)   # one character, two tokens
    assert [c["bytes"] for c in split["choices"][0]["logprobs"]["content"]] == [[0xE6, 0x97], [0xA5]]
    unknown = response_body(CHAT, "x", 1, "m", [logprob_choice("Hi!", "stop", [None, None], [-0.5, -0.25])], 3, 0, 2)
    assert [(c["token"], c["bytes"]) for c in unknown["choices"][0]["logprobs"]["content"]] == [(None, None)] * 2
    comp = response_body("/v1/completions", "y", 1, "m", [logprob_choice("Hi!", "length", ["Hi", "!"], [-0.5, -0.25])],
                         3, 0, 2)
    assert comp["choices"][0]["logprobs"] == {"tokens": ["Hi", "!"], "token_logprobs": [-0.5, -0.25],
                                              "top_logprobs": None, "text_offset": [0, 2]}
    comp = response_body("/v1/completions", "y", 1, "m", [logprob_choice("Hi!", "length", [None, None], [-0.5, -0.25])],
                         3, 0, 2)
    assert comp["choices"][0]["logprobs"]["tokens"] is None and comp["choices"][0]["logprobs"]["text_offset"] is None
    assert response_body(CHAT, "x", 1, "m", [ChoiceOutput("Hi", "stop")], 3, 0, 1)["choices"][0]["logprobs"] is None
