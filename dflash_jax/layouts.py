"""Published drafter layouts: folded into the one layout `DflashConfig` and `spec.drafter_spec` read, or refused by
name. The architecture and the tensors decide which network a checkpoint holds, never `model_type` alone.

Config side (`fold`, run by `config.parse_config` before anything is decoded):
- vLLM `speculators` exports (`speculators_model_type` "dflash" / "dspark"; vllm-project/speculators
  `src/speculators/models/{dflash,dspark}/config.py`): the decoder config nested in `transformer_layer_config`,
  the target layers as `aux_hidden_state_layer_ids` (hidden-state indices: z-lab's id + 1, as speculators'
  DFlash converter and vLLM's `update_dflash` map them), `sample_from_anchor`, `sliding_window_non_causal`, the
  class defaults for fields an export leaves out.
- Muse-Glimmer's assistant (`MuseGlimmerAssistantModel`): a DFlash drafter whose config states no vocabulary
  (its target's, 202048, is what transformers', vLLM's, SGLang's and z-lab's loaders default to), whose layers
  are bidirectional (transformers' `MuseGlimmerAssistantAttention.is_causal` is False; vLLM's config sets
  `dflash_config.causal: false`) and whose sliding windows are applied (`use_sliding_window` defaults to True).
- DeepSpec's Gemma 4 DSpark drafter (`Gemma4DSparkModel`, deepspec/modeling/dspark/gemma4/): its config is the
  target's Gemma 4 text config with the draft fields added; every drafter layer is one of Gemma 4's
  full-attention (global) layers, so `head_dim` is read from `global_head_dim`, the KV heads from
  `num_global_key_value_heads` under `attention_k_eq_v`, the RoPE from `rope_parameters.full_attention`
  (transformers' `Gemma4TextConfig` defaults for the fields a config leaves out). The layer itself is
  `model.gemma4_decoder_layer`.
`not_implemented` names what a config describes and this package does not run (other architectures, MLA, MoE,
Laguna's gate, Nemotron's hybrid blocks, MiMo's sliding-only sinks, ...).

Tensor side: `PUBLISHED_NAMES` (the names an architecture's checkpoints store tensors under, for the test
writers), `ENCODER` and `check_context_layout` (the assistant's `encoder.*` set, whole or not at all).
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

from .errors import CheckpointError, ConfigError

__all__ = ["fold", "architecture_names"]

# What this package implements (docs/references.md): the Qwen3-style drafter under its released names.
MODEL_TYPES = ("qwen3",)
ASSISTANT = ("MuseGlimmerAssistantModel", "DFlashMuseGlimmerAssistantModel")  # vLLM registers both names
GEMMA4 = "Gemma4DSparkModel"  # DeepSpec's Gemma 4 DSpark drafter: Gemma 4 layers (`model.gemma4_*`)
ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", "DSparkDraftModel", "Qwen3DSparkModel", *ASSISTANT, GEMMA4)
MUSE_GLIMMER_VOCAB = 202048  # the Muse-Glimmer target's vocabulary, which the assistant's config leaves out

# Drafter networks that differ from the Qwen3-style one, by architecture and by model_type prefix: named in
# the refusal so that a user learns what the checkpoint is, not only that it is refused.
OTHER_ARCHITECTURES = {
    "DFlashLagunaForCausalLM": "poolside's Laguna DFlash drafter (a per-head softplus output gate `g_proj`, "
                               "per-feature `aux_hidden_norms` before `fc`, context rows through each layer's "
                               "input norm)",
    "K3DSparkModel": "the Kimi-K3 DSpark drafter (multi-head latent attention)",
}
OTHER_MODEL_TYPES = {
    "gemma": "a Gemma drafter network", "laguna": "poolside's Laguna DFlash network",
    "nemotron": "an NVIDIA Nemotron drafter network", "deepseek": "a DeepSeek (MLA / MoE) drafter network",
    "kimi": "a Kimi (MLA) drafter network",
}
MLA_RANKS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")  # what an MLA layer is built from
EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")

# vLLM speculators: the architecture each exported algorithm runs as, and the class defaults of the fields an
# export may leave out (`DFlashSpeculatorConfig`, `DSparkSpeculatorConfig`).
SPECULATORS = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}
SPECULATORS_DEFAULTS: dict[str, dict[str, Any]] = {
    "dflash": {"block_size": 8, "sample_from_anchor": False},
    "dspark": {"block_size": 8, "sample_from_anchor": True, "markov_rank": 256, "markov_head_type": "vanilla",
               "enable_confidence_head": True, "confidence_head_with_markov": True},
}
SPECULATORS_FIELDS = ("draft_vocab_size", "mask_token_id", "block_size", "sample_from_anchor", "markov_rank",
                      "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
# Attention fields vLLM's speculators reader takes from the top level over the nested decoder config's.
SPECULATORS_ATTENTION = ("layer_types", "sliding_window", "use_sliding_window", "max_window_layers")

# The assistant's context projection, stored as `encoder.*` (z-lab dflash `model_mlx.py` maps it onto fc /
# hidden_norm): stored name -> spec name.
ENCODER = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
PUBLISHED_NAMES: dict[str, dict[str, str]] = {  # architecture -> {spec name: stored name}
    name: {spec: stored for stored, spec in ENCODER.items()} for name in ASSISTANT}


def architecture_names(raw: dict[str, Any]) -> list[str]:
    """The strings of a raw config's `architectures` list (anything else there is ignored)."""
    stated = raw.get("architectures")
    return [a for a in stated if isinstance(a, str)] if isinstance(stated, list) else []


def fold(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """`raw` in the layout `DflashConfig` reads: a speculators export unnested, the assistant's defaults filled in.

    Raises `ConfigError` naming `source` and the field for a speculators export this package cannot run.
    """
    if "speculators_model_type" in raw:
        raw = _fold_speculators(raw, source)
    if any(a in ASSISTANT for a in architecture_names(raw)):
        raw = _fold_assistant(raw)
    if GEMMA4 in architecture_names(raw):
        raw = _fold_gemma4(raw, source)
    return raw


# transformers' `Gemma4TextConfig` defaults of the fields the drafter's layers read (configuration_gemma4.py)
GEMMA4_DEFAULTS: dict[str, Any] = {
    "global_head_dim": 512, "hidden_activation": "gelu_pytorch_tanh", "attention_k_eq_v": False,
    "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1000000.0}},
}


def _fold_gemma4(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """A Gemma 4 DSpark config with the global layers' head dim, KV heads and RoPE in the drafter's fields.

    DeepSpec's `Gemma4DSparkAttention` always uses `global_head_dim` and, with `attention_k_eq_v`,
    `num_global_key_value_heads`; its rotary embedding is built for `full_attention` only; it asserts the MoE
    block and per-layer inputs off. What DeepSpec's layer would not run, or this package runs differently, is
    refused naming the field.
    """
    def fail(message: str) -> NoReturn:
        raise ConfigError(f"{source}: {GEMMA4} config: {message}")

    out = {**raw, **{k: v for k, v in GEMMA4_DEFAULTS.items() if k not in raw}}
    activation = out["hidden_activation"]
    if activation != GEMMA4_DEFAULTS["hidden_activation"]:
        fail(f"`hidden_activation` {activation!r}: only Gemma 4's 'gelu_pytorch_tanh' MLP is implemented")
    for key, what in (("enable_moe_block", "a mixture-of-experts block"),
                      ("hidden_size_per_layer_input", "per-layer input embeddings (Gemma 4's PLE)")):
        if out.get(key):
            fail(f"`{key}` {out[key]!r} ({what}; DeepSpec's drafter asserts it off): not implemented")
    layers, shared = out.get("num_hidden_layers"), out.get("num_kv_shared_layers") or 0
    if out.get("use_double_wide_mlp") and isinstance(layers, int) and isinstance(shared, int) and 0 < shared < layers:
        fail(f"`use_double_wide_mlp` with num_kv_shared_layers={shared} doubles the MLP of layers "
             f"{layers - shared}..{layers - 1} (transformers' Gemma4TextMLP): not implemented")
    kinds = out.get("layer_types")
    if isinstance(kinds, list) and any(k != "full_attention" for k in kinds):
        fail(f"`layer_types` {kinds}: DeepSpec's drafter layers are Gemma 4's full-attention layers (its "
             "build_draft_config writes them so, and its layer has no window); other kinds are not implemented")
    fields = ["global_head_dim"] + (["num_global_key_value_heads"] if out["attention_k_eq_v"] else [])
    if out["attention_k_eq_v"] and out.get("num_global_key_value_heads") is None:
        fail("`attention_k_eq_v: true` without `num_global_key_value_heads`, the KV heads of its layers")
    for key in fields:  # checked here, as a Gemma 4 field; later errors about them are `restate`d
        if not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] <= 0:
            fail(f"`{key}` is {out[key]!r}; expected a positive integer")
    out["head_dim"] = out["global_head_dim"]
    if out["attention_k_eq_v"]:
        out["num_key_value_heads"] = out["num_global_key_value_heads"]
    rope = out["rope_parameters"]
    full = rope.get("full_attention") if isinstance(rope, dict) else None
    if not isinstance(full, dict):
        fail(f"`rope_parameters` is {rope!r}; expected the per-layer-type blocks of a Gemma 4 config, with "
             "`full_attention` (the drafter's layers' RoPE)")
    out["rope_parameters"] = full
    return out


def _fold_assistant(raw: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    out.setdefault("vocab_size", MUSE_GLIMMER_VOCAB)
    out.setdefault("use_sliding_window", True)
    sub = out.get("dflash_config")
    if sub is None or isinstance(sub, dict):  # anything else is msgspec's to refuse
        out["dflash_config"] = {"causal": False, **(sub or {})}
    return out


def _fold_speculators(raw: dict[str, Any], source: str) -> dict[str, Any]:
    kind = raw["speculators_model_type"]
    if not isinstance(kind, str) or kind not in SPECULATORS:
        raise ConfigError(
            f"{source}: `speculators_model_type` {kind!r}: not a drafter dflash_jax runs; expected a speculators "
            f"export of {' or '.join(map(repr, SPECULATORS))} (a DFlash or DSpark drafter)")
    layer = raw.get("transformer_layer_config", raw.get("transformer_config"))
    if not isinstance(layer, dict):
        what = "missing" if layer is None else f"a JSON {type(layer).__name__}"
        raise ConfigError(f"{source}: `transformer_layer_config` is {what}; a speculators {kind} export nests the "
                          "drafter's decoder config (hidden_size, layers, heads, ...) there, as an object")
    # speculators builds Qwen3-style layers whatever the nested model_type (often the verifier's) says
    out = {k: v for k, v in layer.items() if k not in ("model_type", "architectures")}
    out.update({k: raw[k] for k in SPECULATORS_ATTENTION if raw.get(k) is not None})
    out["architectures"] = [SPECULATORS[kind]]
    defaults = SPECULATORS_DEFAULTS[kind]
    out.update({k: raw.get(k, defaults.get(k)) for k in SPECULATORS_FIELDS if raw.get(k, defaults.get(k)) is not None})
    out["target_layer_ids"] = [i - 1 for i in _aux_ids(raw, out, kind, source)]  # hidden_states[i]: layer i - 1
    if raw.get("sliding_window_non_causal") is True and "is_causal" not in out:
        out["is_causal"] = False  # sliding layers bidirectional; full layers are so anyway
    target_hidden, hidden = raw.get("target_hidden_size"), out.get("hidden_size")
    if target_hidden is not None and target_hidden != hidden:
        raise ConfigError(f"{source}: `target_hidden_size`={target_hidden!r} differs from "
                          f"transformer_layer_config.hidden_size={hidden!r}: a drafter reading target features of "
                          "another width is not implemented")
    return out


def _aux_ids(raw: dict[str, Any], out: dict[str, Any], kind: str, source: str) -> list[int]:
    """A speculators export's `aux_hidden_state_layer_ids`, checked here: folded into `target_layer_ids` (less
    one), the checks after the fold would name that field and other values than the file's."""
    aux = raw.get("aux_hidden_state_layer_ids")

    def fail(problem: str) -> NoReturn:
        raise ConfigError(f"{source}: `aux_hidden_state_layer_ids` {problem}: a speculators {kind} export lists "
                          "there the target hidden states it reads, as a list of integers (hidden_states[i] is the "
                          "output of layer i - 1)")

    if not isinstance(aux, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
        fail(f"is {aux!r}")
    if not aux:
        fail("is empty")
    bad = [i for i in aux if not 0 <= i < 2**31]  # the ids' int32 bound
    if bad:
        fail(f"{aux} has {bad} outside [0, {2**31 - 1}]")
    layers = out.get("num_target_layers")
    if isinstance(layers, int) and not isinstance(layers, bool):
        bad = [i for i in aux if i > layers]
        if bad:
            fail(f"{aux} has {bad} past the {layers + 1} hidden states of num_target_layers={layers}")
    return aux


def renamed(raw: dict[str, Any]) -> dict[str, str]:
    """The fields `fold` copies into others unchanged (folded name -> the file's name): an error about one of them
    names the field the file states (`restate`). A Gemma 4 DSpark's `global_head_dim`, and its
    `num_global_key_value_heads` under `attention_k_eq_v`."""
    if GEMMA4 not in architecture_names(raw):
        return {}
    names = {"head_dim": "global_head_dim"}
    if raw.get("attention_k_eq_v", GEMMA4_DEFAULTS["attention_k_eq_v"]):
        names["num_key_value_heads"] = "num_global_key_value_heads"
    return names


def restate(message: str, names: dict[str, str]) -> str:
    """`message` with each folded field's name, a whole word (`$.head_dim`, `head_dim=64`), as the file names it."""
    for folded, stated in names.items():
        message = re.sub(rf"(?<!\w){folded}(?!\w)", stated, message)
    return message


def not_implemented(raw: dict[str, Any]) -> str | None:
    """Why a (folded) drafter config describes a network this package does not run, or None.

    Judged on the raw dict, before decoding, so that another network is named as what it is instead of loading
    as a Qwen3 drafter with a warning about its tensors. The architecture decides: a known drafter architecture
    runs whatever `model_type` says (exports for other targets carry the target's); without one, a model_type
    naming another drafter network is refused. Extensions this package does not implement are refused by the
    field that declares them, never ignored: each would change the network (docs/references.md).
    """
    stated_sub = raw.get("dflash_config")
    sub: dict[str, Any] = stated_sub if isinstance(stated_sub, dict) else {}
    problems = []
    names = architecture_names(raw)
    unknown = [a for a in names if a not in ARCHITECTURES]
    model_type = raw.get("model_type")
    other_type = next((what for prefix, what in OTHER_MODEL_TYPES.items()
                       if isinstance(model_type, str) and model_type.startswith(prefix)), None)
    if isinstance(model_type, str) and model_type not in MODEL_TYPES and (unknown or (not names and other_type)):
        problems.append(f"model_type {model_type!r}" + (f" ({other_type})" if other_type and not unknown else ""))
    if unknown:
        known = [OTHER_ARCHITECTURES[a] for a in unknown if a in OTHER_ARCHITECTURES]
        problems.append(f"architectures [{', '.join(unknown)}]" + (f": {'; '.join(known)}" if known else ""))
    gemma4 = GEMMA4 in names  # its activation and attention are `_fold_gemma4`'s to check
    for key in ("hidden_act", "hidden_activation"):
        if isinstance(raw.get(key), str) and raw[key] != "silu" and not gemma4:
            problems.append(f"`{key}` {raw[key]!r} (the drafter MLP is SwiGLU, silu)")
    projector = sub.get("projector_type")
    if projector is not None and projector not in ("dflash", "dspark"):
        what = " (SpecForge's DFlash backbone with a causal correction head)" if projector == "domino" else ""
        problems.append(f"`dflash_config.projector_type` {projector!r}{what}")
    problems += _attention_problems(raw, sub, gemma4)
    for key in EXPERT_COUNTS:
        if isinstance(raw.get(key), int) and raw[key] > 0:
            problems.append(f"`{key}` {raw[key]} (a mixture-of-experts MLP; the drafter's is dense)")
    if raw.get("block_pattern"):
        problems.append("`block_pattern` (a Mamba / attention hybrid drafter, Nemotron-style)")
    for key in ("is_neox_style", "rope_is_neox_style"):
        if raw.get(key) is False:
            problems.append(f"`{key}: false` (interleaved RoPE; this package rotates halves, the neox layout)")
    if not problems:
        return None
    return (
        f"{'; '.join(problems)}: not implemented. dflash_jax runs Qwen3-style DFlash, DFlash2 and DSpark drafters "
        f"and DeepSpec's Gemma 4 DSpark (architectures {', '.join(ARCHITECTURES)}; model_type "
        f"{' or '.join(map(repr, MODEL_TYPES))} when no architecture is stated); loading this one would run a "
        "different network"
    )


def _attention_problems(raw: dict[str, Any], sub: dict[str, Any], gemma4: bool) -> list[str]:
    """The attention variants a config declares that the drafter's GQA layer is not: MLA (with the ranks it
    lacks), MiMo's sinks on sliding layers only, Laguna's output gate, Gemma 4's shared K/V outside a Gemma 4
    drafter."""
    problems = []
    mode = sub.get("attention_mode")
    mla = mode == "mla" or any(raw.get(k) is not None for k in ("kv_lora_rank", "q_lora_rank"))
    if mode is not None and mode not in ("gqa", "mha", "mla"):
        problems.append(f"`dflash_config.attention_mode` {mode!r} (only grouped-query / multi-head attention)")
    if mla:
        field = "`dflash_config.attention_mode` 'mla'" if mode == "mla" else "`kv_lora_rank`"
        missing = [k for k in MLA_RANKS if raw.get(k) is None and sub.get(k) is None]
        lacks = f"; the config also lacks {', '.join(missing)}, which an MLA layer is built from" if missing else ""
        problems.append(f"{field} (multi-head latent attention{lacks})")
    if raw.get("add_swa_attention_sink_bias"):  # `attention_sink_bias` (every layer's sink) runs: config.py
        problems.append("`add_swa_attention_sink_bias` (a learned per-head attention sink on the sliding layers "
                        "only, MiMo-style)")
    gating = raw.get("gating")
    if gating not in (None, False, "disabled"):
        problems.append(f"`gating` {gating!r} (Laguna's softplus gate on the attention output)")
    if raw.get("attention_k_eq_v") and not gemma4:
        problems.append(f"`attention_k_eq_v` (V taken from the K projection: Gemma 4's layer, run for the "
                        f"{GEMMA4} architecture only)")
    return problems


def check_context_layout(names: set[str], prefix: str, where: str) -> None:
    """Refuse a checkpoint whose context projection is half one layout and half another: an `encoder.*` set
    (the assistant's) must be whole, hold nothing else, and not sit beside `fc` / `hidden_norm`."""
    stored = {n.removeprefix(prefix) for n in names if n.startswith(prefix + "encoder.")}
    if not stored:
        return
    layout = f"the Muse-Glimmer assistant's encoder ({', '.join(prefix + n for n in ENCODER)})"
    extra = sorted(stored - ENCODER.keys())
    if extra:
        raise CheckpointError(f"{where}: tensor {prefix + extra[0]!r} is not part of {layout}; an encoder that "
                              "differs would run a different network")
    missing = [n for n in ENCODER if n not in stored]
    if missing:
        raise CheckpointError(f"{where}: missing tensor {prefix + missing[0]!r}: the checkpoint has "
                              f"{', '.join(repr(prefix + n) for n in sorted(stored))} of {layout}")
    both = [prefix + spec for spec in ENCODER.values() if prefix + spec in names]
    if both:
        raise CheckpointError(f"{where}: tensor {both[0]!r} beside {layout}: half one layout and half the other; "
                              "expected fc.weight / hidden_norm.weight or the encoder.* pair, not both")
