"""Speculative decoding: two places where the runner's host view of a step is not what its forward computed.

- **Prompt logprobs** (V1, vLLM #53488, open in 0.25.1): a drafter that runs a model (EAGLE, MTP, a draft model)
  runs before the runner computes prompt logprobs from the target's ``hidden_states``, and under CUDA graphs that
  tensor is a graph output in the pool every graph shares: the drafter's graphs can overwrite it, so prompt logprobs
  come from the drafter's activations. Where they do depends on the pool's layout, which hotwire's second (idle)
  graph set changes, so a plugin-free engine's values and hotwire's were wrong in different ways. Here the target's
  hidden states of a step in which a request still needs prompt logprobs are copied before the drafter runs and used
  instead (the fix of vLLM PR #53520): prompt logprobs equal those computed without speculation.
- **Positions** (:func:`device_positions`, :func:`v2_device_positions`): with asynchronous scheduling and
  speculation the host's ``num_computed_tokens`` assume the last step's drafts were all accepted; vLLM corrects them
  on the device before the forward (V1 on the host only after it, V2 not at all). A step's true positions are then
  only on the device.
"""

from __future__ import annotations

from typing import Any

from .patching import wrap

__all__ = ["device_positions", "keep_hidden_states_for_prompt_logprobs", "v2_device_positions"]

_KEPT = "_hotwire_target_hidden_states"  # on the runner, within one sample_tokens call


def device_positions(runner: Any, n_tokens: int) -> Any:
    """V1: the step's token positions on the device when the host's counts may be ahead of them (asynchronous
    scheduling with speculation), else None: the host's are right."""
    if not getattr(runner, "use_async_spec_decode", False):
        return None
    positions = runner.positions
    return getattr(positions, "gpu", positions)[:n_tokens]


def v2_device_positions(runner: Any, batch: Any) -> Any:
    """V2 (the ``InputBatch`` its ``prepare_inputs`` returns): the host holds the scheduler's counts, an upper bound
    under speculation ("CPU upper bound on seq_lens" in vLLM 0.26's runner), the device the true positions. Judged
    by the configuration, not by ``runner.speculator``, which a pipeline rank without the drafter leaves None."""
    if getattr(runner, "speculative_config", None) is None:
        return None
    return batch.positions[: batch.num_tokens]


def keep_hidden_states_for_prompt_logprobs(cls: type) -> None:
    """Patch V1's ``GPUModelRunner`` (see the module's first point)."""
    if not all(name in vars(cls) for name in ("sample_tokens", "propose_draft_token_ids", "_get_prompt_logprobs_dict")):
        return

    def make_sample(original):
        def sample_tokens(self, *args, **kwargs):
            try:
                return original(self, *args, **kwargs)
            finally:
                self.__dict__.pop(_KEPT, None)  # a drafter that runs after the prompt logprobs (n-gram) kept nothing

        return sample_tokens

    def make_propose(original):
        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                    *args, **kwargs):  # fmt: skip
            if self.num_prompt_logprobs:
                n = scheduler_output.total_num_scheduled_tokens
                setattr(self, _KEPT, hidden_states[:n].clone())
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, *args,
                            **kwargs)  # fmt: skip

        return propose_draft_token_ids

    def make_prompt_logprobs(original):
        def _get_prompt_logprobs_dict(self, hidden_states, *args, **kwargs):
            kept = self.__dict__.pop(_KEPT, None)
            if kept is not None and kept.shape == hidden_states.shape:
                hidden_states = kept
            return original(self, hidden_states, *args, **kwargs)

        return _get_prompt_logprobs_dict

    wrap(cls, "sample_tokens", make_sample)
    wrap(cls, "propose_draft_token_ids", make_propose)
    wrap(cls, "_get_prompt_logprobs_dict", make_prompt_logprobs)
