"""GGUF model files: validated reader, model config, expert byte ranges, torch dequantization."""

from betelgeuse.gguf.layouts import SUPPORTED_ARCHS
from betelgeuse.gguf.modelconfig import ModelConfig
from betelgeuse.gguf.qtypes import SUPPORTED_QTYPES, qtype_name, row_nbytes, tensor_nbytes
from betelgeuse.gguf.reader import ExpertPart, GGUFModelFile, TensorInfo, blk

__all__ = [
    "SUPPORTED_ARCHS", "SUPPORTED_QTYPES", "ExpertPart", "GGUFModelFile", "ModelConfig", "TensorInfo",
    "blk", "dequantize", "qtype_name", "row_nbytes", "tensor_nbytes",
]


def __getattr__(name):
    # torch only when dequantization is asked for: the store process imports this package too
    if name == "dequantize":
        from betelgeuse.gguf.quants import dequantize
        return dequantize
    raise AttributeError(name)
