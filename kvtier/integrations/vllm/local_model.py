"""A random-weight Llama and a locally trained tokenizer, for tests and benchmarks.

Nothing comes from a hub: the tokenizer is a byte-level BPE trained on a
generated corpus, the model is ``LlamaConfig`` + ``save_pretrained`` with seeded
random weights. Its output is gibberish but deterministic under greedy decoding,
which is what cache-correctness checks need. A built model is kept under
``$KVTIER_MODEL_CACHE`` (default: ``<tmp>/kvtier-models``) in a directory named
after its configuration, published by an atomic rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

#: small enough for tests (~0.3 M parameters, engine start ~3 s)
TINY = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}

#: the demo-sized model of the benchmarks (~92 M parameters at vocab 8 k)
DEMO = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "intermediate_size": 2816,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
}

PRESETS = {"tiny": TINY, "demo": DEMO}
VOCAB_SIZE = 2048
_FORMAT = 1  # bump when the way a model is built changes


def cache_root() -> Path:
    return Path(os.environ.get("KVTIER_MODEL_CACHE") or Path(tempfile.gettempdir()) / "kvtier-models")


def ensure_model(preset: str | dict = "tiny", *, seed: int = 0) -> Path:
    """The directory of a built model (building it on first use)."""
    config = dict(PRESETS[preset]) if isinstance(preset, str) else dict(preset)
    digest = hashlib.sha256(json.dumps([_FORMAT, seed, VOCAB_SIZE, config], sort_keys=True).encode()).hexdigest()
    name = preset if isinstance(preset, str) else "custom"
    target = cache_root() / f"llama-{name}-{digest[:12]}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _build(work, config, seed)
        try:
            os.rename(work, target)
        except OSError:  # another process published it first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English: words built from syllables."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(3000)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(6, 20))) + "." for _ in range(lines)]


def _build(path: Path, config: dict, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)

    dtype = config.pop("torch_dtype", "float32")
    llama = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=False,
        **config,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
