"""Small GGUF files written here with gguf-py: a Gemma 3 text model with random weights in a chosen tensor type,
and a tokenizer (SentencePiece-style: control tokens, byte fallback, a few pieces), the layout llama.cpp writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS = 64, 2, 32, 256, 3
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["▁", "▁the", "▁a", "▁def", "▁return", "(", ")", ":", "n", "e", "t", "h", "a", "d", "f", "r", "u"]


def tokens() -> tuple[list[str], list[float], list[int]]:
    words = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = ([TokenType.CONTROL] * 3 + [TokenType.UNKNOWN] + [TokenType.CONTROL] * 2 + [TokenType.BYTE] * 256
             + [TokenType.NORMAL] * len(PIECES))
    scores = [0.0] * (len(SPECIALS) + 256) + [-float(i) for i in range(len(PIECES))]
    return words, scores, [int(t) for t in types]


def write_gemma(path: Path, tensor_type: str = "Q8_0", arch: str = "gemma3", seed: int = 0,
                odd_type: str | None = None) -> Path:
    """A 3-layer Gemma 3 (64 wide) whose matrices are stored as `tensor_type` (norms stay F32); `odd_type`:
    layer 0's ffn_down stored as that type instead, with random blocks (gguf-py cannot quantize to every type)."""
    words, scores, types = tokens()
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny gemma")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(1)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(16)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(words)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    def matrix(name: str, rows: int, cols: int) -> None:
        x = rng.normal(0.0, 0.2, (rows, cols)).astype(np.float32)
        qtype = getattr(GGMLQuantizationType, tensor_type)
        if odd_type is not None and name == "blk.0.ffn_down.weight":
            odd = getattr(GGMLQuantizationType, odd_type)
            block, size = GGML_QUANT_SIZES[odd]
            w.add_tensor(name, rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8), raw_dtype=odd)
            return
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)

    def norm(name: str, size: int) -> None:
        w.add_tensor(name, (1.0 + rng.normal(0.0, 0.2, size)).astype(np.float32))  # llama.cpp stores 1 + w

    matrix("token_embd.weight", len(words), HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}"
        norm(f"{b}.attn_norm.weight", HIDDEN)
        matrix(f"{b}.attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        matrix(f"{b}.attn_k.weight", HEAD_DIM, HIDDEN)
        matrix(f"{b}.attn_v.weight", HEAD_DIM, HIDDEN)
        norm(f"{b}.attn_q_norm.weight", HEAD_DIM)
        norm(f"{b}.attn_k_norm.weight", HEAD_DIM)
        matrix(f"{b}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        norm(f"{b}.post_attention_norm.weight", HIDDEN)
        norm(f"{b}.ffn_norm.weight", HIDDEN)
        matrix(f"{b}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"{b}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"{b}.ffn_down.weight", HIDDEN, FFN)
        norm(f"{b}.post_ffw_norm.weight", HIDDEN)
    norm("output_norm.weight", HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
