"""edge_client.tokenizer: tokenizers + jinja2 give what transformers gives; streaming decode (shared.detokenizer
over EdgeTokenizer.decode) is exact."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_client.tokenizer import ByteTokenizer, EdgeTokenizer
from shared.detokenizer import StreamDecoder

# A GLM-style template with a thinking switch (what GLM-4.1V / Qwen3 templates do with enable_thinking).
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}{% endif %}"
)
TEXT = "The phone agent taps the screen. Héllo wörld, 你好世界! <think> reasons </think> then answers. " * 8


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    tok.add_special_tokens(["<think>", "</think>"])
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": None}))
    (d / "chat_template.jinja").write_text(TEMPLATE)
    return d


def _edge(tok_dir) -> EdgeTokenizer:
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    return EdgeTokenizer(tok_dir / "tokenizer.json", cfg, (tok_dir / "chat_template.jinja").read_text(), [7])


@pytest.mark.parametrize("thinking", [None, True, False])
def test_chat_template_matches_transformers(tok_dir, thinking):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"), chat_template=TEMPLATE,
                                 eos_token="<|endoftext|>")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 你好?"}]
    kw = {} if thinking is None else {"enable_thinking": thinking}
    edge = _edge(tok_dir)
    text = edge.apply_chat_template(msgs, **kw)
    assert text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
    assert ("<think></think>" in text) == (thinking is False)
    assert edge.encode(text) == hf(text, add_special_tokens=False).input_ids
    assert edge.eos_token_ids == [7, hf.convert_tokens_to_ids("<|endoftext|>")]


def test_template_variables_from_the_request_are_refused_or_used_never_raised(tok_dir):
    """chat_template_kwargs reach the template (the edge's local API passes them): one named like a special token
    was passed twice (TypeError: a 500), one of a type the template cannot use raised TypeError past the
    ValueError the API turns into a 400."""
    from edge_client.tokenizer import ChatTemplate

    msgs = [{"role": "user", "content": "hi"}]
    assert _edge(tok_dir).apply_chat_template(msgs, eos_token="<|user|>").startswith("<|user|>\nhi")
    template = ChatTemplate("{{ eos_token }}{{ bonus + 1 }}", {"eos_token": "</s>"})
    assert template.render(msgs, bonus=1) == "</s>2"
    with pytest.raises(ValueError, match="chat template refused"):
        template.render(msgs, bonus="x")


def test_decode_hides_special_tokens_but_keeps_thinking_tags(tok_dir):
    edge = _edge(tok_dir)
    ids = edge.encode("<|user|>a<think>b</think>c<|endoftext|>")
    assert edge.decode(ids) == "a<think>b</think>c"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="aé你 h<>/think!", min_size=1, max_size=40))
def test_stream_decoder_reassembles_text(tok_dir, text):
    edge = _edge(tok_dir)
    ids = edge.encode(text)
    d = StreamDecoder(edge.decode)
    deltas = [d.push(i) for i in ids]
    out = "".join(deltas) + d.flush()
    assert out == edge.decode(ids)
    assert all("\ufffd" not in x for x in deltas)  # never a half character mid-stream


def test_stream_decoder_on_smollm2_multibyte_text(smollm2_lm, tmp_path):
    # the phone's tokenizer over SmolLM2's real vocabulary: streamed text equals a full decode
    smollm2_lm.tokenizer.save_pretrained(str(tmp_path))
    edge = EdgeTokenizer(tmp_path / "tokenizer.json", {}, None, [smollm2_lm.tokenizer.eos_token_id])
    text = "手机助手：打开设置 😀🎉👍🏽，然后点击 Wi-Fi ✨。Ünïcödé 日本語 한국어"
    ids = edge.encode(text)
    assert ids == smollm2_lm.tokenizer(text, add_special_tokens=False).input_ids
    d = StreamDecoder(edge.decode)
    deltas = [d.push(i) for i in ids]
    assert "".join(deltas) + d.flush() == edge.decode(ids) == text
    assert all("\ufffd" not in x for x in deltas)


def test_byte_fallback_roundtrip_and_template():
    bt = ByteTokenizer(512, [2, 3])
    ids = bt.encode("héllo 世界")
    assert all(4 <= i < 260 for i in ids) and bt.decode(ids) == "héllo 世界"
    assert bt.decode([300, *ids]) == "héllo 世界"  # ids without text are skipped
    d = StreamDecoder(bt.decode)
    assert "".join(d.push(i) for i in ids) == "héllo 世界"
    assert bt.apply_chat_template([{"role": "user", "content": "x"}]) == "<|user|>\nx\n<|assistant|>\n"
    with pytest.raises(Exception, match="too small"):
        ByteTokenizer(100, [2])


def test_bundle_without_tokenizer_gets_byte_fallback(tiny_bundle):
    tok = EdgeTokenizer.from_bundle(tiny_bundle)
    assert isinstance(tok, ByteTokenizer) and tok.eos_token_ids == [2, 3]


def test_a_lone_surrogate_is_a_value_error_naming_it(tok_dir):
    """A Python string with half a UTF-16 pair is no UTF-8 text: tokenizers raised 'TypeError: TextInputSequence
    must be str' (a prompt *is* a str); both tokenizers now raise the UnicodeEncodeError naming it."""
    for tok in (_edge(tok_dir), ByteTokenizer(300, [2])):
        with pytest.raises(ValueError, match="surrogates not allowed"):
            tok.encode("a\ud800b")



def test_tokenizing_on_a_worker_thread_leaves_the_event_loop_running(tok_dir):
    """EdgeTokenizer.encode held the GIL throughout (tokenizers' ``encode``): tokenizing SmolLM2's longest prompt
    (0.5 s) on a worker thread stalled the local API's event loop - every open stream - as long."""
    import asyncio
    import time

    edge = _edge(tok_dir)
    text = " ".join(f"w{i % 997} {TEXT[i % 50:i % 50 + 9]}" for i in range(30_000))
    t0 = time.perf_counter()
    ids = edge.encode(text)
    alone = time.perf_counter() - t0
    assert ids == edge.tok.encode(text, add_special_tokens=False).ids

    async def tokenize_beside_a_ticker() -> float:
        worker = asyncio.ensure_future(asyncio.to_thread(edge.encode, text))
        gap, last = 0.0, time.perf_counter()
        while not worker.done():
            await asyncio.sleep(0.002)
            gap, last = max(gap, time.perf_counter() - last), time.perf_counter()
        await worker
        return gap

    gap = asyncio.run(tokenize_beside_a_ticker())
    assert gap < max(0.05, alone / 3), (gap, alone)
