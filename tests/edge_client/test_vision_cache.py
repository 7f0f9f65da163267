"""Caches key on content: two prompts whose image tokens are identical ids but whose images differ never
share a cached block (edge activation cache and cloud prefix keys); the same image does."""

from __future__ import annotations

import numpy as np

from edge_client.activation_cache import ActivationCache
from edge_client.media import MediaItem, assemble
from shared.prefix_keys import KeyScope, block_keys

IMG, BOI, EOI, H, B = 10, 12, 13, 16, 4


def _item(seed: int, n: int = 6) -> MediaItem:
    rng = np.random.default_rng(seed)
    return MediaItem("image", IMG, rng.standard_normal((n, H)).astype(np.float32), rng.bytes(32), (1, 2, 2 * n))


def _prompt(item: MediaItem):
    ids = [20, 21, 22, 23, 24, BOI, IMG, EOI, 30, 31, 32, 33, 34, 35]  # the template's one placeholder
    return assemble(ids, [item], H)


def _kv_slice(a: int, b: int) -> list[np.ndarray]:
    return [np.full((1, b - a, 8), float(a), np.float32) for _ in range(2)]


def test_placeholders_expand_and_rows_land_on_them():
    item = _item(1)
    p = _prompt(item)
    assert p.ids.count(IMG) == 6 and len(p.ids) == 14 - 1 + 6
    start = p.ids.index(IMG)
    np.testing.assert_array_equal(p.embeds[start:start + 6], item.embeds)
    assert p.mask.sum() == 6 and p.mask[start:start + 6].all()
    assert p.tokens_by_kind == {"image": 6}
    assert p.spans == [(start, start + 6, item.digest)]


def test_edge_cache_hits_the_same_image_only():
    a, b = _prompt(_item(1)), _prompt(_item(2))
    assert a.ids == b.ids  # the token ids alone cannot tell the screenshots apart
    cache = ActivationCache("bundle", 1, 1, 8, H, block_tokens=B, edge_variant="fp32")
    cache.insert(a.ids, _kv_slice, np.zeros((len(a.ids), H), np.float32), content=a.content(B))
    image_block = a.spans[0][0] // B  # the first block the image touches
    hit_b = cache.lookup(b.ids, content=b.content(B))
    assert hit_b is not None and hit_b.tokens == image_block * B  # the text before it, nothing after
    hit_a = cache.lookup(a.ids, content=a.content(B))
    assert hit_a is not None and hit_a.tokens == ((len(a.ids) - 1) // B) * B  # the whole prompt's blocks
    same = _prompt(MediaItem("image", IMG, _item(1).embeds, _item(1).digest, (1, 2, 12)))
    assert cache.lookup(same.ids, content=same.content(B)).tokens == hit_a.tokens


def test_cloud_prefix_keys_differ_from_the_image_block_on():
    a, b = _prompt(_item(1)), _prompt(_item(2))
    scope = KeyScope("bundle", "int8", "int8-block")
    ka, kb = block_keys(a.ids, scope, B, a.content(B)), block_keys(b.ids, scope, B, b.content(B))
    first = a.spans[0][0] // B
    assert ka[:first] == kb[:first]
    assert all(x != y for x, y in zip(ka[first:], kb[first:]))  # the chain carries the difference on
    assert block_keys(a.ids, scope, B, _prompt(_item(1)).content(B)) == ka
