"""Everything a serving process holds, built from a :class:`ServerConfig`: models, engine, TP workers, metrics.

``CloudRuntime.start()`` loads the model variants (the bundle's back half, or a full model), launches the
tensor-parallel workers when ``tp == 2``, allocates the KV pools and starts the engine thread;
``stop()`` undoes all of it. The FastAPI app (``cloud_server.app``) holds one runtime.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from cloud_server.config import ConfigError, ServerConfig
from cloud_server.engine.async_engine import AsyncEngine
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.engine_facts import EngineFacts
from cloud_server.fast.runner import fast_runner_factory
from cloud_server.metrics import ServerMetrics

log = logging.getLogger("autoglm.cloud")


class CloudRuntime:
    def __init__(self, config: ServerConfig, loaded=None):
        self.config = config
        self._loaded = loaded  # full-model mode: an already loaded LoadedModel (tests, embedding)
        self.manifest = None  # split mode: the served bundle's manifest
        self.tokenizer = None  # full-model mode: the model's tokenizer (chat endpoints)
        self.engine: AsyncEngine | None = None
        self.facts: EngineFacts | None = None  # the engine's fixed facts, published once by start()
        self.metrics: ServerMetrics | None = None
        self.model_name = config.model_name or ""
        self._workers = []  # tensor parallel: the worker ranks' processes
        self._tp_store = None  # rank 0 hosts the group's store: kept open until the workers are gone
        self._tp_comm = None  # where the rank-0 broadcasts' tensors live
        self.draining = False  # set on shutdown: /ready turns false, new sessions and requests are refused

    # -- build ------------------------------------------------------------------------------
    def start(self) -> CloudRuntime:
        cfg, ecfg = self.config, self.config.engine
        variants = list(ecfg.resolved_variants())
        lm = None
        if cfg.mode == "split":
            from shared.manifest import Manifest

            self.manifest = Manifest.load(cfg.bundle)
            if self.manifest.tail_layers and ecfg.tp > 1:
                raise ConfigError("a u-shape bundle (split with --tail) is served at --tp 1 only: the tensor-parallel "
                                  "pass shards an lm_head its middle layers do not have")
            self.model_name = self.model_name or f"{Path(cfg.bundle).name}"
            source_kind, source = "bundle", str(cfg.bundle)
        else:
            from partition_tools.models import load_model

            lm = self._loaded if self._loaded is not None else load_model(cfg.full)
            self.tokenizer = lm.tokenizer
            self.model_name = self.model_name or cfg.full
            source_kind, source = "full", cfg.full
        self.metrics = ServerMetrics(self.model_name)
        make_runner = fast_runner_factory(ecfg)  # the GLM fast path where it applies, else the library's layers
        if ecfg.tp > 1:
            models, make_runner = self._start_tp(source_kind, source, variants, make_runner)
        else:
            models = {v: self._load(source_kind, source, lm, v, ecfg.device) for v in variants}
        engine = LLMEngine.from_models(ecfg, models, metrics=self.metrics, make_runner=make_runner)
        if self.manifest is not None and ecfg.cloud_drafts > 0 and not self.manifest.tail_layers:
            from cloud_server.model import load_draft_inputs

            table = load_draft_inputs(cfg.bundle, self.manifest)
            if table is not None:
                engine.set_draft_inputs(table)
        if ecfg.tp > 1:
            from cloud_server import tp

            tp.await_ready(self._tp_store, self._workers)  # every rank has built its runners
        self.facts = EngineFacts.of(engine)  # before the engine thread runs: handlers read only this
        idle_hook = self._heartbeat if self._tp_comm is not None else None
        self.engine = AsyncEngine(engine, idle_timeout_s=cfg.step_timeout_s, idle_hook=idle_hook,
                                  on_round_trip=self.metrics.on_edge_round_trip,
                                  on_step=self.metrics.on_engine_time, stall_s=cfg.engine_stall_s).start()
        log.info("serving %s (%s mode, variants %s, tp %d)", self.model_name, cfg.mode, variants, ecfg.tp)
        return self

    @staticmethod
    def _load(source_kind, source, lm, variant, device, shard=None):
        from cloud_server.model import load_full_model, load_split_model

        if source_kind == "bundle":
            return load_split_model(source, variant, device, shard=shard)
        return load_full_model(lm, variant, device, shard=shard)

    def _start_tp(self, source_kind: str, source: str, variants: list[str], make_runner):
        """Open the group, start the workers, load rank 0's shards; rank 0's runners broadcast every batch."""
        from cloud_server import tp

        ecfg = self.config.engine
        world = ecfg.tp
        self._tp_store, port = tp.open_group(world)
        self._workers = tp.launch_workers(world, "127.0.0.1", port, source_kind, source, variants, ecfg)
        tp.join_group(self._tp_store, world, ecfg.device, self._workers)
        self._tp_comm = tp.comm_device(ecfg.device, 0)
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
        device = tp.rank_device(ecfg.device, 0)
        models = dict(zip(variants, tp.load_models(source_kind, source, variants, device, 0, world), strict=True))

        def broadcasting(i, model, pool):
            return tp.BroadcastingRunner(make_runner(i, model, pool), i, self._tp_comm)

        return models, broadcasting

    def _heartbeat(self) -> None:
        from cloud_server import tp

        tp.heartbeat(self._tp_comm)

    # -- teardown ---------------------------------------------------------------------------
    def stop(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        if self._tp_comm is not None:
            from cloud_server import tp

            try:
                tp.stop_workers(self._tp_comm)
            except Exception:
                log.exception("stopping tensor-parallel workers")
            for p in self._workers:  # before the group goes: rank 0 hosts its store
                try:
                    p.wait(timeout=30)
                except Exception:  # noqa: BLE001
                    p.kill()
            try:
                torch.distributed.destroy_process_group()
            except Exception:
                log.exception("leaving the tensor-parallel group")
            self._workers, self._tp_store, self._tp_comm = [], None, None

    def num_active_requests(self) -> int:
        if self.engine is None or not self.engine.alive:
            return 0
        return len(self.engine.llm.seqs)  # a read of a dict's size: safe from another thread

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.alive and not self.draining

    # -- state ------------------------------------------------------------------------------
    @property
    def bundle_id(self) -> str | None:
        return self.manifest.bundle_id if self.manifest is not None else None

    def eos_token_ids(self) -> list[int]:
        return list(self.engine.llm.eos_token_ids)
