"""Adapters for model libraries: :mod:`dbo.integrations.transformers` (Hugging Face transformers
MoE models, expert-parallel with dbo's backends, and overlapped)."""
