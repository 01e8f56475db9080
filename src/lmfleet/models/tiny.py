"""A tiny random-weight Llama (with a locally trained byte-level BPE tokenizer) for fast tests.

head_dim is 64 because vLLM's CPU attention rejects 16. Text it generates is noise.
"""

from __future__ import annotations

from pathlib import Path

from lmfleet.models._atomic import building, is_complete

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "Large language models are served by engines such as vLLM on Ray clusters.",
    "Xin chào thế giới. 你好，世界。 Hello world! 🙂 ",
    "def add(a, b):\n    return a + b\n",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \"",
] * 50


def build_tiny_model(out: Path, *, hidden: int = 256, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     vocab: int = 2048, max_positions: int = 4096, seed: int = 0) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(_CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = max_positions
    tok.save_pretrained(out)

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=max_positions, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=True, torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(out)


def ensure_tiny_model(dest: Path, progress=print) -> Path:
    if is_complete(dest):
        return dest
    with building(dest) as tmp:
        if tmp is not None:
            progress(f"lmfleet: building the tiny random-weight test model into {dest}...")
            build_tiny_model(tmp)
    return dest
