"""What a front-end worker process holds in place of a :class:`~cloud_server.runtime.CloudRuntime`.

``--workers N`` (``cloud_server.front_workers``): the app (``cloud_server.app.create_app``) and its split
endpoint run over a :class:`WorkerRuntime` exactly as over a ``CloudRuntime`` - the same attributes
(``config``, ``engine``, ``facts``, ``metrics``, ``model_name``, ``bundle_id``, ``draining``, ``ready``,
``num_active_requests``) - with the engine a :class:`~cloud_server.remote_engine.RemoteEngine` over the link
to the engine process, and ``peers`` (the same object) counting sessions over every worker. The metrics here
are this worker's network counters (frames, bytes, sessions, tenants); ``/metrics`` merges them with the
engine's and the other workers' in the engine process (``RemoteEngine.metrics``).
"""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection

from cloud_server.config import ServerConfig
from cloud_server.metrics import ServerMetrics
from cloud_server.remote_engine import RemoteEngine
from shared.manifest import Manifest

HELLO_TIMEOUT_S = 120.0  # the engine process answers a new link at once; this only bounds a wedged one


class WorkerRuntime:
    def __init__(self, config: ServerConfig, conn: Connection, worker: int):
        if config.mode != "split":
            raise ValueError("front-end workers serve split mode (a bundle) only")
        self.config = config
        self.worker = worker
        self.engine = RemoteEngine(conn, worker)
        self.peers = self.engine  # sessions counted over every worker (cloud_server.split_endpoint)
        self.manifest = Manifest.load(config.bundle)
        self.facts = None
        self.metrics: ServerMetrics | None = None
        self.model_name = config.model_name or ""
        self.draining = False

    def start(self, loop: asyncio.AbstractEventLoop) -> WorkerRuntime:
        """Connect to the engine process (its facts and model name arrive first); ``loop`` is the app's."""
        self.engine.start(loop, HELLO_TIMEOUT_S)
        self.facts, self.model_name = self.engine.facts, self.engine.model_name
        self.metrics = ServerMetrics(self.model_name)
        self.engine.offer_metrics(lambda: list(self.metrics.registry.collect()))
        return self

    def stop(self) -> None:
        self.engine.close()

    def num_active_requests(self) -> int:
        return self.engine.num_open

    @property
    def ready(self) -> bool:
        return self.engine.alive and not self.draining

    @property
    def bundle_id(self) -> str:
        return self.manifest.bundle_id
