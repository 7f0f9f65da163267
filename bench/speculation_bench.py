"""Speculative decoding across the split on the rig: tokens per round trip and tokens/s, plain vs speculative.

SmolLM2-135M-Instruct (real weights) split at layer 8, fp32 edge (so the runs are bit-comparable), a real
``autoglm-cloud serve`` process, and the rig's link emulator (``rig.link.LinkEmulator``) between them at an
RTT of 20, 80 and 150 ms (4G-like bandwidth: 21 Mbit/s down, 6.3 up, no jitter or loss so that the modes
differ only by what they do). Greedy decoding; every request runs plain (``split``) on one simulated phone and
speculative (``split+spec``) on another - each its own tenant and activation cache, so neither warms the
other's prefix caches - and the tokens must be identical.

Workloads, fixed before measuring:

* ``chat``: the rig's held-out single-turn questions (``rig.workloads.CHAT_PROMPTS``), each a fresh
  conversation; the drafter's memory is cleared before each one (it drafts from the prompt and the answer
  so far only).
* ``agent``: the AutoGLM agent loop (``rig.workloads``): the fixed 2.7 KB system prompt, the task, the
  transcript of the agent's previous actions (its own earlier outputs, as a real loop re-sends them) and the
  scripted current screen, step after step. The drafter's memory is cleared before each task, so it never
  saw the task's transcripts; within a task it drafts from the prompt and the task's earlier steps, as it
  would on a phone.

Drafts (``split+spec``): prompt lookup first (``edge_client.drafting``); where it has none, the bundle's
drafter (``edge_client.draft_head``), chosen by ``--drafter``:

* ``layers`` (default): the layer-skipping drafter (``edge_client.draft_layers``): M of the cloud's layers
  (``--draft-layers``: ``auto`` = the greedy search for ``--draft-budget`` layers, or a list), the final norm
  and the lm_head, int8, continuing from the boundary state at layer 8, calibrated on the tail of
  ``partition_tools/data/sample.txt`` and the model's answers to ``partition_tools/data/draft_prompts.txt``
  (checked disjoint from both workloads by ``bench/draft_layers_bench.py``);
* ``lens``: the ridge "tuned lens" from the boundary state at layer 8 onto the lm_head (int8), fit on the tail
  of ``partition_tools/data/sample.txt``;
* ``cloud``: the cloud drafter (``partition_tools.cloud_drafter``, ``autoglm-partition draft-head --cloud``): the
  server drafts with its own layers from a calibrated approximation of the newest token's boundary state and
  sends the drafts with each token (docs/protocol.md, "Cloud drafts"); same calibration data as ``layers``;
* ``none``: prompt lookup only.

Each lives in its own bundle directory (``--bundle`` + a suffix); its held-out agreement lands in the manifest
and in the result's ``drafter``.

U-shape (``--ushape``, on by default): the same model split at layer 8 with a tail of 4 layers
(``split --tail 4``: layers [26, 30) + norm + lm_head on the phone too), served by its own ``autoglm-cloud
serve``, measured in ``u-shape`` and ``u-shape+spec`` modes on two more phones behind the same emulated link;
``identical_to_plain`` compares their tokens with the plain split's of the same run.

Per record: ``tokens_per_s`` (decode rate after the first token, all requests pooled), ``tokens_per_round_trip``
(tokens emitted by decode steps per decode round trip; 1 for plain decoding), ``ttft_ms`` (mean),
``bytes_up_per_token`` (uplink of the decode phase per generated token: rejected drafts' rows included),
``identical_to_plain``, the drafting's acceptance, ``bytes_down_per_token`` (all downlink of the requests per
generated token: u-shape brings a hidden row down for every prompt position and every step),
``edge_ms_per_token`` (the phone's decode-phase compute per generated token: the front, plus the tail and the
lm_head in u-shape) and ``draft_ms_per_token`` (the bundle drafter's compute per generated token, its catch-up
over the prompt included).

    python bench/speculation_bench.py [--rtts 20,80,150] [--chat 4] [--agent-tasks 3] [--max-tokens 48] \
        [--drafter layers|lens|cloud|none] [--draft-layers auto|8,12,...] [--draft-budget 6] [--only chat,agent] \
        [--cloud-device cpu|cuda]

``--cloud-device cuda`` runs the servers on the GPU (fp32, batch-invariant, so plain and speculative steps
compute the same rows; ``bench/gpu_session.sh speculation`` on the device machine), the phones and the link
emulator stay on the host's CPU.

Writes ``docs/results/speculation.json``. ``--policy-table`` instead writes ``docs/results/exec_mode_policy.json``:
the execution-mode policy's choice (``shared.exec_mode``) for the chat and agent request shapes on each of the
rig's link profiles at each privacy level, speculation's gain taken from ``speculation.json`` (no measuring).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_client.client import EdgeClient  # noqa: E402
from edge_client.config import RetryPolicy  # noqa: E402
from edge_client.demo import LocalCloud  # noqa: E402
from rig.link import LinkEmulator  # noqa: E402
from rig.workloads import AGENT_TASKS, CHAT_PROMPTS, system_prompt  # noqa: E402
from shared.link_profiles import LinkProfile  # noqa: E402

SPLIT_LAYER = 8
TAIL_LAYERS = 4  # u-shape: layers [26, 30) + norm + lm_head on the phone
RETRY = RetryPolicy(connect_timeout_s=10.0, reply_timeout_s=120.0, max_retries=5)


def build_bundle(out: Path, tail: int = 0, drafter: str = "none", layers: str = "auto", budget: int = 6) -> Path:
    """The SmolLM2 split (``tail``: u-shape) with the bundle drafter ``drafter`` (``autoglm-partition
    draft-head [--layers]``: calibrated on data that shares nothing with the workloads); returns the bundle."""
    from edge_client.draft_head import DRAFT_HEAD
    from edge_client.draft_layers import DRAFT_LAYERS
    from shared.manifest import CLOUD_DRAFT_INPUTS, Manifest

    if not (out / "manifest.json").is_file():
        from partition_tools.models import load_model
        from partition_tools.split import SplitConfig, split

        split(load_model("smollm2"), SplitConfig(layer=SPLIT_LAYER, out=out, edge_quant="fp32", tail=tail))
    have = Manifest.load(out)
    if drafter == "lens" and DRAFT_HEAD not in have.artifacts:
        from partition_tools.draft_head import add_draft_head
        from partition_tools.models import load_model

        print(json.dumps({"draft_head": add_draft_head(load_model("smollm2"), out)}), flush=True)
    if drafter == "cloud" and CLOUD_DRAFT_INPUTS not in have.artifacts:
        from partition_tools.cloud_drafter import add_cloud_drafter
        from partition_tools.models import load_model

        print(json.dumps({"cloud_drafter": add_cloud_drafter(load_model("smollm2"), out)}), flush=True)
    if drafter == "layers" and DRAFT_LAYERS not in have.artifacts:
        from partition_tools.draft_layers import DraftLayersConfig, add_draft_layers
        from partition_tools.models import load_model

        chosen = None if layers == "auto" else tuple(int(x) for x in layers.split(","))
        how = None if chosen is None else "given (--draft-layers)"
        report = add_draft_layers(load_model("smollm2"), out, DraftLayersConfig(layers=chosen, budget=budget,
                                                                                chosen_by=how))
        print(json.dumps({"draft_layers": report}), flush=True)
    return out


def drafter_summary(bundle: Path) -> dict | None:
    """What the bundle drafts with (its manifest's record, without the search trace)."""
    from shared.manifest import Manifest

    report = Manifest.load(bundle).quant_report
    for kind in ("draft_layers", "draft_head", "cloud_drafter"):
        if kind in report:
            return {"kind": kind, **{k: v for k, v in report[kind].items() if k not in ("search", "weights")}}
    return None


def chat_workload(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}] for i in range(n)]


def agent_user_turn(task: str, actions: list[str], screen: str) -> str:
    history = "\n".join(f"Step {i + 1}: {a}" for i, a in enumerate(actions)) or "none"
    return f"Task: {task}\nPrevious actions:\n{history}\nCurrent screen: {screen}\nWhat is the next action?"


def _run(client: EdgeClient, messages: list[dict], max_tokens: int, speculate: bool):
    gen = client.complete(messages=messages, max_tokens=max_tokens, speculate=speculate)
    return gen


class Tally:
    def __init__(self):
        self.tokens = self.decode_tokens = self.round_trips = self.decode_bytes_up = 0
        self.decode_s = 0.0
        self.ttft: list[float] = []
        self.drafts = self.accepted = 0
        self.head_drafts = self.head_accepted = 0  # of those, the draft head's (the rest: prompt lookup)
        self.cloud_drafts = self.cloud_accepted = 0  # of those, the cloud drafter's
        self.identical = True
        self.requests = 0
        self.outputs: list[list[int]] = []  # each request's tokens (u-shape's are compared with them)
        self.bytes_down = 0
        self.edge_decode_s = 0.0
        self.draft_s = 0.0  # the bundle drafter's compute

    def add(self, gen) -> None:
        st = gen.stats
        n = len(gen.token_ids)
        self.requests += 1
        self.tokens += n
        self.decode_tokens += max(0, n - 1)
        self.round_trips += st.decode_round_trips
        self.decode_s += sum(st.itl_s)
        self.decode_bytes_up += st.bytes_up - st.prefill_bytes_up
        self.ttft.append((st.ttft_s or 0.0) * 1000)
        self.drafts += st.draft_tokens
        self.accepted += st.accepted_draft_tokens
        self.head_drafts += st.head_draft_tokens
        self.head_accepted += st.accepted_head_draft_tokens
        self.cloud_drafts += st.cloud_draft_tokens
        self.cloud_accepted += st.accepted_cloud_draft_tokens
        self.outputs.append(list(gen.token_ids))
        self.bytes_down += st.bytes_down
        self.edge_decode_s += (st.edge_compute_s - st.edge_prefill_s) + (st.edge_tail_s - st.edge_tail_prefill_s)
        self.draft_s += st.edge_draft_s

    def record(self, workload: str, rtt: float, mode: str) -> dict:
        return {"workload": workload, "rtt_ms": rtt, "mode": mode, "requests": self.requests,
                "tokens": self.tokens,
                "tokens_per_s": round(self.decode_tokens / self.decode_s, 2) if self.decode_s else None,
                "tokens_per_round_trip": round(self.decode_tokens / self.round_trips, 3) if self.round_trips else None,
                "ttft_ms": round(sum(self.ttft) / len(self.ttft), 1) if self.ttft else None,
                "bytes_up_per_token": round(self.decode_bytes_up / max(1, self.tokens), 1),
                "identical_to_plain": self.identical,
                "draft_tokens": self.drafts, "accepted_draft_tokens": self.accepted,
                "acceptance": round(self.accepted / self.drafts, 3) if self.drafts else None,
                "head_draft_tokens": self.head_drafts, "accepted_head_draft_tokens": self.head_accepted,
                "cloud_draft_tokens": self.cloud_drafts, "accepted_cloud_draft_tokens": self.cloud_accepted,
                "bytes_down_per_token": round(self.bytes_down / max(1, self.tokens), 1),
                "edge_ms_per_token": round(1000 * self.edge_decode_s / self.decode_tokens, 2)
                if self.decode_tokens else None,
                "draft_ms_per_token": round(1000 * self.draft_s / self.decode_tokens, 2)
                if self.decode_tokens else None}


def measure(bundle: Path, cloud: LocalCloud, rtt: float, args, ushape: tuple[Path, LocalCloud] | None = None
            ) -> list[dict]:
    """The split pair at ``rtt``, then (``ushape``: its bundle and server) the u-shape pair behind the same link
    profile, checked against the split's plain tokens."""
    profile = LinkProfile(f"rtt{int(rtt)}", rtt_ms=rtt, jitter_ms=0.0, down_mbps=21.0, up_mbps=6.3, loss=0.0,
                          source="4G-like bandwidth (rig profile 4g), no jitter or loss: modes differ only by protocol")
    out = []
    with LinkEmulator(cloud.port, profile, seed=1) as link:
        url = f"ws://127.0.0.1:{link.port}/v1/split"
        # one phone per mode, each its own tenant (API key) and activation cache: the prefix caches of one
        # never warm the other's requests, so TTFT and uplink compare like with like
        with EdgeClient(bundle, url, api_key=f"plain-{int(rtt)}", retry=RETRY, codec="fp16") as plain_c, \
                EdgeClient(bundle, url, api_key=f"spec-{int(rtt)}", retry=RETRY, codec="fp16") as spec_c:
            records, reference = _measure_pair(plain_c, spec_c, rtt, args)
            out += records
    if ushape is not None:
        u_bundle, u_cloud = ushape
        with LinkEmulator(u_cloud.port, profile, seed=1) as link:
            url = f"ws://127.0.0.1:{link.port}/v1/split"
            with EdgeClient(u_bundle, url, api_key=f"u-{int(rtt)}", retry=RETRY, codec="fp16") as plain_c, \
                    EdgeClient(u_bundle, url, api_key=f"u-spec-{int(rtt)}", retry=RETRY, codec="fp16") as spec_c:
                out += _measure_pair(plain_c, spec_c, rtt, args, ("u-shape", "u-shape+spec"), reference)[0]
    for r in out:
        print(json.dumps(r), flush=True)
    return out


def _measure_pair(plain_c: EdgeClient, spec_c: EdgeClient, rtt: float, args, modes=("split", "split+spec"),
                  reference: dict[str, list[list[int]]] | None = None) -> tuple[list[dict], dict]:
    """Records of the pair's plain and speculative runs (``modes``) and the plain runs' tokens per workload; with
    ``reference`` (the plain split's tokens), both runs must equal it to be ``identical_to_plain``."""
    out, outputs = [], {}
    clients = {False: plain_c, True: spec_c}
    for c in clients.values():  # warm-up: the system prompt into both prefix caches (not measured)
        c.complete(messages=[{"role": "system", "content": system_prompt()}, {"role": "user", "content": "warm-up"}],
                   max_tokens=2)
    # chat
    plain, spec = Tally(), Tally()
    for msgs in chat_workload(args.chat if "chat" in args.only else 0):
        spec_c.session.drafter.forget()
        a = _run(plain_c, msgs, args.max_tokens, False)
        b = _run(spec_c, msgs, args.max_tokens, True)
        plain.add(a)
        spec.add(b)
        spec.identical &= a.token_ids == b.token_ids
    _against(reference, "chat", plain, spec, outputs)
    if "chat" in args.only:
        out += [plain.record("chat", rtt, modes[0]), spec.record("chat", rtt, modes[1])]
    # agent: each task's steps in order; plain and speculative runs of a task are separate loops
    plain, spec = Tally(), Tally()
    for task, screens in AGENT_TASKS[:args.agent_tasks if "agent" in args.only else 0]:
        outs: dict[bool, list[list[int]]] = {False: [], True: []}
        for speculate, tally in ((False, plain), (True, spec)):
            client = clients[speculate]
            client.session.drafter.forget()  # it never saw this task's transcripts
            actions: list[str] = []
            for screen in screens:
                msgs = [{"role": "system", "content": system_prompt()},
                        {"role": "user", "content": agent_user_turn(task, actions, screen)}]
                g = _run(client, msgs, args.max_tokens, speculate)
                tally.add(g)
                outs[speculate].append(g.token_ids)
                actions.append(g.text.strip().replace("\n", " "))
        spec.identical &= outs[False] == outs[True]
    _against(reference, "agent", plain, spec, outputs)
    if "agent" in args.only:
        out += [plain.record("agent", rtt, modes[0]), spec.record("agent", rtt, modes[1])]
    return out, outputs


def _against(reference: dict | None, workload: str, plain: Tally, spec: Tally, outputs: dict) -> None:
    """Record the plain run's tokens; against a reference run (u-shape vs split) both runs must match it."""
    outputs[workload] = plain.outputs
    if reference is not None:
        plain.identical = plain.outputs == reference[workload]
        spec.identical &= spec.outputs == reference[workload]


def policy_table(spec_json: Path) -> dict:
    """The policy's choices on the rig's link profiles (a deployment with every mode available)."""
    from shared.exec_mode import Deployment, ExecModeError, LinkState, RequestShape, choose_mode
    from shared.link_profiles import PROFILES

    gain = {"chat": 1.0, "agent": 1.0}
    u_gain = dict(gain)
    if spec_json.is_file():
        for r in json.loads(spec_json.read_text())["records"]:
            if r["rtt_ms"] == 80.0 and r["tokens_per_round_trip"] and r["mode"] in ("split+spec", "u-shape+spec"):
                (gain if r["mode"] == "split+spec" else u_gain)[r["workload"]] = r["tokens_per_round_trip"]
    shapes = {"chat": RequestShape(prompt_tokens=60, max_tokens=128),
              "agent": RequestShape(prompt_tokens=900, max_tokens=40, images=1, cached_tokens=640)}
    rows = []
    for name, prof in PROFILES.items():
        link = LinkState(rtt_ms=prof.rtt_ms, up_kbps=prof.up_mbps * 1000, down_kbps=prof.down_mbps * 1000)
        for workload, shape in shapes.items():
            dep = Deployment(all_cloud=True, edge_only=True, u_shape=True, split_tokens_per_round_trip=gain[workload],
                             ushape_tokens_per_round_trip=u_gain[workload])
            for privacy in ("standard", "private", "output-private"):
                try:
                    d = choose_mode(shape, privacy, link, dep)
                    rows.append({"profile": name, "workload": workload, **d.to_dict()})
                except ExecModeError as e:
                    rows.append({"profile": name, "workload": workload, "privacy": privacy, "mode": None,
                                 "reason": str(e)})
    return {"deployment": "9B-class split (fp16 boundary rows of 8 KB, front 2 ms/token prefill and 10 ms/token "
                          "decode, 30 ms cloud step, 0.5 s/token whole model on the phone); agent: 640 of 900 "
                          "prompt tokens in both prefix caches; gains = the measured tokens per round trip at 80 ms of "
                          "split+spec and of u-shape+spec (its tail costs as the front, no prefix cache); the phone "
                          "holds a plain and a --tail bundle", "split_tokens_per_round_trip": gain,
            "ushape_tokens_per_round_trip": u_gain, "choices": rows}


def _device_name(device: str) -> str:
    if device == "cpu":
        return f"cpu ({platform.processor() or platform.machine()}, shared with the phones)"
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, default=Path("/tmp/autoglm-spec-bench/smollm2-split8"))
    ap.add_argument("--rtts", default="20,80,150")
    ap.add_argument("--chat", type=int, default=4)
    ap.add_argument("--agent-tasks", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "speculation.json")
    ap.add_argument("--policy-table", action="store_true", help="write the policy's choices, measure nothing")
    ap.add_argument("--no-ushape", dest="ushape", action="store_false",
                    help="measure split and split+spec only (no u-shape bundle, no second server)")
    ap.add_argument("--drafter", choices=("layers", "lens", "cloud", "none"), default="layers",
                    help="the split bundle's drafter where prompt lookup has none (default: layers)")
    ap.add_argument("--draft-layers", default="auto", help="layers drafter: 'auto' (greedy search) or a list")
    ap.add_argument("--draft-budget", type=int, default=6, help="layers drafter: M for --draft-layers auto")
    ap.add_argument("--only", default="chat,agent", help="workloads to record: chat, agent or both")
    ap.add_argument("--cloud-device", default="cpu",
                    help="the server's device: cpu (the rig's default) or cuda (the deployment's: run this bench on "
                         "the GPU host; the cloud computes in fp32 there too, batch-invariant, so parity holds)")
    args = ap.parse_args(argv)
    args.only = set(args.only.split(","))
    if not args.only <= {"chat", "agent"}:
        ap.error(f"--only {sorted(args.only)}: chat and/or agent")
    if args.policy_table:
        result = {"command": "python bench/speculation_bench.py --policy-table", **policy_table(args.out)}
        out = args.out.with_name("exec_mode_policy.json")
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    layers = f"auto{args.draft_budget}" if args.draft_layers == "auto" else args.draft_layers.replace(",", "_")
    suffix = {"layers": f"-layers-{layers}", "lens": "", "cloud": "-cloud", "none": "-lookup"}[args.drafter]
    bundle = build_bundle(args.bundle.with_name(args.bundle.name + suffix), drafter=args.drafter,
                          layers=args.draft_layers, budget=args.draft_budget)
    u_bundle = build_bundle(args.bundle.with_name(args.bundle.name + f"-tail{TAIL_LAYERS}"), TAIL_LAYERS) \
        if args.ushape else None
    t0 = time.time()
    records = []
    serve_args = [] if args.cloud_device == "cpu" else \
        ["--device", args.cloud_device, "--variants", "fp32", "--batch-invariant"]
    with contextlib.ExitStack() as stack:
        cloud = stack.enter_context(LocalCloud(bundle, extra_args=serve_args,
                                               log_path=args.bundle.parent / "cloud.log"))
        ushape = None if u_bundle is None else (u_bundle, stack.enter_context(
            LocalCloud(u_bundle, extra_args=serve_args, log_path=args.bundle.parent / "cloud-ushape.log")))
        for rtt in (float(x) for x in args.rtts.split(",")):
            records += measure(bundle, cloud, rtt, args, ushape)
    result = {"command": "python bench/speculation_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": f"SmolLM2-135M-Instruct split at layer {SPLIT_LAYER}, fp32 edge, fp16 wire, greedy"
                       + (f"; u-shape: the same split with a tail of {TAIL_LAYERS} layers (fp16 both ways)"
                          if args.ushape else ""),
              "drafter": drafter_summary(bundle),
              "host": platform.platform(), "cloud_device": _device_name(args.cloud_device),
              "seconds": round(time.time() - t0, 1),
              "goals_at_80ms": {"agent_tokens_per_round_trip": 2.5, "agent_speedup_tokens_per_s": 2.0,
                                "chat_tokens_per_round_trip": 1.5},
              "records": records}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
