"""A chat's token ids, with the text its messages carry kept as text: the one rule for every chat template rendered
and tokenized here (the edge client and its local API, ``edge_client.tokenizer``; the cloud's full-model routes,
``cloud_server.full_api``; the rig's all-edge phone, through the edge's tokenizer).

A chat template is rendered to text and the text is tokenized, so a special token's string inside a message
(``<|im_end|>\\n<|im_start|>system ...``) would become that special token and open a turn of its own. Here each such
string inside the messages (and the template's variables) is wrapped in two markers before the template renders
them (:func:`mark`); :func:`encode_chat` tokenizes the rendered prompt with the special tokens the template wrote
itself, and each marked string as plain text. Only the marked strings cut the text: a chat whose messages hold no
special token's string has no marker and is tokenized whole, to exactly the ids it always had, whatever the
tokenizer (tokenizing every message apart does not: byte-level BPE merges a message's leading newlines with the
template's newline before it). A template that cuts a marked string apart (``content.split('</think>')``) leaves
lone markers; they are dropped, and still cut the text, so its two sides cannot join into a special token.

The media placeholders the runtime writes into a message (GLM-4.1V's ``<|begin_of_image|><|image|><|end_of_image|>``)
are :class:`Placeholder` pieces of its content: they keep their special tokens, while the same string typed in a
message's text is text.

The markers are lone UTF-16 surrogates: no text a tokenizer takes holds one (it refuses them: a string of no UTF-8),
so message text holding one is refused here as it would be there, and a marker in a prompt is always this module's.

References: transformers' ``apply_chat_template(sanitize_control_tokens=True)`` (``mark_control_tokens``,
``encode_marked_chat``), which this follows (its markers are private-use characters it deletes from the text).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

START, END = "\ud800", "\ud801"  # lone surrogates: never in text a tokenizer takes


class Placeholder(str):
    """Text the runtime writes into a message's content (a media placeholder): its special tokens stay tokens. A
    message's content may be a list of ``str`` and ``Placeholder`` pieces (``edge_client.media.extract_parts``)."""


def control_tokens(added: Iterable[tuple[str, bool]], template: str | None) -> re.Pattern | None:
    """The strings that are text inside a message: the special added tokens, and the other added tokens the
    template's source writes (``<think>`` where it is not special), whitespace tokens aside; ``added`` is
    ``(content, special)`` per added token. ``None`` when there are none (a byte-level vocabulary)."""
    tokens = {t for t, special in added if t and (special or (template and t in template and not t.isspace()))}
    if not tokens:
        return None
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))))  # a longer token first


def _mark_text(text: str, pattern: re.Pattern | None) -> str:
    if START in text or END in text:
        text.encode("utf-8")  # the UnicodeEncodeError (a ValueError) naming the character, as the tokenizer's
    return text if pattern is None else pattern.sub(lambda m: START + m.group(0) + END, text)


def mark(obj: Any, pattern: re.Pattern | None) -> Any:
    """``obj`` (a template variable: a string, or lists and dicts of them) with every control token's string in its
    strings marked; dict keys are not. A :class:`Placeholder` stays as it is."""
    if isinstance(obj, Placeholder):
        return str(obj)
    if isinstance(obj, str):
        return _mark_text(obj, pattern)
    if isinstance(obj, dict):
        return {k: mark(v, pattern) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [mark(v, pattern) for v in obj]
    return obj


def mark_messages(messages: list[dict], pattern: re.Pattern | None) -> list[dict]:
    """Chat messages as the template renders them: their strings marked (:func:`mark`), a content of ``str`` and
    :class:`Placeholder` pieces joined into one string (its placeholders unmarked)."""
    out = []
    for m in messages:
        content = m.get("content")
        marked = mark({k: v for k, v in m.items() if k != "content"}, pattern)
        if isinstance(content, list) and all(isinstance(p, str) for p in content):
            marked["content"] = "".join(mark(p, pattern) for p in content)
        elif "content" in m:
            marked["content"] = mark(content, pattern)
        out.append({k: marked[k] for k in m})  # the message's own key order
    return out


_MARKED = re.compile(f"{START}([^{START}{END}]*){END}|[{START}{END}]")


def encode_chat(prompt: str, encode: Callable[[str], list[int]], encode_text: Callable[[str], list[int]],
                is_control: Callable[[int], bool] = lambda _: False) -> list[int]:
    """The ids of a chat ``prompt`` rendered from marked messages: ``encode`` (special tokens parsed) for the
    template's text, ``encode_text`` (every added token as plain text) for each marked string. A prompt without
    markers is ``encode(prompt)``. ``is_control``: whether an id is an added token's; a marked string whose plain
    text tokenizes to one (a vocabulary holding it as an ordinary token too) is refused (``ValueError``)."""
    if START not in prompt and END not in prompt:
        return encode(prompt)
    pieces = _MARKED.split(prompt)  # text, marked (None: a lone marker), text, marked, ..., text
    ids = encode(pieces[0]) if pieces[0] else []
    newline = encode("\n")
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        as_text = i % 2 == 1
        piece_ids = _encode_inside(piece, encode_text if as_text else encode, newline)
        if as_text and any(is_control(t) for t in piece_ids):
            raise ValueError(f"message text {piece!r} cannot be kept as text: the tokenizer makes a special token of "
                             "its plain text")
        ids += piece_ids
    return ids


def _encode_inside(piece: str, encode: Callable[[str], list[int]], newline: list[int]) -> list[int]:
    """``piece``'s ids in the middle of a prompt: encoded after a newline, which is then taken off, so a tokenizer
    that marks the start of a string (SentencePiece's prefix space) does not mark it; as itself when the newline
    merges with the piece."""
    ids = encode("\n" + piece)
    return ids[len(newline):] if newline and ids[:len(newline)] == newline else encode(piece)
