"""Tokenizer and chat template on the phone: ``tokenizers`` + ``jinja2``, no transformers.

* :class:`EdgeTokenizer` reads ``edge/tokenizer.json`` (``tokenizers.Tokenizer.from_file``),
  ``edge/tokenizer_config.json`` (special tokens) and ``edge/chat_template.jinja`` (or the config's
  ``chat_template``), and renders templates the way transformers' ``apply_chat_template`` does: a sandboxed
  jinja2 environment with ``trim_blocks``/``lstrip_blocks``, ``tojson``, ``raise_exception`` and
  ``strftime_now``, extra template kwargs such as ``enable_thinking`` passed through.
* :class:`ByteTokenizer` is the fallback for bundles with no trained vocabulary (the random tiny presets):
  UTF-8 bytes shifted past the model's special ids, and a ChatML-like template. Good enough to drive the
  pipeline by text; tests that compare against the unsplit model drive it by token ids.

A chat is tokenized by :meth:`render_chat` then :meth:`encode_chat` (``shared.chat_tokens``): a special token's string
inside a message is text, never the token (it could forge a turn); the template's own special tokens and the media
placeholders the runtime writes stay tokens, and a chat without such a string gets the ids of its whole text.
``apply_chat_template`` + ``encode`` (transformers' and vLLM's way) make the token of it.

Streaming decode (token ids to text deltas) is :class:`shared.detokenizer.StreamDecoder` over
:meth:`EdgeTokenizer.decode`, the same code the cloud's full-model routes run.

References: transformers ``PreTrainedTokenizerBase.apply_chat_template``.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from shared import chat_tokens
from shared.manifest import BundleError, Manifest

# Tags the reasoning splitter must see even when the tokenizer marks them special.
THINKING_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


class TokenizerLike(Protocol):
    eos_token_ids: list[int]
    max_token_chars: int  # the most characters of text one token stands for: a longer text per position cannot fit

    def encode(self, text: str) -> list[int]: ...
    def encode_prompt(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_text(self, ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str: ...
    def encode_chat(self, prompt: str) -> list[int]: ...
    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]: ...


class _ChatMixin:
    """Chats tokenized with their messages' text as text (``shared.chat_tokens``); ``_control`` is the pattern of
    the strings that are text inside a message."""

    _control = None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The chat's prompt for :meth:`encode_chat`: the template's text, the special tokens' strings inside the
        messages and the template variables marked (a content may hold ``chat_tokens.Placeholder`` pieces)."""
        return self.apply_chat_template(chat_tokens.mark_messages(messages, self._control), add_generation_prompt,
                                        **chat_tokens.mark(kwargs, self._control))

    def encode_chat(self, prompt: str) -> list[int]:
        """The ids of a :meth:`render_chat` prompt: the template's special tokens as tokens, the messages' as text."""
        return chat_tokens.encode_chat(prompt, self.encode, self.encode_text, self._is_control)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        return self.encode_chat(self.render_chat(messages, add_generation_prompt, **kwargs))

    def _is_control(self, token_id: int) -> bool:
        return False


def _jinja_env():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, specials: dict[str, str]):
        import jinja2

        try:
            self.template = _jinja_env().from_string(source)
        except jinja2.TemplateError as e:
            raise BundleError(f"chat template does not compile: {e}") from None
        self.source = source
        self.specials = specials

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        import jinja2

        # a caller's variable replaces a special token's string (transformers' rule): passed twice, it was a TypeError
        variables = {**self.specials, **kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            return self.template.render(**variables)
        except (jinja2.TemplateError, TypeError) as e:  # TypeError: a variable of a type the template cannot use
            raise ValueError(f"chat template refused the messages: {e}") from None


class EdgeTokenizer(_ChatMixin):
    """A bundle's trained tokenizer (``tokenizers``) and chat template (jinja2)."""

    def __init__(self, tokenizer_json: Path, config: dict, template: str | None, eos_token_ids: list[int]):
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception
            raise BundleError(f"{tokenizer_json}: cannot load: {str(e).splitlines()[0]}") from None
        self.config = config
        specials = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = config.get(name)
            if isinstance(v, dict):  # older configs store AddedToken dicts
                v = v.get("content")
            if isinstance(v, str):
                specials[name] = v
        self.template = ChatTemplate(template, specials) if template else None
        eos = list(eos_token_ids)
        if "eos_token" in specials:
            tid = self.tok.token_to_id(specials["eos_token"])
            if tid is not None and tid not in eos:
                eos.append(tid)
        self.eos_token_ids = eos
        added = self.tok.get_added_tokens_decoder()  # {id: AddedToken}
        self._hidden_ids = {i for i, t in added.items() if t.special and t.content not in THINKING_TAGS}
        self._added_ids = set(added)
        self._control = chat_tokens.control_tokens(((t.content, t.special) for t in added.values()), template)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        # the vocabulary's longest piece: a byte-level piece has a character per byte of its text, a byte-fallback
        # piece ("<0xE4>") more; SmolLM2's is a newline and 80 spaces (a guess of 64 refused prompts that fit). (A
        # tokenizer that drops text, such as a whitespace splitter, has no such bound; an LLM's keeps every byte.)
        self.max_token_chars = max(map(len, self.tok.get_vocab(with_added_tokens=True)), default=1)

    @classmethod
    def from_bundle(cls, bundle_dir: str | Path, manifest: Manifest | None = None) -> TokenizerLike:
        """The bundle's tokenizer, or a :class:`ByteTokenizer` when the bundle has none."""
        edge = Path(bundle_dir) / "edge"
        manifest = manifest or Manifest.load(bundle_dir)
        if not (edge / "tokenizer.json").is_file():
            return ByteTokenizer(manifest.vocab_size, manifest.eos_token_ids)
        config: dict = {}
        if (edge / "tokenizer_config.json").is_file():
            try:
                config = json.loads((edge / "tokenizer_config.json").read_text())
            except json.JSONDecodeError as e:
                raise BundleError(f"{edge / 'tokenizer_config.json'}: not valid JSON ({e})") from None
        template = None
        if (edge / "chat_template.jinja").is_file():
            template = (edge / "chat_template.jinja").read_text()
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        return cls(edge / "tokenizer.json", config, template, manifest.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        """The text's token ids. Through ``encode_batch``, which releases the GIL while it works (``encode`` held
        it: 0.5 s for SmolLM2's longest prompt, stalling every thread - the local API's event loop included -
        however it was called): a caller's worker thread leaves the others running."""
        try:
            return self.tok.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:  # tokenizers' answer to a lone surrogate ('\ud800'): a string that is no UTF-8 text
            text.encode("utf-8")  # the UnicodeEncodeError (a ValueError) naming the character, as ByteTokenizer's
            raise

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt's ids with the tokenizer's own special tokens added (its post-processor: Llama's BOS,
        GLM-4's ``[gMASK]<sop>``), as ``transformers``' ``tokenizer(text)`` and the cloud's full-model
        ``/v1/completions`` tokenize it; :meth:`encode` adds none (a chat's template writes its own)."""
        try:
            return self.tok.encode_batch([text], add_special_tokens=True)[0].ids
        except TypeError:  # a lone surrogate, as in :meth:`encode`
            text.encode("utf-8")
            raise

    def encode_text(self, text: str) -> list[int]:
        """The ids of ``text`` with every added token's string as plain text (the model's own pieces of it): the
        tokenizer's normalizer, pre-tokenizer and model, without its added tokens (transformers'
        ``_encode_without_added_tokens``; no switch on the shared tokenizer, so threads may call it at once)."""
        if self.tok.normalizer is not None:
            text = self.tok.normalizer.normalize_str(text)
        splits = [s for s, _ in self.tok.pre_tokenizer.pre_tokenize_str(text)] if self.tok.pre_tokenizer else [text]
        return [t.id for s in splits for t in self.tok.model.tokenize(s)]

    def _is_control(self, token_id: int) -> bool:
        return token_id in self._added_ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([i for i in ids if i not in self._hidden_ids], skip_special_tokens=False)

    def token_text(self, ids: list[int]) -> str:
        """The text that encodes to ``ids``, special tokens written out (:meth:`decode`, for answers, hides them):
        a media placeholder in a prompt's text (GLM-4.1V's ``<|begin_of_image|><|image|><|end_of_image|>``)."""
        return "".join(self.tok.decode([i], skip_special_tokens=False) for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if self.template is None:
            raise ValueError("this bundle's tokenizer has no chat template; send a raw prompt instead")
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)


class ByteTokenizer(_ChatMixin):
    """Byte-level fallback: id = byte + offset (offset skips the model's pad/bos/eos ids). No token is special: a
    chat is its whole text's bytes."""

    TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    max_token_chars = 1  # a token is a byte: a character is one or more

    def __init__(self, vocab_size: int, eos_token_ids: list[int], offset: int = 4):
        if vocab_size < offset + 256:
            raise BundleError(f"vocabulary of {vocab_size} ids is too small for the byte-level fallback "
                              f"(needs {offset + 256}); the bundle needs a tokenizer")
        self.offset = offset
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.template = ChatTemplate(self.TEMPLATE, {})

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        # Ids past the byte range (a random model samples them) have no text.
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return data.decode("utf-8", errors="replace")

    token_text = decode  # no token is special here
    encode_text = encode
    encode_prompt = encode  # no special tokens to add

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
