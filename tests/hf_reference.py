"""Reference steering with plain transformers: a forward hook adds the steering to a decoder layer's output
(the residual stream), on the same weights vLLM serves. Used to check that hotwire adds exactly
``scale * v`` (or ``scale * |h| * v/|v|`` with ``norm``) where the spec says."""

from __future__ import annotations

from pathlib import Path

import torch


def load(model_dir: Path, dtype: torch.dtype = torch.float32, *, images: bool = False):
    """The model, as a causal LM, or with ``images`` as an image-text-to-text model (its vision tower too)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if images else AutoModelForCausalLM
    return auto.from_pretrained(str(model_dir), dtype=dtype).eval()


def decoder_layers(model) -> torch.nn.ModuleList:
    """The text decoder's layers: ``model.model.layers``, or a vision-language model's ``text_model`` ones."""
    inner = model.model
    return inner.layers if hasattr(inner, "layers") else inner.text_model.layers


def logprobs(
    model,
    token_ids: list[int],
    steering: list[tuple[int, torch.Tensor, float, bool]] = (),
    positions: slice = slice(None),
    **inputs: torch.Tensor,
) -> torch.Tensor:
    """Log-probabilities of the next token after each position, ``[len(token_ids), vocab]``, with ``steering``
    entries ``(layer, vector, scale, norm)`` added to the named layers' outputs at ``positions`` (every one by
    default; ``slice(None, P)`` is ``prefill_only`` for a prompt of ``P`` tokens, ``slice(P, None)``
    ``decode_only``). ``inputs``: further model inputs, such as a processor's ``pixel_values``."""
    layers = decoder_layers(model)
    handles = []
    by_layer: dict[int, list] = {}
    for layer, vector, scale, norm in steering:
        by_layer.setdefault(layer, []).append((vector, scale, norm))

    def make_hook(entries):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            base = hidden.float()
            delta = torch.zeros_like(base)
            for vector, scale, norm in entries:
                v = vector.float()
                if norm:
                    delta += scale * base.norm(dim=-1, keepdim=True) * v / v.norm()
                else:
                    delta += scale * v
            steered = base.clone()
            steered[:, positions] += delta[:, positions]
            steered = steered.to(hidden.dtype)
            return (steered, *output[1:]) if isinstance(output, tuple) else steered

        return hook

    for layer, entries in by_layer.items():
        handles.append(layers[layer].register_forward_hook(make_hook(entries)))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([token_ids]), **inputs).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return torch.log_softmax(logits, dim=-1)


def prompt_logprobs(
    model,
    token_ids: list[int],
    steering: list[tuple[int, torch.Tensor, float, bool]] = (),
    positions: slice = slice(None),
    **inputs: torch.Tensor,
) -> torch.Tensor:
    """Log-probability of each prompt token given its prefix (positions 1..n-1), steered as in :func:`logprobs`."""
    ids = torch.tensor(token_ids[1:])
    return logprobs(model, token_ids, steering, positions, **inputs)[:-1].gather(1, ids[:, None])[:, 0]


def layer_outputs(
    model, token_ids: list[int], layers: list[int], steering: list[tuple[int, torch.Tensor, float]] = ()
) -> dict[int, torch.Tensor]:
    """The residual stream after each of ``layers`` (a forward hook on the decoder layer's output), ``[T, hidden]``
    float32 per layer: what hotwire's capture and readout read. ``steering`` entries ``(layer, vector, scale)`` are
    added to the named layers' outputs first, as hotwire's ops run (steering, then reading)."""
    captured: dict[int, torch.Tensor] = {}
    decoder = decoder_layers(model)

    def steer(vector, scale):
        def hook(module, args, output):
            return (output[0] + scale * vector, *output[1:]) if isinstance(output, tuple) else output + scale * vector

        return hook

    def keep(layer):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            captured[layer] = hidden[0].float().clone()

        return hook

    handles = [decoder[layer].register_forward_hook(steer(vector, scale)) for layer, vector, scale in steering]
    handles += [decoder[layer].register_forward_hook(keep(layer)) for layer in layers]
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for h in handles:
            h.remove()
    return captured


def assert_steering_matches(plain_err: float, steered_err: float, effect: float, bf16: bool) -> None:
    """vLLM's plain and steered logprobs against transformers' without and with the hook (largest differences), and
    the steering's own effect there. float32 matches transformers to ~1e-4: both within 2e-3. bf16 (a GPU, or a
    family the CPU runs in bf16 only) carries its own rounding, seen in the plain error: the steered error must stay
    within twice it. Either way the steering must stand ten times clear of the bound, so the check can fail."""
    tolerance = max(2e-3, 2 * plain_err) if bf16 else 2e-3
    assert plain_err < (0.1 if bf16 else 2e-3), f"plain vLLM differs from transformers: {plain_err}"
    assert steered_err < tolerance, f"steered vLLM differs from transformers + hook: {steered_err} (effect {effect})"
    assert effect > 10 * tolerance, f"the steering in this check is too weak to be seen: {effect}"
