"""A tiny random Llama (hidden 64, 2 layers, vocab 512, bf16) for CPU tests.

Generated locally and deterministically (fixed seed, locally trained byte-level
BPE tokenizer with a chat template); never touches the hub. `ensure_tiny_model`
is idempotent: a complete directory (marker file written last) is reused.

`ensure_tiny_model(out, seed=1)` is a second checkpoint of the same shapes and
tokenizer with other weights (RL weight-update tests swap the two).

`ensure_tiny_model(out, wide_kv=True)`: the same tokenizer, 4 layers of 8 KV heads of head_dim 256 (32 KiB of
KV a token, 4096 positions), for tests and benchmarks that move large KV between hosts.

`ensure_tiny_model(out, hybrid_swa=True)`: the same tokenizer, a hybrid sliding-window model (upstream's Mellum: one
sliding-window layer, one full-attention layer, float32) of the same width. Served with a sliding-window memory pool,
so in PD prefill sends an extra-state (SWA) chunk besides the KV: the state-chunk paths run end to end on CPU. Its
window (SWA_WINDOW) is longer than any test sequence.

CLI: python -m testing.tiny_model OUT_DIR [SEED]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Bump when the generated content changes; a directory with another version is rebuilt.
VERSION = 1
MARKER = ".tiny-model-complete"
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
_REQUIRED = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _corpus() -> list[str]:
    words = (
        "the quick brown fox jumps over the lazy dog hello world what is the capital "
        "of france paris london berlin rome madrid tokyo river mountain ocean forest "
        "one two three four five six seven eight nine ten eleven twelve hundred "
        "thousand red green blue yellow black white server client request response "
        "prefill decode cache memory transfer token model layer attention batch "
        "queue python rust engine kernel router balance health metric latency"
    ).split()
    lines = []
    for i, w in enumerate(words):
        lines.append(" ".join(words[i:] + words[:i]))
        lines.append(f"{w} {i} {i * 7 % 101} {w.capitalize()}, {w.upper()}.")
    return lines * 20


WIDE_KV = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 256,
           "max_position_embeddings": 4096}
SWA_WINDOW = 8192
WIDE_KV_BYTES_PER_TOKEN = 4 * 2 * 8 * 256 * 2  # layers x (K, V) x heads x head_dim x bf16


def is_complete(out_dir: Path, seed: int = 0, wide_kv: bool = False, hybrid_swa: bool = False) -> bool:
    marker = out_dir / MARKER
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except ValueError:
        return False
    if (meta.get("version") != VERSION or meta.get("seed", 0) != seed or meta.get("wide_kv", False) != wide_kv
            or meta.get("hybrid_swa", False) != hybrid_swa):
        return False
    return all((out_dir / name).is_file() for name in _REQUIRED)


def _generate(tmp: Path, seed: int = 0, wide_kv: bool = False, hybrid_swa: bool = False) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
    )
    fast.chat_template = CHAT_TEMPLATE
    if len(fast) != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {len(fast)} tokens, expected {VOCAB_SIZE}")
    fast.save_pretrained(tmp)

    if hybrid_swa:
        _save_hybrid_swa(tmp, seed)
    else:
        _save_llama(tmp, seed, wide_kv)
    meta = {"version": VERSION} if seed == 0 else {"version": VERSION, "seed": seed}
    if wide_kv:
        meta["wide_kv"] = True
    if hybrid_swa:
        meta["hybrid_swa"] = True
    (tmp / MARKER).write_text(json.dumps(meta))


def _save_llama(tmp: Path, seed: int, wide_kv: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 1024, **(WIDE_KV if wide_kv else {})}
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **shape,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)


def _save_hybrid_swa(tmp: Path, seed: int) -> None:
    import torch
    from transformers import MellumConfig, MellumForCausalLM

    layers = ["sliding_attention", "full_attention"]
    cfg = MellumConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layers),
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=layers,
                       mlp_layer_types=["dense"] * len(layers), sliding_window=SWA_WINDOW,
                       num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,  # unused (dense), required
                       max_position_embeddings=4096, rms_norm_eps=1e-6, attention_bias=False,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    MellumForCausalLM(cfg).to(torch.float32).save_pretrained(tmp, safe_serialization=True)


def ensure_tiny_model(out_dir: str | os.PathLike, seed: int = 0, wide_kv: bool = False,
                      hybrid_swa: bool = False) -> Path:
    """Create the tiny model in out_dir unless a complete one is already there. Another
    `seed` gives other weights of the same shapes (and the same tokenizer); `wide_kv` the wide-KV variant;
    `hybrid_swa` the hybrid sliding-window variant."""
    out = Path(out_dir).resolve()
    if is_complete(out, seed, wide_kv, hybrid_swa):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        _generate(tmp, seed, wide_kv, hybrid_swa)
        if out.exists():
            shutil.rmtree(out)
        try:
            tmp.rename(out)
        except OSError:
            # Another process finished first; keep theirs if it is complete.
            if not is_complete(out, seed, wide_kv, hybrid_swa):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m testing.tiny_model OUT_DIR [SEED]", file=sys.stderr)
        return 2
    print(ensure_tiny_model(argv[0], int(argv[1]) if len(argv) == 2 else 0))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
