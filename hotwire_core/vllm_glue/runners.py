"""The model runners: V1 (``vllm.v1.worker.gpu_model_runner``, up to 0.33) and V2 (``vllm.v1.worker.gpu.model_runner``,
the only one from 0.34). Each step: the request lifecycle, the idle/steered gate, and the per-token fill before the
forward."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import contract
from ..ops import GATE, IDLE
from ..runtime import Step
from .graphs import capture_variants, set_gate
from .patching import wrap
from .requests import extra_args, prompt_length
from .speculation import device_positions, keep_hidden_states_for_prompt_logprobs, v2_device_positions

__all__ = ["patch_v1_runner", "patch_v2_runner", "step_of", "unhooked_runner"]

_STEP_HOOKS = "_hotwire_step_hooks"  # on a patched runner class: the methods every step must pass through


def unhooked_runner(runner: Any) -> str | None:
    """Why hotwire cannot place steering in ``runner``'s steps, or None when they pass through its hooks: the
    runner's class is (or derives from, keeping the hooked methods) one hotwire patched. Another runner (0.34's
    ``StandaloneCPUModelRunner``, for CPUs without Triton) would run steered requests unsteered."""
    cls = type(runner)
    names = getattr(cls, _STEP_HOOKS, ())
    if names and all(getattr(getattr(cls, name, None), "_hotwire", False) for name in names):
        return None
    return f"vLLM's {cls.__name__} runs the model in steps hotwire does not hook"


def step_of(scheduler_output: Any, removed: Iterable[str]) -> Step:
    """What a ``SchedulerOutput`` changes for the worker's steering: its new requests (``NewRequestData``) with
    their bindings, the bank writes and rebinds the controller put on it, whether it preempted requests; ``removed``:
    the requests the runner drops."""
    preempted = getattr(scheduler_output, "preempted_req_ids", None)
    new, captures, readouts = [], [], []
    for r in scheduler_output.scheduled_new_reqs:
        extra = extra_args(r)
        if extra and contract.BINDING_KEY in extra:
            config = extra[contract.BINDING_KEY]
            new.append((r.req_id, prompt_length(r), config))
            if config.get("r") and contract.READOUT_ARGS_KEY in extra:
                readouts.append((r.req_id, prompt_length(r), extra[contract.READOUT_ARGS_KEY], config["r"]))
        else:
            new.append((r.req_id, 0, None))
            if extra and contract.CAPTURE_KEY in extra:
                captures.append((r.req_id, prompt_length(r), extra[contract.CAPTURE_KEY]))
    return Step(
        removed=removed,
        new=new,
        writes=getattr(scheduler_output, contract.WRITES_ATTR, None) or (),
        rebinds=getattr(scheduler_output, contract.REBINDS_ATTR, None) or {},
        preempted=bool(preempted),
        finished=set(removed).difference(preempted) if preempted else removed,  # V2 removes preempted ones too
        captures=captures,
        readouts=readouts,
    )


def patch_v1_runner(module: Any) -> None:
    cls = module.GPUModelRunner

    def make_execute(original):
        def execute_model(self, scheduler_output, *args, **kwargs):
            steering = getattr(self, "hotwire", None)
            if steering is not None:
                # V1 keeps preempted requests (resumed without new data): only finished ones go.
                steering.on_step(step_of(scheduler_output, scheduler_output.finished_req_ids))
                set_gate(steering, scheduler_output)
            return original(self, scheduler_output, *args, **kwargs)

        return execute_model

    def make_forward(original):
        def _model_forward(self, *args, **kwargs):
            steering = getattr(self, "hotwire", None)
            if steering is not None and not steering.clean:
                batch = self.input_batch
                n = batch.num_reqs
                qsl = self.query_start_loc.np[: n + 1]
                n_tokens = int(qsl[n])
                steering.fill(batch.req_ids[:n], qsl[1:] - qsl[:-1], batch.num_computed_tokens_cpu[:n], n_tokens,
                              device_positions(self, n_tokens))
            return original(self, *args, **kwargs)

        return _model_forward

    wrap(cls, "execute_model", make_execute)
    wrap(cls, "_model_forward", make_forward)
    wrap(cls, "_warmup_and_capture", capture_variants)
    keep_hidden_states_for_prompt_logprobs(cls)
    setattr(cls, _STEP_HOOKS, ("execute_model", "_model_forward"))


def patch_v2_runner(module: Any) -> None:
    cls = module.GPUModelRunner

    def make_execute(original):
        def execute_model(self, scheduler_output, *args, **kwargs):
            steering = getattr(self, "hotwire", None)
            if steering is not None and not kwargs.get("dummy_run", False):
                # V2 drops preempted requests and re-adds them as new ones when they resume.
                removed = scheduler_output.finished_req_ids
                if scheduler_output.preempted_req_ids:
                    removed = removed | set(scheduler_output.preempted_req_ids)
                steering.on_step(step_of(scheduler_output, removed))
                set_gate(steering, scheduler_output)
            elif steering is not None and GATE.split:
                GATE.kinds = IDLE  # a dummy step: every token is padding
            return original(self, scheduler_output, *args, **kwargs)

        return execute_model

    def make_prepare(original):
        def prepare_inputs(self, scheduler_output, *args, **kwargs):
            batch = original(self, scheduler_output, *args, **kwargs)
            steering = getattr(self, "hotwire", None)
            if steering is not None:
                steering.fill(batch.req_ids, batch.num_scheduled_tokens, batch.num_computed_tokens_np, batch.num_tokens,
                              v2_device_positions(self, batch))
            return batch

        return prepare_inputs

    wrap(cls, "execute_model", make_execute)
    wrap(cls, "prepare_inputs", make_prepare)
    setattr(cls, _STEP_HOOKS, ("execute_model", "prepare_inputs"))
