"""Incremental detokenization, token ids in and text deltas out, with bounded work per token: the one
implementation that the edge (over ``EdgeTokenizer.decode``) and the cloud's full-model routes (over
``transformers``' ``decode(ids, skip_special_tokens=True)``) both run. Duck-typed on a ``decode(ids) -> str``
callable, it imports no tokenizer library: ``shared/`` stays free of torch and of ``tokenizers``, and both
packages may import it (the cloud may not import ``edge_client``).

Method (vLLM's ``detokenize_incrementally``): offsets ``prefix`` <= ``read`` into the ids; tokens before
``read`` are emitted, ``ids[prefix:read]`` is left context (a token's text depends on its neighbours:
SentencePiece drops a decode's leading space, byte-level tokens hold parts of characters). Each token decodes
``ids[prefix:read]`` and ``ids[prefix:]``; the delta is what the second adds. A delta ending in U+FFFD is a
split character (or an invalid byte): held for at most :data:`MAX_HELD` tokens, then the part that more text
already follows is released. A run of tokens without text keeps at most :data:`MAX_CONTEXT` tokens of left
context. So each token decodes windows of at most ``MAX_CONTEXT + MAX_HELD`` ids (linear in the output),
and the deltas plus :meth:`StreamDecoder.flush` equal a decode of all ids, except past those bounds: a
character spread over more than ``MAX_HELD`` tokens comes out as U+FFFD, and more than ``MAX_CONTEXT``
tokens without text drop the older left context; and at the end: the bytes of a character the stream ended
inside (``max_tokens`` reached mid-character) are dropped, as vLLM drops them, not written as U+FFFD.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_HELD = 8  # a character has at most 4 bytes; 8 leaves room for chains of tokens split mid-character
MAX_CONTEXT = 8  # tokens of left context kept across a run of tokens that decode to no text

Decode = Callable[[Sequence[int]], str]


class StreamDecoder:
    """``push(token) -> text delta`` (empty while a character is split or the token has no text);
    ``flush()`` at the end of the stream returns what is still held."""

    def __init__(self, decode: Decode):
        if not callable(decode):
            raise TypeError(f"decode must be a callable ids -> str, got {type(decode).__name__}")
        self.decode = decode
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the left context decoded with the new tokens
        self.read_offset = 0  # tokens before this one have been emitted

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        prefix, full = self._windows()
        delta = full[len(prefix):]
        if delta.endswith("\ufffd"):  # a character split across tokens, or an invalid byte
            if len(self.ids) - self.read_offset < MAX_HELD:
                return ""  # wait for the character's last byte
            return self._release(prefix, full)
        emitted, self.read_offset = self.read_offset, len(self.ids)
        if delta:  # the emitted tokens become the next left context
            self.prefix_offset = emitted
        self.prefix_offset = max(self.prefix_offset, self.read_offset - MAX_CONTEXT)
        return delta

    def _release(self, prefix: str, full: str) -> str:
        """Text held for MAX_HELD tokens: emit the longest part that more text already follows (an invalid
        byte is final once anything comes after it) and hold the rest; where there is none, emit it all as
        it stands, keeping none of it as left context (later bytes may belong to its last character)."""
        for k in range(len(self.ids) - 1, self.read_offset, -1):
            text = self.decode(self.ids[self.prefix_offset:k])
            if len(prefix) < len(text) < len(full) and full.startswith(text):
                self.prefix_offset, self.read_offset = self.read_offset, k
                return text[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """Whatever is still held, less the character the stream ended inside: held text ends in U+FFFD, the
        decode of a character's first bytes, which no later byte completes now (it came out as the answer's last
        character, in its text and in a stream's last delta: a Chinese or emoji answer that ``max_tokens`` cut
        inside a character ended in U+FFFD). Invalid bytes held at the end, or a U+FFFD the model wrote itself,
        go with it: text alone cannot tell them apart (vLLM's detokenizer drops them as well)."""
        prefix, full = self._windows()
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):].rstrip("\ufffd")

    def _windows(self) -> tuple[str, str]:
        ids = self.ids
        return self.decode(ids[self.prefix_offset:self.read_offset]), self.decode(ids[self.prefix_offset:])
