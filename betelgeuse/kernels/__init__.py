"""Batched expert math over slot indices: a torch reference (CPU, CI) and Triton kernels (GPU), one interface
(`moe.MoEKernels`)."""
