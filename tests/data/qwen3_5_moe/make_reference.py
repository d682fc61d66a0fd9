"""Reference outputs of transformers' Qwen3.5-MoE, for `tests/test_target_moe.py` and an end-to-end target test.

Run with the reference environment (transformers 5.24.0, torch on CPU), from anywhere:

    /work/refenv/bin/python tests/data/qwen3_5_moe/make_reference.py

Writes, next to this script (README.md describes every file):

- `block/`: one random `Qwen3_5MoeSparseMoeBlock` (hidden 64, 8 experts, top-2, expert width 32, shared expert
  48) in float32: `model.safetensors` (its weights as released checkpoints store them, under
  `model.layers.0.mlp.`), `io.safetensors` (an input `[2, 7, 64]`, the block's output, the router's experts and
  weights) and `config.json` (the text config).
- `model/`: a random 4-layer `qwen3_5_moe` text model (three Gated DeltaNet layers, then one gated full
  attention), weights BF16 in the released layout (`model.language_model.*`, fused experts), the released
  `Qwen3_5MoeForConditionalGeneration` config.json without a vision tower, and `io.safetensors`: a 24-token
  prompt with transformers' float32 logits and hidden_states. The weights are loaded back through transformers'
  own checkpoint conversion and must give the same logits (checked here), so the files are in a layout
  transformers reads.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, hidden_act="silu")
MODEL = dict(BLOCK, vocab_size=160, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                              "mrope_section": [2, 1, 1], "mrope_interleaved": True},
             layer_types=["linear_attention"] * 3 + ["full_attention"])
PROMPT = [3, 141, 59, 26, 53, 58, 97, 93, 23, 84, 62, 64, 33, 83, 27, 95, 2, 88, 41, 97, 16, 9, 39, 37]


def randomise(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Every parameter drawn afresh: N(0, 1 / fan_in) matrices (fan-in: the last axis), N(0, 0.1^2) around the
    initial value for vectors (norm gains, A_log, dt_bias). transformers zero-initialises the router and some
    norms; random ones exercise every term."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim >= 2 and "conv1d" not in name:
                param.copy_(noise / param.shape[-1] ** 0.5)
            else:
                param.copy_(param.float() + 0.1 * noise)


def write_block() -> None:
    directory = os.path.join(HERE, "block")
    os.makedirs(directory, exist_ok=True)
    config = Qwen3_5MoeTextConfig(**BLOCK)
    block = Qwen3_5MoeSparseMoeBlock(config).float().eval()
    randomise(block, torch.Generator().manual_seed(0))
    x = torch.randn((2, 7, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = block(x)
        _, weights, experts = block.gate(x.reshape(-1, 64))
    save_file({f"model.layers.0.mlp.{k}": v.contiguous() for k, v in block.state_dict().items()},
              os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    save_file({"x": x, "y": y, "experts": experts.to(torch.int32).reshape(2, 7, -1).contiguous(),
               "weights": weights.reshape(2, 7, -1).contiguous()},
              os.path.join(directory, "io.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(dict(BLOCK, model_type="qwen3_5_moe_text"), f, indent=2)


def write_model() -> None:
    directory = os.path.join(HERE, "model")
    os.makedirs(directory, exist_ok=True)
    text = Qwen3_5MoeTextConfig(**MODEL)
    model = Qwen3_5MoeForCausalLM(text).eval()
    randomise(model, torch.Generator().manual_seed(2))
    with torch.no_grad():  # the parameters take the values the BF16 files hold (not the buffers: RoPE's inv_freq)
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True)
    # The released layout: the text model under `model.language_model.`, the LM head at the root.
    weights = {("lm_head." + k[8:] if k.startswith("lm_head.") else "model.language_model." + k[6:]):
               v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    save_file({"input_ids": tokens.to(torch.int32), "logits": out.logits.float().contiguous(),
               "hidden_states": torch.stack(out.hidden_states).float().contiguous()},
              os.path.join(directory, "io.safetensors"))
    text_config = {k: v for k, v in text.to_dict().items() if k in MODEL or k in ("model_type", "eos_token_id")}
    text_config["full_attention_interval"] = 4
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "text_config": text_config}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    check_model_reloads(directory, text, tokens, out.logits)


def check_model_reloads(directory: str, text: Qwen3_5MoeTextConfig, tokens: torch.Tensor,
                        logits: torch.Tensor) -> None:
    """The written files, read by transformers' loader (its `qwen3_5_moe_text` conversion: the prefix change
    and the expert layout), give the logits written."""
    with tempfile.TemporaryDirectory() as tmp:
        text.save_pretrained(tmp)
        save_file(load_file(os.path.join(directory, "model.safetensors")), os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
        again, info = Qwen3_5MoeForCausalLM.from_pretrained(tmp, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), f"transformers did not read every tensor as written: {info}"
    with torch.no_grad():
        error = (again.eval()(tokens).logits - logits).abs().max().item()
    assert error == 0.0, f"reloaded logits differ by {error}"


if __name__ == "__main__":
    write_block()
    write_model()
