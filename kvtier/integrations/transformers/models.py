"""Random-weight Llama (and DeepSeek-V2) models and a locally trained tokenizer, built once and cached.

Nothing comes from a model hub. The tokenizer is a byte-level BPE trained on
text that is on every machine with Python: the standard library's sources
(code, docstrings, comments — close to what an agent's tool outputs hold). The
model is ``LlamaConfig`` + ``LlamaForCausalLM`` with seeded random weights,
saved as safetensors. Outputs are gibberish but deterministic under greedy
decoding, which is what load-vs-recompute checks need.

:func:`random_lora_adapter` builds a LoRA adapter for such a model the same way (random
weights, PEFT's file layout), for loading into vLLM at run time.

A model lives under ``$XDG_CACHE_HOME/kvtier/models`` (``~/.cache/...``) in a
directory named after its spec, published by an atomic rename so that two
processes building it at once both end with one complete copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

#: bump when the way a model or tokenizer is built changes
BUILD_FORMAT = 2

#: one token each, as in real chat templates (a role marker spelled out in
#: characters would cost ~8 tokens of every message)
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Geometry of a random-weight Llama (and the size of its tokenizer), or with
    ``latent_rank`` a DeepSeek-V2 of the same size whose attention caches a latent per token."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int = 8192
    max_position_embeddings: int = 16384
    dtype: str = "float32"
    seed: int = 0
    #: kv_lora_rank of multi-head latent attention (DeepSeek-V2/V3, Kimi); 0: a Llama
    latent_rank: int = 0

    def digest(self) -> str:
        fields = asdict(self)
        if not self.latent_rank:
            del fields["latent_rank"]   # the Llamas built before the field keep their directories
        text = json.dumps([BUILD_FORMAT, fields], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def name(self) -> str:
        kind = "deepseek" if self.latent_rank else "llama"
        return f"{kind}-h{self.hidden_size}-l{self.num_hidden_layers}-{self.dtype}-{self.digest()}"

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes a token: K and V of every KV head, or one latent row (rank + RoPE key)."""
        itemsize = 2 if self.dtype in ("bfloat16", "float16") else 4
        if self.latent_rank:
            return self.num_hidden_layers * (self.latent_rank + LATENT_ROPE_DIM) * itemsize
        head_dim = self.hidden_size // self.num_attention_heads
        return self.num_hidden_layers * 2 * self.num_key_value_heads * head_dim * itemsize


#: the decoupled RoPE key of a latent-attention model (DeepSeek-V2/V3's qk_rope_head_dim): with a
#: rank of 512, the 576-wide row that vLLM's CPU latent kernel takes
LATENT_ROPE_DIM = 64


def latent_config(spec: ModelSpec) -> dict:
    """``DeepseekV2Config`` settings of a latent-attention ``spec``: every MLP dense (the experts
    do not change the KV cache), no query compression."""
    head_dim = spec.hidden_size // spec.num_attention_heads
    return dict(kv_lora_rank=spec.latent_rank, q_lora_rank=None, qk_rope_head_dim=LATENT_ROPE_DIM,
                qk_nope_head_dim=head_dim, v_head_dim=head_dim, head_dim=head_dim + LATENT_ROPE_DIM,
                first_k_dense_replace=spec.num_hidden_layers, n_routed_experts=4, n_shared_experts=1,
                moe_intermediate_size=128, num_experts_per_tok=2)


#: the demo model: ~107 M parameters; prefill of 2 k tokens costs seconds on 2 CPU cores
DEMO_SPEC = ModelSpec(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=4, intermediate_size=2816)
#: for tests: builds in about a second
TINY_SPEC = ModelSpec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                      max_position_embeddings=4096)
#: the vLLM tests' and probes' model: head_dim 32, the smallest vLLM's CPU attention takes
VLLM_TEST_SPEC = ModelSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=256, vocab_size=2048, max_position_embeddings=2048)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kvtier`` (default ``~/.cache/kvtier``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier"


def ensure_model(spec: ModelSpec = DEMO_SPEC, root: str | os.PathLike | None = None) -> tuple[Path, bool]:
    """The directory of the model of ``spec``, building it on first use; and whether it was built now."""
    root = Path(root) if root is not None else cache_dir() / "models"
    target = root / spec.name
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target, False
    root.mkdir(parents=True, exist_ok=True)
    remove_dead_builds(root, spec)
    # the builder's pid and host in the name: a build killed before its ``finally`` (SIGKILL, or
    # SIGTERM in a process that does not turn it into SystemExit) is found and removed by the next
    # one of this host; another host's (a cache directory shared by hosts or containers) is left be
    from kvtier.child_process import owner_tag

    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}-{owner_tag()}-", dir=root))
    try:
        build_model(spec, work)
        try:
            os.rename(work, target)
        except OSError:  # another process published it first: keep theirs
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target, True


def remove_dead_builds(root: str | os.PathLike, spec: ModelSpec | None = None) -> list[Path]:
    """Remove the unfinished builds (``.{name}-{pid}-h{host}-XXXX``, or ``.{name}-{pid}-XXXX`` from
    before the host tag) in ``root`` of ``spec`` (of any spec when None) whose builder process, of
    this host, is gone; the directories removed. A build of a live process, another host's
    (:func:`~kvtier.child_process.owner_pid`), and a name without a pid are left alone."""
    from kvtier.child_process import owner_pid, remove_dead_dirs

    head = f".{spec.name}-" if spec is not None else "."

    def builder(name: str) -> int | None:
        stem, dash, _ = name.rpartition("-")   # mkdtemp's suffix has no dash
        return owner_pid(stem) if name.startswith(head) and dash and len(stem) > len(head) else None

    return remove_dead_dirs(root, builder)


def corpus_files(limit_bytes: int) -> list[Path]:
    """Standard-library sources in a stable order, about ``limit_bytes`` of them."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        size = path.stat().st_size
        if size < 2_000:
            continue
        files.append(path)
        total += size
        if total >= limit_bytes:
            break
    return files


def train_tokenizer(vocab_size: int, out_dir: Path):
    """Byte-level BPE on :func:`corpus_files`; saved as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>", *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # ~400 bytes of text per vocabulary entry: enough merges to learn, and a
    # tiny test tokenizer trains in a fraction of a second.
    files = corpus_files(limit_bytes=min(3 << 20, 400 * vocab_size))
    texts = (p.read_text(encoding="utf-8", errors="replace") for p in files)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=CHAT_TOKENS)
    fast.save_pretrained(out_dir)
    return fast


def build_model(spec: ModelSpec, out_dir: Path, *, tokenizer: bool = True, config_class=None, **config_extra) -> None:
    """Save a seeded random-weight model of ``spec`` (and its trained tokenizer) into ``out_dir``.

    ``tokenizer=False`` skips training one (tests that only need token ids);
    ``config_class`` builds another architecture of the same geometry (e.g.
    ``Qwen2Config``), with ``config_extra`` passed to it.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if spec.latent_rank and config_class is None:
        from transformers import DeepseekV2Config

        config_class, config_extra = DeepseekV2Config, {**latent_config(spec), **config_extra}
    tok = train_tokenizer(spec.vocab_size, out_dir) if tokenizer else None
    config = (config_class or LlamaConfig)(
        vocab_size=len(tok) if tok is not None else spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tok.bos_token_id if tok is not None else None,
        eos_token_id=tok.eos_token_id if tok is not None else None,
        tie_word_embeddings=False,
        **config_extra,
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)


def load_model(model_dir: str | os.PathLike, *, attn_implementation: str = "sdpa", tokenizer: bool = True):
    """The model and tokenizer (None with ``tokenizer=False``) saved in ``model_dir``, in eval mode.

    Local files only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype="auto", local_files_only=True, attn_implementation=attn_implementation
    ).eval()
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True) if tokenizer else None
    return model, tok


def random_lora_adapter(model_dir: str, out_dir, rank: int = 8, seed: int = 0) -> str:
    """A LoRA adapter (PEFT's files: ``adapter_config.json``, ``adapter_model.safetensors``) on
    the q and v projections of the Llama in ``model_dir``, with random weights: built here,
    nothing from a hub. Its B matrices are not zero, so its outputs differ from the base model's."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    outs = {"q_proj": heads * head_dim, "v_proj": config.get("num_key_value_heads", heads) * head_dim}
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for name, out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[prefix + ".lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.5
            weights[prefix + ".lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.5
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(outs), "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": str(model_dir)}))
    return str(out_dir)
