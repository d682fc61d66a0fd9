"""Build the Qwen3.5 (`qwen3_5_text`) reference data of `tests/test_target_qwen3_5.py` with transformers.

Run with the reference environment (transformers 5.24.0 with torch, CPU), from the repository root:

    /work/refenv/bin/python tests/data/qwen3_5/make_reference.py

It builds a tiny random `Qwen3_5ForCausalLM` (4 layers: 3 Gated DeltaNet + 1 gated full attention, hidden 64),
draws its weights with a seeded generator at scales where every part matters (the library's own init leaves the
RMSNorm offsets at 0 and the projections at std 0.02), rounds them to bfloat16 (so `model.safetensors` is half
the size; the forward still runs in float32 on the rounded values) and writes, next to this file:

- `config.json`: the text config as a `Qwen3_5ForCausalLM` checkpoint carries it.
- `model.safetensors`: the weights, BF16, HF names (`model.layers.{i}.linear_attn.*`, `...self_attn.*`, ...).
- `reference.safetensors`: `tokens` I64 [1, 48] (a 40-token prompt and 8 continuation tokens), float32
  `logits` [1, 48, V] of one uncached forward over all 48 (transformers' chunked gated delta rule,
  `torch_chunk_gated_delta_rule`, eager attention), `hidden_states` [N + 1, 1, 48, H] (transformers'
  `output_hidden_states`), `last_hidden` [1, 48, H] (after the final norm), and `decode_logits` [1, 8, V]:
  the 40-token prompt prefilled into a cache, then the 8 tokens decoded one at a time
  (`torch_recurrent_gated_delta_rule` and the conv state update).
"""

import json
import os

import torch
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_act": "silu",
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "attn_output_gate": True,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}
PROMPT, EXTRA = 40, 8


def randomise(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Weights at trained-like scales: projections N(0, 1/fan_in), RMSNorm offsets (`1 + w`) and the gated norm's
    gain near their centres, A = exp(A_log) in [0.01, 16] as transformers initialises it, dt_bias near 1."""
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=generator).log())
            elif name.endswith("dt_bias"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            elif name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain `w * x_hat`
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            elif "norm" in name:  # zero-centred RMSNorm: `(1 + w) * x_hat`
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
            elif name.endswith("conv1d.weight"):  # [conv_dim, 1, K]
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
            p.copy_(p.to(torch.bfloat16).float())  # stored as BF16: the reference runs on the rounded values


def main() -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    config = Qwen3_5TextConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "torch_dtype")})
    config._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(config).float().eval()
    assert [type(layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn).__name__
            for layer in model.model.layers] == ["Qwen3_5GatedDeltaNet"] * 3 + ["Qwen3_5Attention"]
    randomise(model, generator)
    tokens = torch.randint(2, CONFIG["vocab_size"], (1, PROMPT + EXTRA), generator=generator)
    with torch.no_grad():
        full = model(tokens, output_hidden_states=True, use_cache=False)
        last = model.model(tokens).last_hidden_state
        prefill = model(tokens[:, :PROMPT], use_cache=True)
        cache, steps = prefill.cache, []
        for t in range(PROMPT, PROMPT + EXTRA):
            out = model(tokens[:, t:t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits[:, -1])
    decode = torch.stack(steps, dim=1)
    print("max |decode - full| logits:", (decode - full.logits[:, PROMPT:]).abs().max().item())
    print("hidden_states[-1] == last_hidden:", torch.equal(full.hidden_states[-1], last))
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(weights, os.path.join(HERE, "model.safetensors"))
    with open(os.path.join(HERE, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
        f.write("\n")
    save_file({"tokens": tokens.contiguous(), "logits": full.logits.float().contiguous(),
               "hidden_states": torch.stack(full.hidden_states).float().contiguous(),
               "last_hidden": last.float().contiguous(), "decode_logits": decode.float().contiguous()},
              os.path.join(HERE, "reference.safetensors"))


if __name__ == "__main__":
    main()
