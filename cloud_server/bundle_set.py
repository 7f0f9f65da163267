"""Several split bundles in one server process: one runtime (models, engine, KV pool, metrics) per bundle id,
and a router that hands each WebSocket to the endpoint of the bundle its Hello names.

    autoglm-cloud serve bundles/glm4-l1 bundles/glm4-l2 bundles/glm4-l2-int8

Directories are grouped by bundle id (``cloud_server.bundle_files.BundleCatalog``): the first directory of an
id is the one whose cloud half is loaded, later ones of the same id are edge variants offered for download.
The first bundle is the default: a Hello naming no served bundle (or a frame that is no Hello) goes to its
endpoint, which refuses it with ``bundle_mismatch`` and ``Error.bundle_ids`` = every served id, default first.

Each bundle keeps its own model name (``/v1/models``), engine and metrics; ``/metrics`` merges the registries
into one exposition (one ``# HELP``/``# TYPE`` per family, samples told apart by ``model_name``). Tensor
parallelism serves one bundle per process (``tp > 1`` with several bundles is refused).
"""

from __future__ import annotations

import asyncio
import dataclasses

from prometheus_client import CollectorRegistry, generate_latest

from cloud_server.bundle_files import BundleCatalog
from cloud_server.config import ConfigError
from cloud_server.runtime import CloudRuntime
from cloud_server.split_endpoint import CLOSE_PROTOCOL, SplitEndpoint
from shared import protocol as P


class BundleSet:
    """The runtimes and split endpoints of the served bundles. With several, the app holds it in place of its
    one ``SplitEndpoint`` (``serve``, ``drain``, ``max_message_bytes`` alike); with one, that endpoint itself."""

    def __init__(self, primary: CloudRuntime, catalog: BundleCatalog):
        """``primary`` serves the catalog's first bundle; a runtime is built (not started) for each other id."""
        cfg = primary.config
        if len(catalog.ids) > 1 and cfg.engine.tp > 1:
            raise ConfigError("several bundles in one process run without tensor parallelism (tp 1); run one "
                              "replica per bundle for tp 2")
        self.runtimes: dict[str, CloudRuntime] = {catalog.ids[0]: primary}
        for bid in catalog.ids[1:]:
            first = next(iter(catalog.bundles[bid].values())).directory
            self.runtimes[bid] = CloudRuntime(dataclasses.replace(cfg, bundle=first, more_bundles=(),
                                                                  model_name=catalog.model_names[bid]))
        self.endpoints = {bid: SplitEndpoint(rt) for bid, rt in self.runtimes.items()}
        for ep in self.endpoints.values():
            ep.served_bundle_ids = list(self.endpoints)
        self.default = self.endpoints[catalog.ids[0]]
        self.max_message_bytes = max(ep.max_message_bytes for ep in self.endpoints.values())

    @property
    def all_runtimes(self) -> list[CloudRuntime]:
        return list(self.runtimes.values())

    async def serve(self, ws) -> None:
        """Read the first frame, pick the endpoint of the bundle its Hello names (else the default's, which
        refuses it with the reason), and let that endpoint run the connection."""
        await ws.accept()
        timeout = self.default.rt.config.handshake_timeout_s
        try:
            frame = await asyncio.wait_for(ws.receive(), timeout)
        except asyncio.TimeoutError:
            await self.default._refuse(ws, "bad_state", f"no Hello within {timeout:g} s", CLOSE_PROTOCOL)
            return
        await self._endpoint_for(frame).serve(ws, first=frame)

    def _endpoint_for(self, frame: dict) -> SplitEndpoint:
        data = frame.get("bytes")
        if data is None:
            return self.default
        try:
            hello = P.decode_message(data, self.default.wire_limits)
        except P.ProtocolError:
            return self.default  # it refuses the frame with the decoder's code
        return self.endpoints.get(getattr(hello, "bundle_id", None), self.default)

    def drain(self, grace_ms: int) -> None:
        for rt, ep in zip(self.runtimes.values(), self.endpoints.values(), strict=True):
            rt.draining = True
            ep.drain(grace_ms)

    def render_metrics(self) -> bytes:
        """Every runtime's metrics as one Prometheus exposition."""
        registries = [rt.metrics.registry for rt in self.runtimes.values() if rt.metrics is not None]
        merged = CollectorRegistry(auto_describe=False)
        merged.register(_Merged(registries))
        return generate_latest(merged)


class _Merged:
    """A collector yielding each metric family once with the samples of every registry."""

    def __init__(self, registries: list[CollectorRegistry]):
        self.registries = registries

    def collect(self):
        families = {}
        for r in self.registries:
            for fam in r.collect():
                if fam.name in families:
                    families[fam.name].samples.extend(fam.samples)
                else:
                    fam.samples = list(fam.samples)
                    families[fam.name] = fam
        yield from families.values()
