"""A rig scenario: which model, which links, which execution modes, which workloads, how many phones.

    name: smollm2-mobile
    model: smollm2            # preset / checkpoint dir / .gguf: the bundle, the full server and the all-edge export
    split_layer: 8
    edge_quant: int8
    profiles: [wifi, 4g, 3g-poor]   # names, or mappings (see rig.profiles.resolve_profile)
    modes: [split, all-cloud, all-edge]
    phones: 1                 # concurrent phones (a burst: all start at once)
    edge_threads: 1           # onnxruntime intra-op threads per phone
    phone_cores: [1]          # pin phones here (null: no pinning)
    cloud_cores: [0]          # pin the cloud servers here
    seed: 0                   # the links' random draws
    plan_check: false         # then predict every row with the planner and compare (rig.plan_check)
    speculate: false          # split phones decode speculatively (drafts verified several per round trip)
    disconnects: []           # [{at_s: 3.0, down_s: 0.5}]: cuts on every split/all-cloud link (from the burst)
    workloads:
      - {kind: chat, requests: 6, max_tokens: 48}
      - {kind: agent, requests: 8, max_tokens: 24}

``load_scenario(path)`` reads YAML (or JSON) into a validated :class:`Scenario`; an unknown key or a bad value
is a :class:`ScenarioError` naming it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from shared.threads import MAX_THREADS
from shared.user_paths import user_path

from .link import Disconnect
from .profiles import LinkProfile, LinkProfileError, resolve_profile

MODES = ("split", "all-cloud", "all-edge")
EDGE_QUANTS = ("auto", "int8", "int4", "fp32")  # autoglm-partition split --edge-quant
MAX_PHONES = 256  # phone processes (and links) of one burst: each loads its own onnxruntime session
MAX_REQUESTS = 100_000  # requests per phone and workload
MAX_TOKENS = 1 << 20  # output tokens per request
MAX_NAME_BYTES = 200  # a name, and a profile's, in file names: phone-<profile>-agent-all-cloud-255.log fits NAME_MAX


class ScenarioError(ValueError):
    """The scenario file is malformed; the message names the key."""


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str  # chat | agent
    requests: int = 6  # requests per phone (agent: steps)
    max_tokens: int = 48

    def __post_init__(self):
        if self.kind not in ("chat", "agent"):
            raise ScenarioError(f"workload kind {self.kind!r}: expected chat or agent")
        _int(f"workload {self.kind}: requests", self.requests, 1, MAX_REQUESTS)
        _int(f"workload {self.kind}: max_tokens", self.max_tokens, 1, MAX_TOKENS)


@dataclass(slots=True)
class Scenario:
    name: str = "rig"
    model: str = "smollm2"
    split_layer: int = 8
    edge_quant: str = "int8"
    bundle: str | None = None  # an existing bundle instead of building one (its source must be `model`)
    whole: str | None = None  # an existing whole-model export for all-edge
    profiles: list[LinkProfile] = field(default_factory=lambda: [resolve_profile("4g")])
    modes: list[str] = field(default_factory=lambda: list(MODES))
    phones: int = 1
    edge_threads: int = 1  # one core of a 2-core box; phones give the edge 1-2 big cores
    phone_cores: list[int] | None = None
    cloud_cores: list[int] | None = None
    seed: int = 0
    disconnects: list[Disconnect] = field(default_factory=list)
    workloads: list[Workload] = field(default_factory=lambda: [Workload("chat")])
    cloud_args: list[str] = field(default_factory=list)  # extra `autoglm-cloud serve` flags (e.g. --num-blocks)
    plan_check: bool = False  # after the run: the planner's predictions vs these measurements (rig.plan_check)
    speculate: bool = False  # split phones decode speculatively (EdgeClient's speculate=True; docs/edge.md)

    def __post_init__(self):
        for key in ("name", "model"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ScenarioError(f"{key} {getattr(self, key)!r}: expected a non-empty string")
        for key in ("name", "model", "bundle", "whole"):  # paths: a NUL made every file call raise ValueError
            if "\0" in str(getattr(self, key)):
                raise ScenarioError(f"{key} {getattr(self, key)!r}: a NUL character cannot be in a path")
        for key in ("model", "bundle", "whole"):  # "~/..." is a home, as on the command line (a preset is a name)
            if isinstance(getattr(self, key), str) and getattr(self, key).startswith("~"):
                setattr(self, key, str(user_path(getattr(self, key))))
        _path_component("name", self.name)  # it names the report directory
        if self.edge_quant not in EDGE_QUANTS:
            raise ScenarioError(f"edge_quant {self.edge_quant!r}: expected one of {', '.join(EDGE_QUANTS)}")
        _int("phones", self.phones, 1, MAX_PHONES)
        _int("edge_threads", self.edge_threads, 1, MAX_THREADS)
        _int("split_layer", self.split_layer, 1)
        _int("seed", self.seed, 0)
        for key in ("plan_check", "speculate"):
            if not isinstance(getattr(self, key), bool):
                raise ScenarioError(f"{key} {getattr(self, key)!r}: expected true or false")
        for d in self.disconnects:
            for key in ("at_s", "down_s"):
                _number(f"disconnects: {key}", getattr(d, key))
        if not isinstance(self.modes, list) or not self.modes or any(m not in MODES for m in self.modes):
            raise ScenarioError(f"modes {self.modes}: each must be one of {', '.join(MODES)}")
        if len(set(self.modes)) != len(self.modes):
            raise ScenarioError(f"modes {self.modes}: listed twice")
        if self.bundle is not None and not (Path(str(self.bundle)) / "manifest.json").is_file():
            # else the run's cloud server exits at once and the rig stopped with a traceback
            raise ScenarioError(f"bundle {self.bundle}: not a bundle (no manifest.json)")
        if self.whole is not None and "all-edge" in self.modes:
            from shared.whole_model import WHOLE_GRAPH

            if not (Path(str(self.whole)) / WHOLE_GRAPH).is_file():
                raise ScenarioError(f"whole {self.whole}: not a whole-model export (no {WHOLE_GRAPH})")
        for arg in self.cloud_args:
            if (owned := _rig_owned_flag(arg)) is not None:
                raise ScenarioError(f"cloud_args: {arg}{'' if arg == owned else f' ({owned})'}: the rig sets it "
                                    f"itself or needs it unset (its servers listen on 127.0.0.1 without a key or TLS)")
        if not self.profiles or not self.workloads:
            raise ScenarioError("a scenario needs at least one profile and one workload")
        names = [p.name for p in self.profiles] + (["loopback"] if self.plan_check else [])
        if len(set(names)) != len(names):
            raise ScenarioError(f"profiles {names}: names must be unique (plan_check adds loopback)")
        for profile in self.profiles:  # it names the runs' log files
            _path_component("profiles: name", profile.name)
        kinds = [w.kind for w in self.workloads]
        if len(set(kinds)) != len(kinds):  # their records, summary rows and log files were merged into one
            raise ScenarioError(f"workloads {kinds}: one workload per kind")
        usable = os.sched_getaffinity(0)
        for key in ("phone_cores", "cloud_cores"):
            cores = getattr(self, key)
            if cores is not None and (not isinstance(cores, list) or not cores
                                      or any(type(c) is not int or c < 0 for c in cores)):
                raise ScenarioError(f"{key} {cores}: a non-empty list of CPU ids, or null")
            if cores is not None and not set(cores) <= usable:
                raise ScenarioError(f"{key} {cores}: CPU(s) {sorted(set(cores) - usable)} are not usable here "
                                    f"(this process may run on {sorted(usable)})")

    @classmethod
    def from_dict(cls, data: dict) -> Scenario:
        if not isinstance(data, dict):
            raise ScenarioError("a scenario is a mapping of keys")
        _text(data, "")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in set(data) - known)
        if unknown:
            raise ScenarioError(f"unknown scenario key(s): {', '.join(unknown)}")
        values = dict(data)
        try:
            if "profiles" in values:
                values["profiles"] = [resolve_profile(p) for p in _list(values["profiles"], "profiles")]
            if "workloads" in values:
                values["workloads"] = [Workload(**_map(w, "workloads", Workload)) for w in _list(values["workloads"],
                                                                                               "workloads")]
            if "disconnects" in values:
                values["disconnects"] = [Disconnect(**_map(d, "disconnects", Disconnect))
                                         for d in _list(values["disconnects"] or [], "disconnects")]
            if "cloud_args" in values:
                values["cloud_args"] = [_flag(a) for a in _list(values["cloud_args"], "cloud_args")]
            return cls(**values)
        except (LinkProfileError, TypeError) as e:
            raise ScenarioError(str(e)) from None

    def to_dict(self) -> dict:
        return {
            "name": self.name, "model": self.model, "split_layer": self.split_layer, "edge_quant": self.edge_quant,
            "bundle": self.bundle, "whole": self.whole, "profiles": [p.to_dict() for p in self.profiles],
            "modes": list(self.modes), "phones": self.phones, "edge_threads": self.edge_threads,
            "phone_cores": self.phone_cores, "cloud_cores": self.cloud_cores, "seed": self.seed,
            "disconnects": [{"at_s": d.at_s, "down_s": d.down_s} for d in self.disconnects],
            "workloads": [{"kind": w.kind, "requests": w.requests, "max_tokens": w.max_tokens}
                          for w in self.workloads],
            "cloud_args": list(self.cloud_args), "plan_check": self.plan_check, "speculate": self.speculate,
        }


def _text(value, key: str) -> None:
    """Every string in ``value`` can be a file name or an argument: no NUL, and UTF-8 as the file system takes them.
    A lone surrogate (JSON's or YAML's ``"\\ud800"``) in a name, ``model``, ``bundle`` or ``cloud_args`` was a
    UnicodeEncodeError traceback, a NUL in a profile's name or ``cloud_args`` a ValueError one as the run started
    its servers."""
    if isinstance(value, dict):
        for k, v in value.items():
            _text(k, key or "a key")
            _text(v, f"{key}: {k}" if key else str(k))
    elif isinstance(value, list):
        for v in value:
            _text(v, key)
    elif isinstance(value, str):
        if "\0" in value:
            raise ScenarioError(f"{key} {value!r}: a NUL character cannot be in a file name or an argument")
        try:
            value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raise ScenarioError(f"{key} {value!r}: not text (a lone surrogate character)") from None


def _list(value, key: str) -> list:
    if not isinstance(value, list):
        raise ScenarioError(f"{key}: expected a list, got {type(value).__name__}")
    return value


def _map(value, key: str, cls=None) -> dict:
    if not isinstance(value, dict):
        raise ScenarioError(f"{key}: each item must be a mapping, got {type(value).__name__}")
    if cls is not None:
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in set(value) - set(known))
        if unknown:
            raise ScenarioError(f"{key}: unknown key(s) {', '.join(unknown)} (known: {', '.join(known)})")
        missing = [f.name for f in fields(cls) if f.default is f.default_factory and f.name not in value]
        if missing:
            raise ScenarioError(f"{key}: missing key(s) {', '.join(missing)}")
    return value


def _flag(value) -> str:
    """A ``cloud_args`` item: a string, or a number YAML read from one (``--num-blocks, 64``)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ScenarioError(f"cloud_args: each item is a flag or a value (a string or a number), got {value!r}")
    return str(value)


def _rig_owned_flag(arg: str) -> str | None:
    """The flag of :data:`rig.servers.RIG_OWNED_FLAGS` that ``arg`` (``--flag`` or ``--flag=value``, or a prefix
    argparse takes for it) gives, else None."""
    from cloud_server.cli import OPTIONS

    from .servers import RIG_OWNED_FLAGS

    name = arg.split("=", 1)[0]
    if not name.startswith("--"):
        return None
    flags = [f"--{o.name.replace('_', '-')}" for o in OPTIONS] + [f"--no-{o.name.replace('_', '-')}" for o in OPTIONS
                                                                  if o.kind is bool]
    meant = [name] if name in flags else [f for f in flags if f.startswith(name)]
    return meant[0] if len(meant) == 1 and meant[0] in RIG_OWNED_FLAGS else None


def _path_component(key: str, value: str) -> None:
    if value in (".", "..") or "/" in value or "\\" in value:
        raise ScenarioError(f"{key} {value!r}: one path component (no '/', not '.' or '..')")
    if len(value.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:  # else open() failed mid-run: a traceback
        raise ScenarioError(f"{key} {value[:20]!r}...: at most {MAX_NAME_BYTES} bytes (it names files)")


def _int(key: str, value, low: int, high: int | None = None) -> None:
    """``value`` is an integer (not a bool) in [low, high]; else a ScenarioError naming ``key``."""
    if type(value) is not int or value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ScenarioError(f"{key} {value!r}: expected an integer {bounds}")


def _number(key: str, value) -> None:
    """``value`` is a finite number >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ScenarioError(f"{key} {value!r}: expected a number >= 0")


def load_scenario(path: str | Path) -> Scenario:
    """Read a YAML (``.yaml``/``.yml``) or JSON scenario file."""
    path = Path(path)
    if path.is_dir():
        raise ScenarioError(f"{path}: a directory, not a scenario file")
    if not path.is_file():
        raise ScenarioError(f"{path}: no such scenario file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ScenarioError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:  # unreadable: its permissions, a FIFO gone
        raise ScenarioError(f"{path}: cannot be read ({e.strerror or e})") from None
    if path.suffix.lower() in (".yaml", ".yml"):  # (Scenario.YAML was read as JSON: "not valid JSON")
        import yaml

        try:
            data = yaml.load(text, Loader=_yaml_loader())
        except yaml.YAMLError as e:
            raise ScenarioError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    else:
        import json

        from shared.json_keys import unique_keys

        try:
            data = json.loads(text, object_pairs_hook=unique_keys)  # a key given twice kept the last one silently
        except ValueError as e:  # (JSONDecodeError is one)
            raise ScenarioError(f"{path}: not valid JSON ({e})") from None
    if data is None:  # it ran every default (smollm2, three modes, a few minutes) as if asked to
        raise ScenarioError(f"{path}: empty (no keys; write {{}} to run every default)")
    return Scenario.from_dict(data)


def _yaml_loader():
    """PyYAML's safe loader, but a key given twice is an error (it kept the last one silently) and ``1e3`` or
    ``2.5e-3`` are numbers, as in YAML 1.2 (1.1 wants a dot and a signed exponent: ``rtt_ms: 1e3`` was the
    string '1e3', refused as "must be a finite number")."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, (str, int, float, bool)):
                    continue  # a list or a mapping as a key: SafeLoader's own error follows
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice (line {key_node.start_mark.line + 1})",
                        key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
    return Loader
