#!/usr/bin/env python3
"""Writes a Llama-architecture GGUF model with random weights, for llama-server in tests.

No model hub is reachable here, and a test needs real compute and real scheduling, not
text. The tokenizer comes from a vocabulary GGUF (llama.cpp's own ggml-vocab-llama-spm).

The model never picks a token that is not a normal one (control tokens, raw bytes that
would make invalid UTF-8 and a 500 from the server, the end of text): one hidden dimension
is the same positive number for every token (its embedding column is constant and no layer
writes to it), so after the final norm it is always positive, and those tokens' output
rows weigh it by a large negative number. So every answer is exactly `max_tokens` long.
"""

import argparse

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType  # noqa: F401  (the package's API)


def vocabulary(path):
    reader = GGUFReader(path)

    def values(name):
        field = reader.fields[name]
        return [field.parts[index] for index in field.data]

    tokens = [bytes(part).decode("utf-8") for part in values("tokenizer.ggml.tokens")]
    scores = [float(part[0]) for part in values("tokenizer.ggml.scores")]
    types = [int(part[0]) for part in values("tokenizer.ggml.token_type")]

    def scalar(name, default):
        field = reader.fields.get(name)
        return int(field.parts[field.data[0]][0]) if field is not None else default

    ids = {
        "bos": scalar("tokenizer.ggml.bos_token_id", 1),
        "eos": scalar("tokenizer.ggml.eos_token_id", 2),
        "unk": scalar("tokenizer.ggml.unknown_token_id", 0),
    }
    return tokens, scores, types, ids


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--f16", action="store_true", help="matrices in F16 (norms stay F32)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    tokens, scores, types, ids = vocabulary(args.vocab)
    n_vocab, width, ffn = len(tokens), args.width, args.ffn
    rng = np.random.default_rng(args.seed)
    matrix_type = np.float16 if args.f16 else np.float32

    def matrix(rows, cols, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(cols)
        return rng.normal(0.0, scale, size=(rows, cols)).astype(np.float32)

    writer = GGUFWriter(args.out, "llama")
    writer.add_name("nightshift-test-random")
    writer.add_context_length(args.context)
    writer.add_embedding_length(width)
    writer.add_block_count(args.layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.heads)
    writer.add_rope_dimension_count(width // args.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(1 if args.f16 else 0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(ids["bos"])
    writer.add_eos_token_id(ids["eos"])
    writer.add_unk_token_id(ids["unk"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    # Dimension 0 of the residual stream: the same for every token, written by no layer.
    embeddings = matrix(n_vocab, width, 1.0)
    embeddings[:, 0] = 4.0
    writer.add_tensor("token_embd.weight", embeddings.astype(matrix_type))
    for layer in range(args.layers):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(width, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v"):
            writer.add_tensor(f"{prefix}.{name}.weight", matrix(width, width).astype(matrix_type))
        attn_output = matrix(width, width)
        attn_output[0, :] = 0.0
        writer.add_tensor(f"{prefix}.attn_output.weight", attn_output.astype(matrix_type))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", np.ones(width, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", matrix(ffn, width).astype(matrix_type))
        writer.add_tensor(f"{prefix}.ffn_up.weight", matrix(ffn, width).astype(matrix_type))
        ffn_down = matrix(width, ffn)
        ffn_down[0, :] = 0.0
        writer.add_tensor(f"{prefix}.ffn_down.weight", ffn_down.astype(matrix_type))
    writer.add_tensor("output_norm.weight", np.ones(width, dtype=np.float32))
    # Only normal tokens (type 1) may be picked; the end of text neither.
    output = matrix(n_vocab, width, 1.0)
    output[:, 0] = 0.0
    barred = [index for index, kind in enumerate(types) if kind != 1] + [ids["eos"]]
    output[barred, 0] = -1000.0
    writer.add_tensor("output.weight", output.astype(matrix_type))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.out}: {n_vocab} tokens, width {width}, {args.layers} layers, {len(barred)} tokens barred")


if __name__ == "__main__":
    main()
