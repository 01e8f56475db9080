"""A model's architecture as the memory planner needs it (:class:`ModelArch`, from a ``config.json`` dict) and its
parameter counts per layer; the formulas are in :mod:`lmfleet.check.planner`'s docstring. Pure: no I/O, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lmfleet.errors import LmfleetError

__all__ = ["ModelArch", "ParamCounts", "PlanError", "arch_from_config", "param_counts"]


class PlanError(LmfleetError, ValueError):
    """The inputs cannot be planned (unknown quantization, a config missing a needed field...)."""


@dataclass(frozen=True)
class ModelArch:
    """The architecture fields the planner needs, from a Hugging Face ``config.json``."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    checkpoint_quant: str | None = None  # quant_method of the checkpoint's quantization_config
    # mixture of experts (0 routed experts: dense)
    num_routed_experts: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen-MoE style: one shared expert of its own width
    num_experts_per_tok: int = 0
    first_k_dense: int = 0  # leading layers with a dense MLP (DeepSeek first_k_dense_replace)
    moe_layer_freq: int = 1
    # multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank 0 means GQA/MHA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_routed_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and i >= self.first_k_dense and (i % max(1, self.moe_layer_freq) == 0)


def _first(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def arch_from_config(cfg: Mapping[str, Any]) -> ModelArch:
    """Build a :class:`ModelArch` from a ``config.json`` dict (Llama, Qwen2/3, Mistral, Mixtral, DeepSeek-V2/V3...).

    Multimodal configs with a ``text_config`` are read from that section.
    """
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k in ("quantization_config",)}}
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        vocab = int(cfg["vocab_size"])
    except KeyError as e:
        raise PlanError(f"config.json has no {e.args[0]!r}; cannot plan memory for this model") from None
    kv_heads = int(_first(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_first(cfg, "head_dim", default=hidden // heads))
    routed = int(_first(cfg, "n_routed_experts", "num_local_experts", "num_experts", default=0))
    quant = cfg.get("quantization_config") or {}
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    return ModelArch(
        model_type=str(cfg.get("model_type", "unknown")),
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(_first(cfg, "intermediate_size", default=4 * hidden)),
        vocab_size=vocab,
        max_position_embeddings=int(_first(cfg, "max_position_embeddings", "max_sequence_length", default=2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(_first(cfg, "torch_dtype", "dtype", default="bfloat16")),
        checkpoint_quant=(str(quant.get("quant_method")).lower() if quant.get("quant_method") else None),
        num_routed_experts=routed,
        num_shared_experts=int(_first(cfg, "n_shared_experts", default=0)),
        moe_intermediate_size=int(_first(cfg, "moe_intermediate_size", default=cfg.get("intermediate_size", 0))),
        shared_expert_intermediate_size=int(_first(cfg, "shared_expert_intermediate_size", default=0)),
        num_experts_per_tok=int(_first(cfg, "num_experts_per_tok", default=0)),
        first_k_dense=int(_first(cfg, "first_k_dense_replace", default=0)),
        moe_layer_freq=int(_first(cfg, "moe_layer_freq", default=1)),
        q_lora_rank=int(_first(cfg, "q_lora_rank", default=0)),
        kv_lora_rank=int(_first(cfg, "kv_lora_rank", default=0)),
        qk_nope_head_dim=int(_first(cfg, "qk_nope_head_dim", default=0)),
        qk_rope_head_dim=int(_first(cfg, "qk_rope_head_dim", default=0)),
        v_head_dim=int(_first(cfg, "v_head_dim", default=0)),
        eos_token_ids=eos_ids,
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
    )


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts. ``quantizable`` are the linear weights inside the transformer layers."""

    embedding: int
    lm_head: int
    per_layer: tuple[int, ...]  # all parameters of each layer
    per_layer_quantizable: tuple[int, ...]
    active_per_layer: tuple[int, ...]  # parameters one token touches (MoE: top-k routed + shared)

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + sum(self.per_layer)

    @property
    def active(self) -> int:
        return self.embedding + self.lm_head + sum(self.active_per_layer)


def _attention_params(a: ModelArch) -> int:
    h = a.hidden_size
    if a.is_mla:
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = (h * a.q_lora_rank + a.q_lora_rank * a.num_attention_heads * qk) if a.q_lora_rank else h * a.num_attention_heads * qk
        kv = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim)
        o = a.num_attention_heads * a.v_head_dim * h
        return q + kv + o
    d = a.head_dim
    return h * a.num_attention_heads * d + 2 * h * a.num_kv_heads * d + a.num_attention_heads * d * h


def param_counts(a: ModelArch) -> ParamCounts:
    """Count parameters per layer (norms and biases are left out: well under 0.1% for these models)."""
    h = a.hidden_size
    attn = _attention_params(a)
    per_layer, quantizable, active = [], [], []
    for i in range(a.num_layers):
        if a.is_moe_layer(i):
            expert = 3 * h * a.moe_intermediate_size
            shared = a.num_shared_experts * expert + (3 * h * a.shared_expert_intermediate_size)
            router = h * a.num_routed_experts
            mlp_q = a.num_routed_experts * expert + shared
            per_layer.append(attn + mlp_q + router)
            quantizable.append(attn + mlp_q)
            active.append(attn + a.num_experts_per_tok * expert + shared + router)
        else:
            mlp = 3 * h * a.intermediate_size
            per_layer.append(attn + mlp)
            quantizable.append(attn + mlp)
            active.append(attn + mlp)
    emb = a.vocab_size * h
    return ParamCounts(emb, 0 if a.tie_word_embeddings else emb, tuple(per_layer), tuple(quantizable), tuple(active))
