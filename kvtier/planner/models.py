"""Model geometry: KV bytes per token and prefill FLOPs, from presets or an HF ``config.json``.

Everything the planner and the simulator know about a model is derived here from the
handful of fields a Hugging Face ``config.json`` carries, so that a preset and a local
config go through the same arithmetic. Two attention kinds matter for the KV size:

- **GQA / MHA** (Llama, Qwen, Mistral): every layer keeps a K and a V vector per KV
  head, ``2 * layers * kv_heads * head_dim * itemsize`` bytes per token.
- **MLA** (DeepSeek-V2/V3): every layer keeps one compressed latent of
  ``kv_lora_rank`` plus the decoupled RoPE key of ``qk_rope_head_dim``, shared by all
  heads, ``layers * (kv_lora_rank + qk_rope_head_dim) * itemsize`` bytes per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import numpy as np

from kvtier.core.layout import DTYPE_ITEMSIZE, KVLayout
from kvtier.errors import ConfigError
from kvtier.json_files import read_json_object

#: Presets as the subset of HF ``config.json`` fields the arithmetic reads; the
#: numbers are those of the published configs. ``tests/planner`` checks the derived
#: parameter counts against the published model sizes.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    "llama-3-70b": dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                        num_key_value_heads=8, intermediate_size=28672, vocab_size=128256),
    "llama-3-405b": dict(num_hidden_layers=126, hidden_size=16384, num_attention_heads=128,
                         num_key_value_heads=8, intermediate_size=53248, vocab_size=128256),
    "qwen2.5-7b": dict(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064),
    "qwen2.5-72b": dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                        num_key_value_heads=8, intermediate_size=29568, vocab_size=152064),
    "mistral-7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=32768),
    "deepseek-v3": dict(num_hidden_layers=61, hidden_size=7168, num_attention_heads=128,
                        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, intermediate_size=18432,
                        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                        n_shared_experts=1, first_k_dense_replace=3, vocab_size=129280),
    "deepseek-v2-lite": dict(num_hidden_layers=27, hidden_size=2048, num_attention_heads=16,
                             kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                             qk_nope_head_dim=128, v_head_dim=128, intermediate_size=10944,
                             moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6,
                             n_shared_experts=2, first_k_dense_replace=1, vocab_size=102400),
}
# Common aliases, so that ``llama-3.1-70b`` and ``llama-3-70b`` name the same geometry.
ALIASES = {
    "llama-3.1-8b": "llama-3-8b", "llama-3.1-70b": "llama-3-70b", "llama-3.3-70b": "llama-3-70b",
    "llama-3.1-405b": "llama-3-405b", "deepseek-r1": "deepseek-v3",
}

_TORCH_DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
                      "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn", "int8": "int8"}


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """What the planner needs of a model: KV size per token and prefill FLOPs.

    ``matmul_params`` are the active parameters a token passes through in the layers
    (embeddings and the LM head excluded: prefill runs the head on the last token
    only), so the dense work of a prefill is ``2 * matmul_params`` FLOPs a token.
    ``attn_flops_per_pair`` is the work of one (query, key) pair summed over layers and
    heads, ``layers * 2 * heads * (qk_dim + v_dim)``: one QK dot product and one
    weighted V sum per head.

    ``total_params`` are the weights one token's step reads: ``matmul_params`` and the
    embeddings. A mixture-of-experts model also keeps the ``experts`` it routes among in each
    of its ``moe_layers`` (``expert_params`` each, ``experts_per_token`` of them in
    ``total_params``): a decode batch reads more of them than one token does
    (:meth:`weights_read`).
    """

    name: str
    num_layers: int
    kv_layout: KVLayout
    matmul_params: float
    total_params: float
    attn_flops_per_pair: float
    is_mla: bool = False
    moe_layers: int = 0
    experts: int = 0
    experts_per_token: int = 0
    expert_params: float = 0.0

    def __post_init__(self) -> None:
        if self.matmul_params <= 0 or self.attn_flops_per_pair <= 0:
            raise ConfigError(f"model {self.name!r}: parameter and attention sizes must be positive")
        if self.moe_layers and not 0 < self.experts_per_token <= self.experts:
            raise ConfigError(f"model {self.name!r}: {self.experts_per_token} experts per token out of "
                              f"{self.experts}; num_experts_per_tok is at least 1 and at most the experts")

    @property
    def dense_params(self) -> float:
        """The weights every step reads whatever its batch: all but the routed experts."""
        return self.total_params - self.moe_layers * self.experts_per_token * self.expert_params

    def weights_read(self, batch: int) -> float:
        """Parameters a decode step of ``batch`` sequences reads: the dense weights, and in each
        MoE layer every expert at least one sequence is routed to. With routing taken as uniform,
        an expert is missed by all ``batch`` sequences with probability ``(1 - k/E)^batch``: a
        batch of 64 touches all 8 of a Mixtral's experts and 87 % of a DeepSeek-V3's 256, where
        the active parameters alone read 2 and 8 (audit s34 a5 D6)."""
        if not self.moe_layers:
            return self.total_params
        touched = self.experts * (1.0 - (1.0 - self.experts_per_token / self.experts) ** batch)
        return self.dense_params + self.moe_layers * touched * self.expert_params

    @property
    def bytes_per_token(self) -> int:
        return self.kv_layout.bytes_per_token

    def block_bytes(self, block_tokens: int) -> int:
        return self.bytes_per_token * block_tokens

    def linear_flops(self, tokens: float) -> float:
        return 2.0 * self.matmul_params * _floats(tokens)

    def attention_flops(self, tokens: float, cached_tokens: float = 0.0) -> float:
        """Causal attention work for ``tokens - cached_tokens`` new queries.

        Query ``i`` attends to ``i`` keys, so the new queries ``cached+1 .. tokens``
        form ``(tokens² - cached²) / 2`` pairs: the quadratic term of a prefill. As
        ``(tokens - cached) * (tokens + cached)``: past a float it is ``inf``, never ``inf - inf``.
        """
        tokens, cached_tokens = _floats(tokens), _floats(cached_tokens)
        return self.attn_flops_per_pair * (tokens - cached_tokens) * (tokens + cached_tokens) / 2.0

    def kv_formula(self) -> str:
        lay = self.kv_layout
        if self.is_mla:
            return (f"{self.num_layers} layers x (kv_lora_rank + qk_rope_head_dim = {lay.head_dim})"
                    f" x {lay.itemsize} B ({lay.dtype}) = {self.bytes_per_token:,} B/token (MLA latent)")
        return (f"2 (K,V) x {self.num_layers} layers x {lay.num_kv_heads} kv heads x {lay.head_dim} head_dim"
                f" x {lay.itemsize} B ({lay.dtype}) = {self.bytes_per_token:,} B/token")


def _floats(tokens):
    """Token counts as floats (arrays stay arrays): an int's square past a float raised
    OverflowError when mixed with a float, and ended ``kvtier plan live`` (audit s30 a7 D1);
    a float's square is ``inf``, which the sizing bounds."""
    return tokens.astype(float) if isinstance(tokens, np.ndarray) else float(tokens)


def _need(config: Mapping[str, Any], field: str, source: str) -> Any:
    if config.get(field) is None:
        raise ConfigError(f"{source}: config has no {field!r}; pass a Llama/Qwen/Mistral/DeepSeek config.json")
    return config[field]


def geometry_from_hf_config(config: Mapping[str, Any], name: str = "custom",
                            kv_dtype: str | None = None) -> ModelGeometry:
    """Build a :class:`ModelGeometry` from the fields of an HF ``config.json``.

    ``kv_dtype`` overrides the dtype the KV is stored in (default: the config's
    ``torch_dtype``/``dtype``, else bfloat16).
    """
    layers = int(_need(config, "num_hidden_layers", name))
    hidden = int(_need(config, "hidden_size", name))
    heads = int(_need(config, "num_attention_heads", name))
    vocab = int(config.get("vocab_size") or 0)
    dtype = kv_dtype or _TORCH_DTYPE_NAMES.get(str(config.get("torch_dtype") or config.get("dtype") or ""), "bfloat16")
    if dtype not in DTYPE_ITEMSIZE:
        raise ConfigError(f"{name}: KV dtype {dtype!r} unknown; use one of {sorted(DTYPE_ITEMSIZE)}")
    is_mla = config.get("kv_lora_rank") is not None
    if is_mla:
        kv_rank = int(config["kv_lora_rank"])
        rope = int(_need(config, "qk_rope_head_dim", name))
        nope = int(_need(config, "qk_nope_head_dim", name))
        v_dim = int(_need(config, "v_head_dim", name))
        qk_dim = nope + rope
        q_rank = config.get("q_lora_rank")
        q_params = hidden * q_rank + q_rank * heads * qk_dim if q_rank else hidden * heads * qk_dim
        attn_params = (q_params + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim)
                       + heads * v_dim * hidden)
        # One latent per token and layer, shared by all heads: kv_parts=1, one "head".
        layout = KVLayout(num_layers=layers, num_kv_heads=1, head_dim=kv_rank + rope, dtype=dtype,
                          block_tokens=1, kv_parts=1)
    else:
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        qk_dim = v_dim = head_dim
        attn_params = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        layout = KVLayout(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                          block_tokens=1, kv_parts=2)
    mlp = _mlps(config, hidden, layers, name)
    matmul = layers * attn_params + mlp.active_params
    tied = bool(config.get("tie_word_embeddings", False))
    total = matmul + vocab * hidden * (1 if tied else 2)
    return ModelGeometry(
        name=name, num_layers=layers, kv_layout=layout, matmul_params=float(matmul),
        total_params=float(total), attn_flops_per_pair=float(layers * 2 * heads * (qk_dim + v_dim)),
        is_mla=is_mla, moe_layers=mlp.moe_layers, experts=mlp.experts, experts_per_token=mlp.experts_per_token,
        expert_params=float(mlp.expert_params),
    )


class _MLPs(NamedTuple):
    """The MLPs of all layers: what a token passes through, and the routed experts of a MoE."""

    active_params: int          # a token's: dense layers, shared experts, its routed experts, gates
    moe_layers: int = 0
    experts: int = 0            # routed experts per MoE layer
    experts_per_token: int = 0
    expert_params: int = 0      # one routed expert (gate, up, down)


def _mlps(config: Mapping[str, Any], hidden: int, layers: int, name: str) -> _MLPs:
    """The MLPs of all layers (SwiGLU: gate, up, down).

    Mixture-of-experts configs name their experts four ways; each counts the experts a token
    is routed to, the shared experts every token passes, and the router's gate:

    - DeepSeek: ``n_routed_experts``, ``n_shared_experts`` of ``moe_intermediate_size``, the
      first ``first_k_dense_replace`` layers dense;
    - Mixtral and gpt-oss: ``num_local_experts``, each of ``intermediate_size``;
    - Llama 4 (``llama4_text``, or ``intermediate_size_mlp`` given): ``num_local_experts`` and one
      shared expert, each of ``intermediate_size``, in the ``moe_layers`` (else every
      ``interleave_moe_layer_step``-th layer); the other layers dense at ``intermediate_size_mlp``;
    - Qwen2/Qwen3-MoE: ``num_experts`` of ``moe_intermediate_size``, a shared expert of
      ``shared_expert_intermediate_size`` (Qwen2-MoE), every ``decoder_sparse_step``-th layer
      sparse except ``mlp_only_layers``.

    A MoE config read as dense (one expert's width) undercounts a Mixtral's prefill work 1.8x
    and a Qwen2-57B-A14B's 2.0x, and the planner then sizes its workers for that; a Llama 4
    read as a Mixtral, 1.67x (audit s34 a5 D5).
    """
    routed = config.get("n_routed_experts") or config.get("num_local_experts") or config.get("num_experts")
    if not routed:
        return _MLPs(layers * 3 * hidden * int(_need(config, "intermediate_size", name)))
    active = config.get("num_experts_per_tok") or config.get("experts_per_token")
    if not active:
        raise ConfigError(f"{name}: a mixture-of-experts config ({routed} experts) without num_experts_per_tok")
    width, shared, dense_width_field = _expert_widths(config, name)
    sparse = _sparse_layers(config, layers)
    moe_layers, dense_layers = sum(sparse), layers - sum(sparse)
    sparse_mlp = 3 * hidden * (int(active) * width + shared) + hidden * int(routed)   # + the router's gate
    dense_mlp = 3 * hidden * int(_need(config, dense_width_field, name)) if dense_layers else 0
    return _MLPs(moe_layers * sparse_mlp + dense_layers * dense_mlp, moe_layers, int(routed), int(active),
                 3 * hidden * width)


def _is_llama4(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") == "llama4_text" or config.get("intermediate_size_mlp") is not None


def _expert_widths(config: Mapping[str, Any], name: str) -> tuple[int, int, str]:
    """(a routed expert's width, the shared experts' width in all, the field of a dense layer's width)."""
    if _is_llama4(config):      # one shared expert as wide as a routed one
        width = int(_need(config, "intermediate_size", name))
        return width, width, "intermediate_size_mlp"
    if config.get("num_local_experts") and not config.get("n_routed_experts"):
        width = int(_need(config, "intermediate_size", name))       # Mixtral, gpt-oss: per expert
    else:
        width = int(_need(config, "moe_intermediate_size", name))
    shared = int(config.get("n_shared_experts") or 0) * width + int(config.get("shared_expert_intermediate_size") or 0)
    return width, shared, "intermediate_size"


def _sparse_layers(config: Mapping[str, Any], layers: int) -> list[bool]:
    """Which layers route among experts (the others are dense)."""
    if config.get("first_k_dense_replace"):
        return [i >= int(config["first_k_dense_replace"]) for i in range(layers)]
    if config.get("moe_layers") is not None:        # Llama 4 may list them
        listed = {int(i) for i in config["moe_layers"]}
        return [i in listed for i in range(layers)]
    step = int(config.get("decoder_sparse_step") or config.get("interleave_moe_layer_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or ())
    return [(i + 1) % step == 0 and i not in dense_only for i in range(layers)]


def load_model(name_or_path: str, kv_dtype: str | None = None) -> ModelGeometry:
    """A preset by name (``llama-3-70b``) or a local HF ``config.json`` (file or its folder)."""
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in PRESETS:
        return geometry_from_hf_config(PRESETS[key], name=key, kv_dtype=kv_dtype)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model {name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
            "nor a local config.json"
        )
    config = read_json_object(path, "model config")
    # Multimodal wrappers keep the language model's fields under text_config.
    config = config.get("text_config", config)
    try:
        return geometry_from_hf_config(config, name=path.parent.name or "custom", kv_dtype=kv_dtype)
    except ConfigError:
        raise
    # a field of the wrong type, 0, or past a float (1e999 parses as inf: int(inf) overflows)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError, OverflowError) as exc:
        raise ConfigError(f"model config {path}: a field is not what a Hugging Face config.json holds "
                          f"({exc})") from None
