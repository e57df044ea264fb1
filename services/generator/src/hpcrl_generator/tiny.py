"""A tiny Qwen2-architecture model with a chat template, built locally (no download).

For tests, benchmarks and smoke runs of the generator on machines without a real policy: the
same architecture family as Qwen2.5-Coder, so both backends run the same code paths.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "void matmul_optimized(double *A, double *B, double *C, int M, int N, int K) {",
    "  for (int i = 0; i < M; i++)",
    "    for (int j = 0; j < N; j++) {",
    "      double sum = 0.0;",
    "      for (int k = 0; k < K; k++) sum += A[i * K + k] * B[k * N + j];",
    "      C[i * N + j] = sum;",
    "    }",
    "}",
    "#include <immintrin.h>",
    "#pragma omp parallel for",
    "__m512d a = _mm512_loadu_pd(&A[i * K + k]);",
    "Write a faster matrix multiplication kernel in C. Use register blocking.",
    "You are an expert HPC programmer. Improve the program below.",
]


def build_tokenizer(vocab_size: int = 384):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    out: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised tiny Qwen2 model plus its tokenizer to ``out``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # A random init is nearly uniform; a larger scale makes greedy outputs sensitive to the
    # weights, so tests can tell one version from another.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def perturbed_copy(src: str | Path, out: str | Path, *, scale: float = 0.2, seed: int = 1) -> Path:
    """Save ``src`` with Gaussian noise added to every matrix: a stand-in for a learner step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.add_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out
