"""The overlapped prefill of a transformers MoE model: :class:`DBOPrefill` runs the prefill of a
model made expert-parallel (converted with
:func:`~dbo.integrations.transformers.convert.convert_to_expert_parallel`, or loaded with dbo's
expert-parallel implementations) as overlapped ubatches (:class:`dbo.DBOWrapper`):
``input_ids [batch, seq]`` is split at sequence boundaries, each ubatch runs the whole model, the
logits are merged in order. :func:`prefill_logits` is the plain prefill it overlaps, and
:func:`prefill_split_config` the split whose rows are sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from dbo.autotune import AutotuneResult, autotune_split_config
from dbo.deployment import DeploymentConfig
from dbo.integrations.transformers.ep import prepare_for_overlap
from dbo.integrations.transformers.ep_model import expert_parallel_deployment, expert_parallel_group
from dbo.integrations.transformers.faults import named_device_faults
from dbo.integrations.transformers.moe_block import routing_token_mask
from dbo.overlap import DBOWrapper
from dbo.run_options import RunOptions
from dbo.split import SplitConfig, UBatchPlan

__all__ = ["prefill_split_config", "prefill_logits", "DBOPrefill"]


def prefill_split_config(min_sequences: int = 2, **kwargs: Any) -> SplitConfig:
    """A :class:`SplitConfig` for :class:`DBOPrefill`, whose rows are sequences, not tokens:
    split from ``min_sequences`` sequences per rank on (other fields as ``SplitConfig``)."""
    kwargs.setdefault("prefill_token_threshold", min_sequences)
    kwargs.setdefault("decode_token_threshold", min_sequences)
    return SplitConfig(**kwargs)


def prefill_logits(model: torch.nn.Module, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None, *, logits_to_keep: int = 0,
                   mask_padding_tokens: bool = True) -> torch.Tensor:
    """One plain (not overlapped) prefill forward of a causal LM, without a KV cache.

    Args:
        input_ids: ``[batch, seq]`` int64.
        attention_mask: ``[batch, seq]`` 1 for real tokens, 0 for padding (None: all real).
        logits_to_keep: 0 for every position, k for the last k (the model's own argument).
        mask_padding_tokens: route tokens with attention mask 0 to no expert (their logits
            are meaningless either way).

    Returns:
        ``[batch, seq or logits_to_keep, vocab]`` logits in the model's dtype.
    """
    kwargs: dict[str, Any] = {"use_cache": False}
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep
    with routing_token_mask(attention_mask if mask_padding_tokens else None):
        return model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits


class DBOPrefill(torch.nn.Module):
    """Overlapped prefill of a (converted, or loaded with dbo's expert-parallel implementations)
    transformers causal LM. A model loaded with FSDP2 is first
    :func:`~dbo.integrations.transformers.fsdp.prepare_for_overlap`'d (collective: build it on every rank; a
    no-op once the model has run a forward).

    ``DBOPrefill(model, group=ep_group)(input_ids, attention_mask)`` splits the batch at
    sequence boundaries into ubatches (all ranks of ``group`` agree, padding with all-padding
    sequences where a rank has fewer), runs :func:`prefill_logits` on each, overlapped, and
    returns the logits in order. A rank with nothing to do still calls it (the MoE layers are
    collective), with one all-padding sequence.

    Args:
        model: the model (converted with :func:`convert_to_expert_parallel`).
        config: the split; default: the deployment the model was loaded for
            (``ep_distributed_config(..., deployment=...)``), else :func:`prefill_split_config`
            (split from 2 sequences). A tuned deployment's :class:`dbo.deployment.DeploymentConfig`
            gives its split config, SM carve-out and sbo groups, as for :class:`dbo.DBOWrapper`.
        group: the expert-parallel group (agrees on the split; default: the group of a model
            loaded with dbo's expert-parallel implementations, else the default group).
        logits_to_keep, mask_padding_tokens: as in :func:`prefill_logits`.
        sm_carveout, trace, timeout_s: as in :class:`dbo.DBOWrapper` (``timeout_s`` bounds
            every wait for a peer rank in the model's backends during the call).
        options: the run's options as one :class:`dbo.RunOptions` (then leave out the three
            above), as :class:`dbo.DBOWrapper` takes them.
        sync_faults: where a backend waits for its peers inside GPU kernels that trap after the
            timeout (copy_engine on CUDA), wait for the GPU at the end of each call, so that a
            peer that died or stalled late in the call shows here as the named
            :class:`~dbo.errors.CollectiveTimeoutError` and not at your next CUDA call as a bare
            "unspecified launch failure" (default True; False returns before the GPU is done,
            as a plain forward does).
    """

    def __init__(self, model: torch.nn.Module, config: SplitConfig | DeploymentConfig | None = None, *,
                 group: Any = None,
                 logits_to_keep: int = 0, mask_padding_tokens: bool = True,
                 sm_carveout: int | None = None, trace: Any = None, timeout_s: float | None = None,
                 sync_faults: bool = True, options: RunOptions | None = None):
        super().__init__()
        self.model = prepare_for_overlap(model)
        if group is None:
            group = expert_parallel_group(model)
        self.logits_to_keep = logits_to_keep
        self.mask_padding_tokens = mask_padding_tokens
        self.sync_faults = bool(sync_faults)
        if config is None:  # the deployment the model was loaded for, else split from 2 sequences
            config = expert_parallel_deployment(model) or prefill_split_config()
        self.wrapper = DBOWrapper(self._forward, config,
                                  group=group, sm_carveout=sm_carveout, trace=trace,
                                  timeout_s=timeout_s, options=options)
        #: device memory per token (of ``input_ids``) that the plain prefill needs, with the
        #: autotune's margin; 0: unknown. Where set (:meth:`autotune` sets it on CUDA), a call for
        #: which a rank has less free raises DeviceMemoryError on every rank before it starts
        self.plain_bytes_per_token = 0

    @property
    def last_plan(self) -> UBatchPlan | None:
        """The plan of the latest call (rows are sequences)."""
        return self.wrapper.last_plan

    def autotune(self, seq_len: int, batch_sizes: Sequence[int], *, vocab_size: int | None = None,
                 warmup: int = 1, steps: int = 3, rounds: int = 1, margin: float = 0.02,
                 schedules: Sequence[str] = ("split", "merged", "sbo"),
                 sm_carveouts: Sequence[int | None] | None = None) -> AutotuneResult:
        """Time the prefill plainly and overlapped at ``batch_sizes`` sequences of ``seq_len``
        random tokens per rank, and keep the winner: from then on this prefill splits from the
        smallest batch at which DBO won by ``margin`` (with the faster expert schedule), never
        (it runs plainly where DBO did not pay), or never with ``sbo`` where that won at every
        batch size. Collective: every rank calls it with the same
        arguments (:func:`dbo.autotune.autotune_split_config`).

        The choice is a sequence count, for this ``seq_len``: tune one prefill per prompt length
        that matters (a token count sets the cost, and rows here are sequences).

        ``sm_carveouts`` (e.g. ``(None, 16)``) measures the overlapped runs with each SM
        carve-out and keeps the one that pays (as the prefill's ``sm_carveout`` from then on);
        None times them with the prefill's own ``sm_carveout``. The timed calls run with the
        prefill's other options too (its ``timeout_s``; not its trace). The plain call's device
        memory it measures (``AutotuneResult.plain_bytes_per_row``, CUDA only) sets
        :attr:`plain_bytes_per_token`.

        Returns:
            the :class:`~dbo.autotune.AutotuneResult` (its rows are by sequences per rank).

        Raises:
            ValueError: ``seq_len < 1`` or a bad ``batch_sizes`` (and as
                :func:`~dbo.autotune.autotune_split_config`).
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        vocab = vocab_size or int(self.model.config.vocab_size)
        device = next(self.model.parameters()).device
        g = torch.Generator().manual_seed(seq_len)

        def make_inputs(batch: int) -> list[torch.Tensor]:
            return [torch.randint(0, vocab, (batch, seq_len), generator=g).to(device)]

        result = autotune_split_config(self._forward, make_inputs, batch_sizes, decode_only=False,
                                       config=self.wrapper.config, group=self.wrapper.group,
                                       warmup=warmup, steps=steps, rounds=rounds, margin=margin,
                                       options=dataclasses.replace(self.wrapper.options, trace=None),
                                       schedules=schedules, sm_carveouts=sm_carveouts)
        self.wrapper.config = result.config
        self.wrapper.sm_carveout = result.sm_carveout
        self.plain_bytes_per_token = -(-result.plain_bytes_per_row // seq_len)  # rows: sequences
        return result

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return prefill_logits(self.model, input_ids, attention_mask, logits_to_keep=self.logits_to_keep,
                              mask_padding_tokens=self.mask_padding_tokens)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                plan: UBatchPlan | None = None) -> torch.Tensor:
        """``input_ids`` ``[batch, seq]`` (and ``attention_mask`` of the same shape) -> logits
        ``[batch, seq or logits_to_keep, vocab]``, the same as :func:`prefill_logits`."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.shape[0] == 0:
            raise ValueError("an empty batch cannot run the model: give a rank with nothing to do "
                             "one all-padding sequence (attention_mask all 0)")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids "
                             f"{tuple(input_ids.shape)}")
        need = self.plain_bytes_per_token * input_ids.numel() or None
        with named_device_faults(sync=self.sync_faults):
            masks = () if attention_mask is None else (attention_mask,)
            return self.wrapper(input_ids, *masks, plan=plan, need_bytes=need)

