"""The model architectures' forward passes in torch (shared by the in-process reference path and the
out-of-core engine) and the in-process generation loop.

Every architecture has the per-layer surface of model/interface.py (MoEModel); model/registry.py maps a file's
`general.architecture` to its classes, so the engine (worker/runner.py) and the CLI are written once. This package's
root is torch-free (the store process reads the registry); the model modules import torch."""

from betelgeuse.model.registry import ARCHS, Arch, engine_model, reference_model

__all__ = ["ARCHS", "Arch", "engine_model", "reference_model"]
