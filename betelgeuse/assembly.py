"""Assembly: the one place that wires the parts from an EngineConfig (the library's composition root).

    store = open_store(cfg)               # an ExpertStore in this process, planned from cfg, and its client
    runner = open_runner(cfg, store)      # a ModelRunner attached to it (passes by hand: tests, checks, the bench)
    engine = open_engine(cfg, store)      # or an LLMEngine (its own runner; requests, the scheduler)
    ...
    runner.close() / engine.close(); store.close()

An opened store is anything with `.client` (the StoreClient the worker side speaks to) and `.close()`. The store
as a separate process (the real `services.store_main` over its Unix sockets) is services/assembly.py's
`open_store(cfg, mode="process")`, which returns the same shape: the library does not start processes or
speak gRPC. In both, the store plans its slots with the worker's own cfg, so the plan leaves the VRAM the
worker's KV cache, prefix cache and activations need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from betelgeuse.config import EngineConfig
from betelgeuse.gguf.reader import GGUFModelFile
from betelgeuse.store.client import InProcessStoreClient, StoreClient
from betelgeuse.store.plan import plan_slots
from betelgeuse.store.store import ExpertStore
from betelgeuse.worker.engine import LLMEngine
from betelgeuse.worker.runner import ModelRunner


class OpenStore(Protocol):
    client: StoreClient

    def close(self) -> object: ...


@dataclass(slots=True)
class LocalStore:
    """An ExpertStore in this process (its arena's memfd mapped twice, exactly as across processes)."""
    store: ExpertStore
    client: InProcessStoreClient

    def close(self) -> None:
        """The store (reader threads, arena) and its model file; close the runner first (it maps the arena)."""
        self.client.close()
        self.store.close()
        self.store.model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_store(cfg: EngineConfig, memory_limit: int | None = None, memory_current: int = 0) -> LocalStore:
    """The expert store in this process: the model file opened, the slots planned from cfg (against
    `memory_limit` bytes of host memory, `memory_current` of them in use; None: no limit), the arena pre-faulted."""
    f = GGUFModelFile.open(cfg.model_path)
    try:
        store = ExpertStore(f, plan_slots(f, cfg, memory_limit, memory_current), read_threads=cfg.read_threads,
                            read_request_bytes=cfg.read_request_bytes, engram_read_depth=cfg.engram_read_depth,
                            bound_fills=cfg.fill_budget, hysteresis=cfg.placement_hysteresis)
    except BaseException:
        f.close()
        raise
    return LocalStore(store, InProcessStoreClient(store))


def open_runner(cfg: EngineConfig, store: OpenStore) -> ModelRunner:
    """A ModelRunner over an opened store (attached: the arena mapped, the plan read)."""
    return ModelRunner(cfg, store.client)


def open_engine(cfg: EngineConfig, store: OpenStore, metrics=None, on_tick=None, on_state=None) -> LLMEngine:
    """An LLMEngine over an opened store (its loop thread started)."""
    return LLMEngine(cfg, store.client, metrics=metrics, on_tick=on_tick, on_state=on_state)
