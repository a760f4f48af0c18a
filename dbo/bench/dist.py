"""The benchmarks' name for :mod:`dbo.peers.process_group` (process-group set-up and teardown),
kept so that scripts written against it still import."""

from dbo.peers.process_group import cuda_context_lost, distributed, init_distributed, shutdown_distributed

__all__ = ["init_distributed", "shutdown_distributed", "distributed", "cuda_context_lost"]
