"""Batched expert math over slot indices: a torch reference (torch_moe.py: CPU, CI) and Triton kernels (GPU), one
interface (`moe.MoEKernels`); and the fused CUDA kernels of the dense parts (triton_norm.py's RMSNorm, triton_ds4.py's
deepseek4 per-row math behind the interface of model.deepseek4.TorchOps)."""
