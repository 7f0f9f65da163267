"""shared.openai_compat: request validation, thinking/stop stream filters, response shapes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.openai_compat import (
    SSE_DONE,
    OpenAIRequestError,
    StopMatcher,
    ThinkingSplitter,
    chat_chunk,
    chat_response,
    parse_chat_request,
    parse_completion_request,
    sse,
    usage,
)


def _body(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def test_parse_chat_defaults_and_fields():
    r = parse_chat_request(_body(max_tokens=7, temperature=0, top_p=0.5, top_k=3, seed=1, stop="END",
                                 stream=True, stream_options={"include_usage": True}, precision="int8-b32"))
    assert (r.sampling.max_tokens, r.sampling.temperature, r.sampling.top_p, r.sampling.top_k) == (7, 0.0, 0.5, 3)
    assert r.sampling.stop == ["END"] and r.sampling.seed == 1
    assert r.stream and r.include_usage and r.precision == "int8-b32"
    assert r.enable_thinking is None and not r.return_reasoning


def test_thinking_flag_top_level_or_template_kwargs():
    assert parse_chat_request(_body(enable_thinking=True)).template_kwargs() == {"enable_thinking": True}
    r = parse_chat_request(_body(chat_template_kwargs={"enable_thinking": False, "x": 1}, return_reasoning=True))
    assert r.enable_thinking is False and r.return_reasoning
    assert r.template_kwargs() == {"x": 1, "enable_thinking": False}
    # max_completion_tokens wins over the legacy max_tokens; the field it came in is kept (a backend's errors name it)
    s = parse_chat_request(_body(max_tokens=3, max_completion_tokens=9)).sampling
    assert (s.max_tokens, s.max_tokens_param) == (9, "max_completion_tokens")
    assert parse_chat_request(_body(max_tokens=3, logprobs=False)).sampling.max_tokens_param == "max_tokens"
    assert parse_completion_request({"prompt": "a"}).sampling.max_tokens_param == "max_tokens"


def test_content_parts_are_flattened():
    r = parse_chat_request({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert r.messages == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("text", [None, 5, {"a": 1}])
def test_a_text_part_beside_media_is_checked_as_one_alone(text):
    """With media kept (the edge's local API), a text part that is not a string was passed on and rendered as
    'None' / '5' beside an image, where alone it is a 400 naming it; a 400 in both now."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    for parts in ([{"type": "text", "text": text}], [{"type": "text", "text": text}, image]):
        with pytest.raises(OpenAIRequestError, match=r"messages\[0\]\.content\[0\]\.text: expected a string"):
            parse_chat_request({"model": "m", "messages": [{"role": "user", "content": parts}]}, media=True)
    kept = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, image]}]}, media=True)
    assert kept.messages[0]["content"] == [{"type": "text", "text": "a"}, image]


@pytest.mark.parametrize("media, says", [(False, "(text only)"), (True, "(accepted: text, image_url, input_audio)")])
def test_an_unknown_part_type_names_what_the_endpoint_takes(media, says):
    """An endpoint that takes images and audio (the edge's local API) refused an unknown part (the Responses API's
    input_image, vLLM's audio_url) as 'not supported by this endpoint (text only)' - as if it took no media; it
    names the parts it takes."""
    for kind in ("input_image", "audio_url"):
        with pytest.raises(OpenAIRequestError) as e:
            parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [{"type": kind}]}]},
                               media=media)
        assert str(e.value).endswith(f"part type '{kind}' is not supported by this endpoint {says}"), e.value


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None},
                                     {"role": "system", "content": None}, {"role": "tool", "content": None},
                                     {"role": "assistant", "content": None}, {"role": "assistant"},
                                     {"role": "assistant", "content": None, "tool_calls": []}])
def test_a_message_without_content_is_refused_as_openai_does(message):
    """A message with no content, or content null, was read as empty text (a 200 answering nothing); OpenAI
    refuses it with a 400 - null is only an assistant turn's with tool_calls, which a history may hold."""
    with pytest.raises(OpenAIRequestError, match=r"messages\[1\]\.content: (null|missing)") as ei:
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}, message]})
    assert ei.value.param == "messages" and ei.value.status == 400
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    r = parse_chat_request({"model": "m", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": call},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "user", "content": "so?"}]})
    assert r.messages[1] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize("body, param", [
    ([], None),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    (_body(temperature=3), "temperature"),
    (_body(temperature="hot"), "temperature"),
    (_body(top_p=0), "top_p"),
    (_body(max_tokens=0), "max_tokens"),
    (_body(max_tokens=True), "max_tokens"),
    (_body(max_completion_tokens=0), "max_completion_tokens"),  # the field sent, not "max_tokens"
    (_body(max_tokens=5, max_completion_tokens=-1), "max_completion_tokens"),
    (_body(n=2), "n"),
    (_body(stop=[1]), "stop"),
    (_body(stream="yes"), "stream"),
    # OpenAI's rule: stream_options only with stream: true (it was silently ignored)
    (_body(stream_options={"include_usage": True}), "stream_options"),
    (_body(stream=False, stream_options={}), "stream_options"),
    (_body(enable_thinking="on"), "enable_thinking"),
    # the template call's `self`: a TypeError in the edge's render, a plain-text 500 from autoglm-edge serve
    (_body(chat_template_kwargs={"self": 1}), "chat_template_kwargs"),
])
def test_bad_chat_requests_name_the_field(body, param):
    with pytest.raises(OpenAIRequestError) as ei:
        parse_chat_request(body)
    assert ei.value.param == param
    err = ei.value.to_dict()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS}, "tools"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),  # an empty object asks for search: OpenAI's meaning
])
def test_features_not_offered_are_refused_by_name_not_ignored(extra, param):
    """The openai client's tools / tool_choice / response_format / logit_bias were ignored: a tool-calling or
    JSON-mode request got a plain-text answer with a 200, as if it had not asked."""
    with pytest.raises(OpenAIRequestError) as ei:
        parse_chat_request(_body(**extra))
    assert ei.value.param == param and ei.value.status == 400
    for extra in ({"tools": [], "tool_choice": "none"}, {"tools": TOOLS, "tool_choice": "none"},
                  {"tool_choice": "auto"}, {"response_format": {"type": "text"}}, {"logit_bias": {}},
                  {"parallel_tool_calls": False, "user": "u1", "store": False, "metadata": {"a": "b"}},
                  {"modalities": ["text"]}, {"prediction": {"type": "content", "content": "x"}}):
        parse_chat_request(_body(**extra))  # asks for nothing this server lacks


@pytest.mark.parametrize("extra, param", [({"best_of": 3}, "best_of"), ({"suffix": "end"}, "suffix"),
                                          ({"logit_bias": {"1": 5}}, "logit_bias"), ({"logprobs": 2}, "logprobs"),
                                          ({"logprobs": 0}, "logprobs"),  # 0: the sampled token's own (was null)
                                          # vLLM's /v1/completions takes JSON mode / a schema: answered
                                          # unconstrained with a 200 before
                                          ({"response_format": {"type": "json_object"}}, "response_format")])
def test_completion_features_not_offered_are_refused(extra, param):
    with pytest.raises(OpenAIRequestError) as ei:
        parse_completion_request({"prompt": "once", **extra})
    assert ei.value.param == param
    assert parse_completion_request({"prompt": "once", "best_of": 1, "suffix": None, "logprobs": None,
                                     "response_format": {"type": "text"}}).prompt == "once"
    # chat's logprobs is a boolean: false and top_logprobs 0 ask for nothing
    parse_chat_request(_body(logprobs=False, top_logprobs=0))


@pytest.mark.parametrize("field, value", [
    ("continue_final_message", True), ("add_generation_prompt", False), ("allowed_token_ids", [100, 200]),
    ("bad_words", ["Hello"]), ("truncate_prompt_tokens", 8), ("structural_tag", "{}"), ("chat_template", "{{ x }}"),
    ("documents", [{"text": "d"}]), ("logits_processors", ["p"])])
def test_vllm_prompt_and_token_rules_are_refused_by_name_not_ignored(field, value):
    """vLLM clients' continue_final_message (an assistant prefix to continue: it was answered as a new turn),
    allowed_token_ids / bad_words (a 200 with the tokens they banned), truncate_prompt_tokens, a chat_template and
    the rest were dropped without a word, on both endpoints; their neutral values pass."""
    for parse, body in ((parse_chat_request, _body()), (parse_completion_request, {"prompt": "once"})):
        with pytest.raises(OpenAIRequestError) as ei:
            parse({**body, field: value})
        assert ei.value.param == field and ei.value.status == 400
    neutral = {"continue_final_message": False, "add_generation_prompt": True, "allowed_token_ids": None,
               "bad_words": [], "truncate_prompt_tokens": None, "chat_template": None}
    parse_chat_request(_body(**neutral))
    parse_completion_request({"prompt": "once", **neutral})


def test_parse_completion():
    r = parse_completion_request({"model": "m", "prompt": ["once"], "max_tokens": 4})
    assert r.prompt == "once" and r.sampling.max_tokens == 4 and r.prompt_ids is None
    # token ids, alone or as a batch of one (they were a 400 "expected a non-empty string")
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        r = parse_completion_request({"prompt": prompt})
        assert r.prompt_ids == [5, 6, 7] and r.prompt == ""
    for prompt, words in ((["a", "b"], "batch of 2"), ([[1], [2]], "batch of 2"), ([-1], "token ids"),
                          ([2**40], "token ids"), ([1, True], "token ids"), ([], "token ids")):
        with pytest.raises(OpenAIRequestError, match=words) as ei:
            parse_completion_request({"prompt": prompt})
        assert ei.value.param == "prompt"
    with pytest.raises(OpenAIRequestError) as ei:
        parse_completion_request({"prompt": [1, 2], "echo": True})
    assert ei.value.param == "echo"
    with pytest.raises(OpenAIRequestError):
        parse_completion_request({"model": "m", "prompt": ""})


def _split_all(text: str, cuts: list[int], **kw) -> tuple[str, str]:
    sp = ThinkingSplitter(**kw)
    pieces = []
    prev = 0
    for c in sorted(set(cuts)) + [len(text)]:
        pieces += sp.feed(text[prev:c])
        prev = c
    pieces += sp.flush()
    return ("".join(t for k, t in pieces if k == "reasoning"), "".join(t for k, t in pieces if k == "content"))


def test_thinking_splitter_basic():
    assert _split_all("<think>plan</think>answer", []) == ("plan", "answer")
    assert _split_all("plan</think>answer", [], in_thinking=True) == ("plan", "answer")
    assert _split_all("no tags at all <thi", []) == ("", "no tags at all <thi")
    assert _split_all("<think>a</think><answer>b</answer>", []) == ("a", "b")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab<>/thinkr ", max_size=12), st.text(alphabet="ab<>/ ", max_size=12),
       st.lists(st.integers(0, 60), max_size=8))
def test_thinking_splitter_is_independent_of_chunking(reasoning, content, cuts):
    # any split of the stream gives what a single feed gives
    text = f"<think>{reasoning.replace('</think>', '')}</think>{content}"
    assert _split_all(text, cuts) == _split_all(text, [])


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcS", max_size=30), st.lists(st.integers(0, 30), max_size=6))
def test_stop_matcher_matches_reference(text, cuts):
    stops = ["SS", "cab"]
    m = StopMatcher(stops)
    out, prev, stopped = [], 0, False
    for c in sorted(set(cuts)) + [len(text)]:
        piece, stopped = m.feed(text[prev:c])
        out.append(piece)
        prev = c
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[: min(hits)] if hits else text
    assert "".join(out) == expected and stopped == bool(hits)


def test_response_shapes():
    u = usage(5, 3, cached_tokens=4)
    assert u == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                 "prompt_tokens_details": {"cached_tokens": 4}}
    assert usage(5, 3) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}  # no hits, no details
    c = chat_chunk("id", "m", 1, {"content": "x"})
    assert c["choices"][0]["delta"] == {"content": "x"} and c["choices"][0]["finish_reason"] is None
    last = chat_chunk("id", "m", 1, None, usage_obj=u)
    assert last["choices"] == [] and last["usage"] == u
    r = chat_response("id", "m", 1, "ans", "cancelled", u, reasoning="why")
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "ans", "reasoning_content": "why"}
    assert r["choices"][0]["finish_reason"] == "stop"  # not an OpenAI enum value: reported as stop
    line = sse(c)
    assert line.startswith("data: ") and line.endswith("\n\n") and json.loads(line[6:]) == c
    assert SSE_DONE == "data: [DONE]\n\n"
