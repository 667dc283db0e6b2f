"""Batched expert math over slot indices: a torch reference (torch_moe.py: CPU, CI) and Triton kernels (GPU), one
interface (`moe.MoEKernels`)."""
