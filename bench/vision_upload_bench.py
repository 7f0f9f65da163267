"""Screenshots on the phone: visual tokens, vision-encode time and uplink bytes per agent step, split vs
all-cloud (docs/performance.md, "Edge: screenshots"; raw numbers in docs/results/vision_upload.json).

1. **Upload table**: a synthetic 1080x2400 and 720x1600 phone screenshot (status bar, app bar, list rows of
   text, buttons, icons, a photo-like banner), their PNG and JPEG (quality 90) sizes, and per pixel budget
   (smart_resize's ``max_pixels``: the model's default and smaller ones): visual tokens and the bytes of
   their hidden states on the wire per codec at GLM-4.1V's hidden size 4096 (Prefill frames as the edge
   sends them, 3-D rope positions included; fixed-rate codecs, so the values do not change the size).
2. **Vision encode time**: the full-size GLM-4.1V vision tower (hidden 1536, 12 heads, patch 14, merge 2,
   merger 4096 / 13696) with random weights, exported by ``partition_tools.export_vision``, int8 and fp32,
   2 threads. A 24-block export (892 M parameters, 3.3 GiB fp32; ~3x that while exporting) does not fit
   this shared box, so the graph is built with 1 and with 2 blocks, each timed, and the 24-block time is
   ``t1 + 23 (t2 - t1)`` (the blocks are identical in shape, so the scaling is exact up to timing noise). Budgets whose image would take
   minutes per block are skipped (``--max-patches``) and marked so.
3. **Agent loop** (``--agent``): the AutoGLM-shaped loop through a real ``autoglm-cloud serve`` on
   loopback - the long system prompt (edge_client/data/autoglm_system_prompt.txt as token ids), then per
   step a new screenshot + a short instruction, a short action output. The model is a GLM-4.1V-shaped
   random one at hidden 4096 (so the bytes are the real model's) with 2 thin text layers, split at 1, and a
   1-block vision tower (so the loop runs on this box; part 2 has the full tower's time). Per step: prompt
   tokens, tokens uploaded, bytes up, edge encode ms, TTFT; and the bytes per step against the JPEG. The
   first loop then runs ``--agent-memory-steps`` more steps with the activation cache capped at
   ``--agent-cache-mb`` (reached within the run) and records the process's RSS after every step, its peak and
   its growth per step from step 50 on (``agent.memory``).
4. **Delta coding** (``delta``): consecutive scripted screens (a base screenshot, then a toggle, a text
   change, a dialog or a scroll), both steps' boundary states in two prompt layouts (the actions before the
   screenshot, AutoGLM's; the screenshot before them), and step 2's upload coded directly, as the residual
   against step 1's reconstructed rows, or skipping rows that barely changed: bytes and the cloud half's
   logit error against the uncoded states (:func:`delta_coding`).

Trained GLM-4.1V weights are not available here: these are bytes and times, not answer quality.

    python bench/vision_upload_bench.py [--parts upload,encode,agent,delta] [--out docs/results/vision_upload.json]

``--parts`` runs a subset and keeps the other parts of an existing ``--out`` (each part records its command).
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCREENS = {"1080x2400": (2400, 1080), "720x1600": (1600, 720)}  # name -> (height, width)
DEFAULT_BUDGET = 28 * 28 * 15000  # transformers' Glm4vImageProcessor default (smart_resize max_pixels)
BUDGETS = [DEFAULT_BUDGET, 2_000_000, 1_000_000, 500_000, 250_000, 125_000]
HIDDEN = 4096
WIRE_CODECS = ("bf16", "fp16", "int8-b32", "int8-b64", "int4-b32")


def screenshot(height: int, width: int, seed: int = 0):
    """A phone-UI-like RGB image: flat panels, rows of text, buttons, round icons, one photo-like banner."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (width, height), (250, 250, 252))
    d = ImageDraw.Draw(img)
    s = width / 1080
    font = ImageFont.load_default(size=max(12, int(34 * s)))
    small = ImageFont.load_default(size=max(10, int(26 * s)))
    d.rectangle([0, 0, width, int(70 * s)], fill=(30, 30, 36))  # status bar
    d.text((int(30 * s), int(18 * s)), "9:41", fill=(255, 255, 255), font=small)
    d.rectangle([0, int(70 * s), width, int(200 * s)], fill=(33, 110, 220))  # app bar
    d.text((int(40 * s), int(110 * s)), "Settings  >  Network & internet", fill=(255, 255, 255), font=font)
    y = int(230 * s)
    # a photo-like banner: smooth gradient + noise (what JPEG is good at)
    gy, gx = np.mgrid[0:int(420 * s), 0:width]
    banner = np.stack([120 + 80 * np.sin(gx / (90 * s)), 140 + 60 * np.cos(gy / (70 * s)),
                       160 + 50 * np.sin((gx + gy) / (120 * s))], -1) + rng.normal(0, 6, (*gy.shape, 3))
    img.paste(Image.fromarray(np.clip(banner, 0, 255).astype(np.uint8)), (0, y))
    y += int(450 * s)
    words = ["Wi-Fi", "Mobile network", "Airplane mode", "Hotspot & tethering", "Data saver", "VPN",
             "Private DNS", "Bluetooth", "Connected devices", "Battery", "Display", "Sound & vibration"]
    while y < height - int(220 * s):
        d.ellipse([int(40 * s), y + int(20 * s), int(110 * s), y + int(90 * s)],
                  fill=tuple(int(c) for c in rng.integers(40, 220, 3)))
        d.text((int(140 * s), y + int(18 * s)), str(rng.choice(words)), fill=(20, 20, 24), font=font)
        d.text((int(140 * s), y + int(66 * s)), f"{rng.integers(1, 99)} items - updated {rng.integers(1, 59)} min ago",
               fill=(110, 110, 120), font=small)
        d.rounded_rectangle([width - int(200 * s), y + int(30 * s), width - int(50 * s), y + int(80 * s)],
                            radius=int(25 * s), fill=(33, 110, 220) if rng.random() > 0.5 else (200, 200, 205))
        d.line([int(140 * s), y + int(118 * s), width, y + int(118 * s)], fill=(225, 225, 230), width=2)
        y += int(120 * s)
    d.rectangle([0, height - int(160 * s), width, height], fill=(245, 245, 247))  # nav bar
    for k in range(3):
        cx = int(width * (k + 1) / 4)
        d.ellipse([cx - int(30 * s), height - int(110 * s), cx + int(30 * s), height - int(50 * s)],
                  outline=(60, 60, 70), width=3)
    return img


def encoded_sizes(img) -> dict:
    out = {}
    for fmt, kw in (("png", {"format": "PNG", "optimize": True}), ("jpeg_q90", {"format": "JPEG", "quality": 90})):
        buf = io.BytesIO()
        img.save(buf, **kw)
        out[fmt] = buf.tell()
    return out


def frames_bytes(hidden: np.ndarray, codec_name: str, zstd: bool = False) -> int:
    """Bytes of the Prefill frames carrying ``hidden`` [n, H] (3-D rope positions too), ``zstd`` on the payload."""
    from shared.chunking import prefill_messages
    from shared.codecs import get_codec
    from shared.protocol import SessionLimits, encode_message

    rope = np.zeros((3, hidden.shape[0]), np.int32)
    msgs = prefill_messages("r" * 16, np.ascontiguousarray(hidden, np.float32), get_codec(codec_name),
                            SessionLimits(), start=64, last=False, rope_positions=rope, zstd=zstd)
    return sum(len(encode_message(m)) for m in msgs)


def wire_bytes(n_tokens: int, codec_name: str, hidden: int = HIDDEN) -> int:
    """Bytes of the Prefill frames carrying ``n_tokens`` hidden states [n, hidden] (fixed-rate codecs: the
    values do not change the size)."""
    return frames_bytes(np.random.default_rng(0).standard_normal((n_tokens, hidden)), codec_name)


def upload_table(spec) -> list[dict]:
    from edge_client.vision import smart_resize, visual_tokens

    rows = []
    for name, (h, w) in SCREENS.items():
        img = screenshot(h, w)
        sizes = encoded_sizes(img)
        for budget in BUDGETS:
            rh, rw = smart_resize(h, w, spec.factor, spec.min_pixels, budget, spec.temporal_patch_size)
            n = visual_tokens(h, w, spec, budget)
            rows.append({"screen": name, "budget_max_pixels": budget, "default_budget": budget == DEFAULT_BUDGET,
                         "resized": f"{rw}x{rh}", "visual_tokens": n, "patches": n * spec.merge_size ** 2,
                         **sizes, "wire_bytes": {c: wire_bytes(n, c) for c in WIRE_CODECS}})
            print(f"{name} budget {budget:>9}: {rw}x{rh} -> {n:5d} tokens; "
                  + ", ".join(f"{c} {b / 1e6:.2f} MB" for c, b in rows[-1]["wire_bytes"].items())
                  + f"; PNG {sizes['png'] / 1e3:.0f} kB, JPEG {sizes['jpeg_q90'] / 1e3:.0f} kB", flush=True)
    return rows


def full_size_vision(depth: int):
    """GLM-4.1V-9B's vision tower dimensions with ``depth`` blocks, random weights, inside a tiny LM."""
    import torch
    from transformers import Glm4vForConditionalGeneration

    from partition_tools.models import glm4v_9b_text_config, tiny_glm4v_config

    cfg = tiny_glm4v_config(num_layers=2)
    full = glm4v_9b_text_config().vision_config.to_dict()
    full["depth"] = depth
    cfg.vision_config = type(cfg.vision_config)(**full)
    torch.manual_seed(0)
    return Glm4vForConditionalGeneration._from_config(cfg, dtype=torch.float32).eval()


def tower_macs(n_patches: int, depth: int) -> float:
    """Multiply-accumulates of the full-width tower on one image of ``n_patches`` patches with ``depth`` blocks:
    patch embedding, per block qkv/proj/MLP + attention scores and values, 2x2 downsample, merger."""
    d, mlp, out, ctx = 1536, 4096, 4096, 13696
    block = n_patches * (d * 3 * d + d * d + 3 * d * mlp) + 2 * n_patches ** 2 * d
    tokens = n_patches / 4
    fixed = n_patches * 1176 * d + tokens * (4 * d * out + out * out + 3 * out * ctx)
    return fixed + depth * block


def encode_seconds(enc, img, repeats: int) -> float:
    """One image through ``enc``: the least-disturbed (min) of ``repeats`` timed runs after a warm-up run
    (other jobs share these cores)."""
    enc.encode(img)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        enc.encode(img)
        runs.append(time.perf_counter() - t0)
    return float(np.min(runs))


def encode_times(spec_rows: list[dict], threads: int, max_patches: int, repeats: int) -> dict:
    """Seconds (min of ``repeats``) of one image through the 1- and 2-block towers, int8 and fp32, per (screen, budget)."""
    from PIL import Image  # noqa: F401  (the screenshots)

    from edge_client.vision import VisionEncoder, preprocess
    from partition_tools.export_vision import export_vision

    out: dict = {"threads": threads, "repeats": repeats, "rows": [],
                 "method": "min of repeats; t24_s = t1 + 23 (t2 - t1); t24_by_macs_s = t1 x MACs(24) / MACs(1)"}
    with tempfile.TemporaryDirectory() as tmp:
        bundles = {}
        for depth in (1, 2):
            model = full_size_vision(depth)
            for quant in ("fp32", "int8"):
                d = Path(tmp) / f"d{depth}-{quant}"
                t0 = time.perf_counter()
                spec = export_vision(model, d, quant)
                print(f"exported {depth}-block tower {spec.quant} in {time.perf_counter() - t0:.0f} s "
                      f"({spec.quant_report.get('probe_max_rel_error', '-')})", flush=True)
                out.setdefault("int8_probe_max_rel_error", {})[str(depth)] = spec.quant_report.get(
                    "probe_max_rel_error")
                bundles[(depth, quant)] = VisionEncoder(d, threads)
            del model
        images = {name: screenshot(h, w) for name, (h, w) in SCREENS.items()}
        timed: dict[str, dict] = {}  # resized size -> its record (both screens resize alike at small budgets)
        for row in spec_rows:
            rec = {"screen": row["screen"], "budget_max_pixels": row["budget_max_pixels"],
                   "visual_tokens": row["visual_tokens"], "patches": row["patches"]}
            if row["patches"] > max_patches:
                rec["skipped"] = f"{row['patches']} patches > --max-patches {max_patches} (minutes per block here)"
                out["rows"].append(rec)
                print(f"{row['screen']} {row['budget_max_pixels']}: skipped ({row['patches']} patches)", flush=True)
                continue
            if row["resized"] in timed:
                out["rows"].append({**timed[row["resized"]], **rec, "same_as": row["resized"]})
                continue
            for quant in ("fp32", "int8"):
                t = {}
                for depth in (1, 2):
                    enc = bundles[(depth, quant)]
                    img = preprocess(images[row["screen"]], enc.spec, row["budget_max_pixels"])
                    t[depth] = encode_seconds(enc, img, repeats)
                scale = tower_macs(row["patches"], 24) / tower_macs(row["patches"], 1)
                rec[quant] = {"t1_s": round(t[1], 4), "t2_s": round(t[2], 4),
                              "per_block_s": round(t[2] - t[1], 4), "t24_s": round(t[1] + 23 * (t[2] - t[1]), 3),
                              "t24_by_macs_s": round(t[1] * scale, 3)}
            rec["int8_speedup_t1"] = round(rec["fp32"]["t1_s"] / rec["int8"]["t1_s"], 2)
            timed[row["resized"]] = rec
            out["rows"].append(rec)
            print(f"{row['screen']} {row['budget_max_pixels']}: {row['visual_tokens']} tokens: "
                  + "; ".join(f"{q} t1 {rec[q]['t1_s']:.2f} s t2 {rec[q]['t2_s']:.2f} s -> 24 blocks "
                              f"{rec[q]['t24_s']:.1f} s (difference) / {rec[q]['t24_by_macs_s']:.1f} s (MACs)"
                              for q in ("fp32", "int8")), flush=True)
    return out


def full_tower_times(threads: int, budgets=(250_000, 125_000), repeats: int = 2) -> dict:
    """The whole 24-block GLM-4.1V tower (892 M parameters, random weights), fp32 and int8, timed directly on
    the 1080x2400 screenshot at ``budgets`` (min of ``repeats`` after a warm-up): the check on the scaled
    estimates of :func:`encode_times`. Needs ~10 GB of RAM for the export."""
    from edge_client.vision import VisionEncoder, preprocess
    from partition_tools.export_vision import export_vision

    h, w = SCREENS["1080x2400"]
    image = screenshot(h, w)
    out: dict = {"threads": threads, "repeats": repeats, "depth": 24, "screen": "1080x2400", "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = full_size_vision(24)
        out["params"] = int(sum(p.numel() for p in model.model.visual.parameters()))
        dirs = {}
        for quant in ("fp32", "int8"):
            t0 = time.perf_counter()
            spec = export_vision(model, Path(tmp) / quant, quant)
            out[f"export_{quant}_s"] = round(time.perf_counter() - t0, 1)
            out[f"{quant}_probe_max_rel_error"] = spec.quant_report.get("probe_max_rel_error")
            print(f"exported the 24-block tower {spec.quant} in {out[f'export_{quant}_s']} s", flush=True)
            dirs[quant] = Path(tmp) / quant
        del model
        for budget in budgets:
            rec: dict = {"budget_max_pixels": budget}
            for quant, d in dirs.items():
                enc = VisionEncoder(d, threads)
                rec[f"{quant}_s"] = round(encode_seconds(enc, preprocess(image, enc.spec, budget), repeats), 3)
                del enc
            rec["int8_speedup"] = round(rec["fp32_s"] / rec["int8_s"], 2)
            out["rows"].append(rec)
            print(f"24-block tower at {budget} pixels: {rec}", flush=True)
    return out


def agent_model():
    """GLM-4.1V-shaped random model for the loop: text hidden 4096 (32 heads, 2 KV heads of 128, 3-D rope
    sections 8/12/12) with 2 thin layers (MLP 1024) and a 2,048-token vocabulary; a 1-block vision tower
    whose merger outputs 4096. Bytes on the wire are the real model's; compute is not."""
    import torch
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    text = dict(vocab_size=2048, hidden_size=HIDDEN, intermediate_size=1024, num_hidden_layers=2,
                num_attention_heads=32, num_key_value_heads=2, max_position_embeddings=8192, attention_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12],
                                 "partial_rotary_factor": 0.5}, pad_token_id=0, bos_token_id=1, eos_token_id=[2, 3])
    vision = dict(depth=1, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=HIDDEN,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    cfg = Glm4vConfig(text_config=text, vision_config=vision, image_token_id=10, video_token_id=11,
                      image_start_token_id=12, image_end_token_id=13, video_start_token_id=14,
                      video_end_token_id=15, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Glm4vForConditionalGeneration._from_config(cfg, dtype=torch.float32).eval()


def changed_screen(base, change: str, seed: int = 0):
    """``base`` (a :func:`screenshot`) after one scripted agent action: ``toggle`` (one switch flips colour),
    ``text`` (one list row's subtitle changes), ``dialog`` (a modal box over the middle third), ``scroll``
    (the list moves up by one row: every row below the app bar changes)."""
    from PIL import ImageDraw, ImageFont

    img = base.copy()
    width, height = img.size
    s = width / 1080
    d = ImageDraw.Draw(img)
    row = lambda k: int(680 * s) + k * int(120 * s)  # noqa: E731 - the top of list row k (as screenshot draws)
    if change == "toggle":
        y = row(3)
        d.rounded_rectangle([width - int(200 * s), y + int(30 * s), width - int(50 * s), y + int(80 * s)],
                            radius=int(25 * s), fill=(20, 160, 90))
    elif change == "text":
        y = row(5)
        d.rectangle([int(140 * s), y + int(60 * s), width - int(220 * s), y + int(105 * s)], fill=(250, 250, 252))
        d.text((int(140 * s), y + int(66 * s)), "Connecting... tap to cancel", fill=(110, 110, 120),
               font=ImageFont.load_default(size=max(10, int(26 * s))))
    elif change == "dialog":
        d.rounded_rectangle([int(90 * s), int(800 * s), width - int(90 * s), int(1500 * s)], radius=int(30 * s),
                            fill=(255, 255, 255), outline=(200, 200, 205), width=3)
        font = ImageFont.load_default(size=max(12, int(40 * s)))
        d.text((int(140 * s), int(860 * s)), "Turn on Wi-Fi?", fill=(20, 20, 24), font=font)
        for k, label in enumerate(("Cancel", "Turn on")):
            x0 = int((560 + 230 * k) * s)
            d.rounded_rectangle([x0, int(1380 * s), x0 + int(200 * s), int(1460 * s)], radius=int(20 * s),
                                fill=(33, 110, 220) if k else (230, 230, 235))
            d.text((x0 + int(30 * s), int(1400 * s)), label, fill=(255, 255, 255) if k else (20, 20, 24), font=font)
    elif change == "scroll":
        top, bottom, step = int(200 * s), height - int(160 * s), int(120 * s)
        img.paste(base.crop((0, top + step, width, bottom)), (0, top))
        d.rectangle([0, bottom - step, width, bottom], fill=(250, 250, 252))
        d.text((int(140 * s), bottom - step + int(18 * s)), "Accessibility", fill=(20, 20, 24),
               font=ImageFont.load_default(size=max(12, int(34 * s))))
    else:
        raise ValueError(f"change {change!r}: expected toggle, text, dialog or scroll")
    return img


DELTA_CHANGES = ("toggle", "text", "dialog", "scroll")
DELTA_SKIP_TAUS = (0.05, 0.2)


def _row_rel_change(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Per row [n]: max abs difference over the new row's max abs value."""
    return np.abs(new - old).max(axis=1) / np.maximum(np.abs(new).max(axis=1), 1e-12)


def delta_coding(budget: int, threads: int) -> dict:
    """Delta coding of a step's visual states against the previous step's, measured on the edge side: for
    consecutive scripted screens (a base screenshot, then one action), the boundary states of both agent steps
    (the same model as the agent loop; step 2's context has the step-1 action in it), then per codec the
    uploaded rows coded (a) directly, (b) as the residual against step 1's rows as the cloud reconstructed
    them, (c) skipping rows whose relative change is under tau (the cloud would reuse step 1's row; a bitmask
    says which). Bytes: Prefill frames of the upload (the image and the text after the cached prefix);
    error: the cloud half's logits over the uploaded positions against the uncoded (fp32) states."""
    import torch

    from edge_client.front import FrontRuntime
    from edge_client.media import MediaEncoders, MediaPart, MediaPolicy, assemble
    from partition_tools.cloud_half import CloudModel
    from partition_tools.models import LoadedModel
    from partition_tools.split import SplitConfig, split

    rng = np.random.default_rng(1)
    system = [int(t) for t in rng.integers(20, 2000, 682)]  # the agent loop's system prompt length
    task = [int(t) for t in rng.integers(20, 2000, 24)]
    action = [int(t) for t in rng.integers(20, 2000, 8)]  # step 1's output, in step 2's prompt
    instruction = [int(t) for t in rng.integers(20, 2000, 12)]
    block = 16  # the edge's and the cloud's prefix block: step 2 uploads from the block holding the image on
    h, w = SCREENS["1080x2400"]
    base = screenshot(h, w, seed=0)
    out: dict = {"budget_max_pixels": budget, "screen": "1080x2400", "block_tokens": block,
                 "model": "the agent loop's (hidden 4096, split at 1, int8 front, 1-block fp32 tower)",
                 "skip_taus": list(DELTA_SKIP_TAUS), "changes": []}
    with tempfile.TemporaryDirectory() as tmp:
        lm = LoadedModel(agent_model(), None, "bench:vision-agent@seed0", "bench:vision-agent")
        bundle = Path(tmp) / "b"
        split(lm, SplitConfig(layer=1, out=bundle, edge_quant="int8", vision_quant="fp32"))
        del lm
        media, front = MediaEncoders(bundle, threads), FrontRuntime(bundle, threads=threads)
        cloud = CloudModel.from_bundle(bundle)
        policy = MediaPolicy(max_pixels=budget)

        def states(img, ids):
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            items = media.items([MediaPart("image", buf.getvalue())], policy)
            mp = assemble(ids, items, front.hidden_size, media.merge_size)
            mp.encode()  # every item's rows (the encoder runs are deferred)
            front.reset()
            return mp, front.prefill_media(mp.ids, mp.positions, mp.embeds, mp.mask), \
                media.vision.prepare(buf.getvalue(), budget).pixel_values  # [S, H], [N, 1176]

        def logits(hidden, mp, c):  # the cloud half's logits [U, V] over the uploaded positions
            x = torch.from_numpy(np.ascontiguousarray(hidden, np.float32))[None]
            pos = torch.from_numpy(mp.positions.astype(np.int64))[:, None]  # [3, 1, T]
            with torch.no_grad():
                return cloud(x, torch.arange(x.shape[1])[None], pos)[0, c:].numpy()

        image = [12, 10, 13]
        layouts = {  # history -> the step's prompt
            "history-then-image": lambda hist: system + task + hist + image + instruction,  # AutoGLM's order
            "image-then-history": lambda hist: system + task + image + hist + instruction}
        for layout, prompt in layouts.items():
            mp1, h1, px1 = states(base, prompt([]))
            rows1 = h1[mp1.mask]  # [n, H] step 1's visual states at the boundary
            for change in DELTA_CHANGES:
                mp2, h2, px2 = states(changed_screen(base, change), prompt(action))
                m2 = mp2.mask
                c = (int(np.argmax(m2)) // block) * block
                up, img = h2[c:], m2[c:]  # [U, H] the upload; bool [U]: its image rows
                rows2 = h2[m2]
                patch_changed = np.abs(px2 - px1).max(axis=1) > 0  # [N]
                rec: dict = {"layout": layout, "change": change, "visual_tokens": int(m2.sum()),
                             "uploaded_tokens": int(up.shape[0]), "patches_changed": round(float(patch_changed.mean()), 3),
                             "tokens_with_a_changed_patch": round(float(
                                 patch_changed.reshape(-1, media.merge_size ** 2).any(axis=1).mean()), 3),
                             "encoder_rows_rel_change_median": round(float(np.median(_row_rel_change(
                                 mp2.embeds[m2], mp1.embeds[mp1.mask]))), 4),
                             "boundary_rows_rel_change_median": round(float(np.median(_row_rel_change(rows2, rows1))),
                                                                      4),
                             "codecs": {}}
                score = functools.partial(_scored, logits=logits, head=h2[:c], mp=mp2, c=c, ref=logits(h2, mp2, c))
                for name in ("int8-b32", "int4-b32"):
                    rec["codecs"][name] = _delta_variants(name, up, img, rows1, rows2, score)
                out["changes"].append(rec)
                print(f"delta {layout} {change}: " + json.dumps(rec), flush=True)
    return out



def _scored(rows_up: np.ndarray, nbytes: int, *, logits, head: np.ndarray, mp, c: int, ref: np.ndarray) -> dict:
    """Bytes and the logit error of one variant: the uploaded rows [U, H] after the cached ``head`` [c, H]
    through the cloud half (``logits``), against ``ref`` (the uncoded states' logits [U, V])."""
    got = logits(np.concatenate([head, rows_up]), mp, c)
    return {"bytes": int(nbytes), "max_abs_logit_error": round(float(np.abs(got - ref).max()), 5),
            "top1_agreement": round(float((got.argmax(1) == ref.argmax(1)).mean()), 4)}


def _delta_variants(name: str, up: np.ndarray, img: np.ndarray, rows1: np.ndarray, rows2: np.ndarray,
                    score) -> dict:
    """One codec's variants (see :func:`delta_coding`): ``up`` [U, H] the upload, ``img`` bool [U] its image
    rows, ``rows1`` / ``rows2`` [n, H] the two steps' uncoded visual states, ``score(rows, bytes)``."""
    from shared.codecs import get_codec

    codec = get_codec(name)

    def dec(x: np.ndarray) -> np.ndarray:  # what the cloud reconstructs from x sent with this codec
        return codec.decode(codec.encode(np.ascontiguousarray(x, np.float32)))

    prev = dec(rows1)  # step 1's visual states as the cloud reconstructed them
    direct = dec(up)
    out = {"direct": score(direct, frames_bytes(up, name))}
    resid = up.copy()
    resid[img] = rows2 - prev
    rows_up = direct.copy()
    rows_up[img] = prev + dec(resid)[img]
    out["residual"] = score(rows_up, frames_bytes(resid, name))
    out["direct+zstd"] = {"bytes": frames_bytes(up, name, zstd=True)}
    out["residual+zstd"] = {"bytes": frames_bytes(resid, name, zstd=True)}
    rel = _row_rel_change(rows2, prev)  # [n]
    for tau in DELTA_SKIP_TAUS:
        keep = rel < tau  # rows the cloud would take from step 1
        rows_up = direct.copy()
        rows_up[img] = np.where(keep[:, None], prev, direct[img])
        sent = np.concatenate([up[~img], rows2[~keep]])
        nbytes = frames_bytes(sent, name) + (len(keep) + 7) // 8
        scored = score(rows_up, nbytes) if keep.any() else {**out["direct"], "bytes": nbytes}  # none skipped
        out[f"skip<{tau:g}"] = {**scored, "rows_skipped": round(float(keep.mean()), 3)}
    return out


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def agent_loop(budget: int, threads: int, steps: int = 5, memory_steps: int = 100, cache_mb: int = 128,
               history_steps: int = 0,
               codecs: tuple[str | None, ...] = (None, "int4-b32")) -> dict:
    """The AutoGLM-shaped loop through a real server (see the module docstring, part 3), once per wire codec
    (None: the precision policy's choice); the memory check continues the first loop."""
    from edge_client.demo import LocalCloud
    from partition_tools.models import LoadedModel
    from partition_tools.split import SplitConfig, split

    rng = np.random.default_rng(1)
    system_chars = len((ROOT / "edge_client" / "data" / "autoglm_system_prompt.txt").read_text())
    system = [int(t) for t in rng.integers(20, 2000, system_chars // 4)]  # ~4 characters per token
    task = [int(t) for t in rng.integers(20, 2000, 24)]
    out: dict = {"budget_max_pixels": budget, "screen": "1080x2400", "system_prompt_tokens": len(system),
                 "model": "GLM-4.1V-shaped random: hidden 4096, 2 thin text layers (split at 1), 1-block tower",
                 "loops": []}
    with tempfile.TemporaryDirectory() as tmp:
        lm = LoadedModel(agent_model(), None, "bench:vision-agent@seed0", "bench:vision-agent")
        bundle = Path(tmp) / "b"
        split(lm, SplitConfig(layer=1, out=bundle, edge_quant="int8", vision_quant="fp32"))
        del lm
        with LocalCloud(bundle, log_path=Path(tmp) / "cloud.log") as cloud:
            for k, codec in enumerate(codecs):
                loop = _one_loop(cloud.ws_url, bundle, codec, budget, threads, system, task, steps,
                                 memory_steps if k == 0 else 0, out, rng, cache_mb, history_steps)
                out["loops"].append(loop)
    return out


def _one_loop(url, bundle, codec, budget, threads, system, task, steps, memory_steps, out, rng, cache_mb,
              history_steps: int = 0) -> dict:
    from edge_client.client import EdgeClient
    from edge_client.media import MediaPolicy

    h, w = SCREENS["1080x2400"]
    loop: dict = {"codec": codec or "policy", "steps": []}
    with EdgeClient(bundle, url, threads=threads, codec=codec, cache_max_bytes=cache_mb << 20,
                    media_policy=MediaPolicy(max_pixels=budget)) as c:
        c.warmup_encoders(("image",))
        if memory_steps:
            out["edge_cache_max_bytes"] = c.config.cache_max_bytes
        history: list[int] = []
        for step in range(steps + memory_steps):
            img = screenshot(h, w, seed=step)
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            jpeg = encoded_sizes(img)["jpeg_q90"]
            instruction = [int(t) for t in rng.integers(20, 2000, 12)]
            ids = system + task + history + [12, 10, 13] + instruction
            gen = c.complete(prompt_ids=ids, images=[buf.getvalue()], max_tokens=8)
            history += gen.token_ids[:8]  # the action taken, in the next step's prompt
            if history_steps:  # an agent's context budget: the last history_steps actions only
                history = history[-8 * history_steps:]
            st = gen.stats
            if step < steps:
                rec = {"step": step + 1, "prompt_tokens": st.prompt_tokens, "image_tokens": st.image_tokens,
                       "uploaded_prompt_tokens": st.uploaded_prompt_tokens, "cached_tokens": st.cached_tokens,
                       "cloud_cached_tokens": st.cloud_cached_tokens, "bytes_up": st.bytes_up,
                       "prefill_bytes_up": st.prefill_bytes_up, "bytes_down": st.bytes_down,
                       "codec": st.codec, "edge_encode_ms": round(1e3 * st.media_encode_s, 1),
                       "edge_prefill_ms": round(1e3 * st.edge_prefill_s, 1),
                       "ttft_ms": round(1e3 * st.ttft_s, 1), "jpeg_q90_bytes": jpeg,
                       "bytes_up_over_jpeg": round(st.bytes_up / jpeg, 2)}
                loop["steps"].append(rec)
                print(f"step {step + 1}: {rec}", flush=True)
            if memory_steps:
                rss, cached = _rss_mb(), c.cache.nbytes / 2**20  # the cache may grow to its cap; the rest may not
                out.setdefault("rss_mb_per_step", []).append(round(rss, 1))
                out.setdefault("edge_cache_mb_per_step", []).append(round(cached, 1))
                print(f"after {step + 1} steps: edge process RSS {rss:.0f} MB, of it activation cache "
                      f"{cached:.0f} MB", flush=True)
    if memory_steps:
        out["memory"] = _memory_summary(out["rss_mb_per_step"], out["edge_cache_mb_per_step"])
    later = loop["steps"][1:]
    loop["mean_bytes_up_after_step_1"] = int(np.mean([r["bytes_up"] for r in later]))
    loop["mean_jpeg_q90_bytes"] = int(np.mean([r["jpeg_q90_bytes"] for r in later]))
    loop["split_over_jpeg"] = round(loop["mean_bytes_up_after_step_1"] / loop["mean_jpeg_q90_bytes"], 2)
    return loop


def _memory_summary(rss: list[float], cache: list[float], from_step: int = 50) -> dict:
    """Peak RSS and the growth per step (least-squares slope) from ``from_step`` on, of the RSS and of the
    RSS less the activation cache."""
    steps = np.arange(1, len(rss) + 1)
    tail = steps >= from_step
    less = np.asarray(rss) - np.asarray(cache)
    slope = lambda y: round(float(np.polyfit(steps[tail], np.asarray(y)[tail], 1)[0]), 3)  # noqa: E731
    return {"steps": len(rss), "peak_rss_mb": max(rss), "peak_step": int(np.argmax(rss)) + 1,
            f"rss_mb_per_step_from_{from_step}": slope(rss),
            f"rss_less_cache_mb_per_step_from_{from_step}": slope(less),
            "rss_less_cache_mb_at": {str(k): round(float(less[k - 1]), 1) for k in (5, 25, 50, 75, len(rss))
                                     if k <= len(rss)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-patches", type=int, default=4096, help="skip timing budgets with more patches")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--parts", default="upload,encode,agent,delta",
                    help="which parts to run (upload, encode, agent, delta, tower: the whole 24-block tower timed directly, ~10 GB RAM); the others are kept from --out if it exists")
    ap.add_argument("--agent-budget", type=int, default=250_000, help="pixel budget of the agent loop")
    ap.add_argument("--agent-memory-steps", type=int, default=100, help="further steps for the memory check")
    ap.add_argument("--agent-cache-mb", type=int, default=128,
                    help="the edge activation cache's cap in the loop (small enough to be reached within the run)")
    ap.add_argument("--agent-history-steps", type=int, default=0,
                    help="keep only the last K actions in the prompt (an agent's context window); 0: all")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "vision_upload.json"))
    args = ap.parse_args()

    import os
    from dataclasses import asdict

    from edge_client.vision import VisionSpec
    from partition_tools.export_vision import vision_spec
    from partition_tools.models import glm4v_9b_text_config

    raw = asdict(vision_spec(glm4v_9b_text_config(), "fp32"))
    spec = VisionSpec(**{**raw, "image_mean": tuple(raw["image_mean"]), "image_std": tuple(raw["image_std"])})
    parts = set(args.parts.split(","))
    prev = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
    command = "python " + " ".join(["bench/vision_upload_bench.py", *sys.argv[1:]])
    load = [round(x, 1) for x in os.getloadavg()]
    result: dict = {"command": command, "hidden_size": HIDDEN, "default_budget_max_pixels": DEFAULT_BUDGET,
                    "note": "random weights: bytes and times only; the budgets' effect on answers is unmeasured"}
    result["upload"] = upload_table(spec)  # deterministic: always recomputed
    for part in ("encode", "agent", "delta", "tower"):
        if part not in parts and part in prev:
            result[part] = {"command": prev.get("command"), **prev[part]}  # as that run recorded it
    if "encode" in parts:
        result["encode"] = {"command": command, "load_average_at_start": load,
                            **encode_times(result["upload"], args.threads, args.max_patches, args.repeats)}
    if "agent" in parts:
        result["agent"] = {"command": command, "load_average_at_start": load,
                           **agent_loop(args.agent_budget, args.threads, memory_steps=args.agent_memory_steps,
                                       cache_mb=args.agent_cache_mb, history_steps=args.agent_history_steps),
                           "history_window_steps": args.agent_history_steps or None}
    if "tower" in parts:
        result["tower"] = {"command": command, "load_average_at_start": load, **full_tower_times(args.threads)}
    if "delta" in parts:
        result["delta"] = {"command": command, "load_average_at_start": load,
                           **delta_coding(args.agent_budget, args.threads)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
