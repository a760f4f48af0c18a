"""The GPU kernels that the MoE layer, the backends and the experts share, below all of them:
``triton_launch`` (launching Triton kernels with less host time; whether a tensor's kernels run
on Triton) and ``row_copies`` (row copies between activation buffers: the merged expert
schedule's and the DeepEP low-latency backend's). Every module imports on a CPU-only install.
"""

__all__: list[str] = []
