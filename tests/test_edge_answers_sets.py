"""``bench/edge_answers_bench.py``'s prompt sets: disjoint, and FRESH4's message-list items (a system prompt, an
earlier assistant turn) go out as those messages, keyed in the references cache apart from a plain question."""

from __future__ import annotations

import json

from bench_support import load_bench


def test_the_sets_are_disjoint_and_fresh4_is_60_items_of_each_kind():
    b = load_bench("edge_answers_bench")
    sets = list(b.PROMPT_SETS.values())
    for i, a in enumerate(sets):
        for other in sets[i + 1:]:
            assert not set(a) & set(other)
    assert len(b.FRESH4) == len(set(b.FRESH4)) == 60
    lists = [p for p in b.FRESH4 if not isinstance(p, str)]
    assert sum(p[0][0] == "system" and len(p[0][1]) > 1500 for p in lists) == 8  # long app / UI system prompts
    assert sum(any(role == "assistant" for role, _ in p) for p in lists) == 6  # multi-turn
    assert sum(any("\u4e00" <= ch <= "\u9fff" for ch in b.prompt_key(p)) for p in b.FRESH4) == 11  # Chinese


def test_an_item_becomes_its_messages_and_its_cache_key():
    b = load_bench("edge_answers_bench")
    assert b.chat_messages("hi") == [{"role": "user", "content": "hi"}]
    assert b.prompt_key("hi") == "hi"  # a plain question keeps the key earlier caches used
    item = (("system", "You are a pirate."), ("user", "hi"))
    assert b.chat_messages(item) == [{"role": "system", "content": "You are a pirate."},
                                     {"role": "user", "content": "hi"}]
    assert json.loads(b.prompt_key(item)) == b.chat_messages(item) and b.prompt_key(item) != "hi"
    assert "番茄" in b.prompt_key(b.FRESH4[51])  # kept readable, not \\u-escaped
