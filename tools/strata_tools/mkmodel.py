"""Write synthetic GGUF models of real llama.cpp architectures.

    python3 tools/mkmodel.py ARCH --out FILE [--seed N] [--layers N] [--embd N]
        [--experts N] [--experts-used K] [--expert-ffn N] [--router-skew S]
        [--quant TYPE] [--quant-rest TYPE] [--shape NAME] [--vocab NAME] [--dry-run]
        [--mtp-accept P [--rewrite-mtp-accept]]
        [--lora-rank R [--lora-alpha A] [--lora-targets T,...] [--lora-type f32|f16] [--lora-gain G]
         [--alora-tokens T,...]]

ARCH is one of the presets in PRESETS (qwen3moe, llama, gemma4, gemma3n, qwen35moe-mtp,
qwen4exp, bert, bert-rerank).
A preset is a plain dict of hyperparameters; SHAPES holds named overrides
(--shape) for bigger variants of a preset. Command line options override both.

The tokenizer (every tokenizer.* key) is copied byte for byte from the real
vocabulary $STRATA_LLAMA_SRC/models/ggml-vocab-<vocab>.gguf, optionally with a
chat template from $STRATA_LLAMA_SRC/models/templates/. STRATA_LLAMA_SRC
defaults to <repo>/vendor/llama.cpp; its gguf-py package supplies the GGUF
constants.

Weights
-------
Every tensor gets its own random generator seeded from (--seed, crc32(name)),
so the same arguments always give the same bytes. Weight matrices have a
target standard deviation of 1/sqrt(fan_in) (fan_in = row length); matrices
that write into the residual stream (attention output, FFN/expert down,
ssm_out, per-layer projections) are further scaled by 1/sqrt(2 * n_layer) so
the residual stream stays bounded in deep models. Norm weights are 1.

Quantized tensors are written directly as blocks of random codes whose scales
are chosen so the dequantized values have the target standard deviation:

  q8_0     d = std / 73.5 * U(0.75, 1.25) per block, codes uniform in
           [-127, 127] (random bytes, -128 replaced by 0)
  q4_k     per-32 scales sc uniform in [16, 63], min m = sc and dmin = 8 d, so
           values are d * sc * (q - 8); codes are random nibbles with 0
           replaced by 8: zero-mean and symmetric
  iq3_xxs  any byte is a valid grid index / sign index / 4-bit scale, so the 96
           code bytes are random and d = std / rms(dequantized unit block)

Token embeddings and routers are drawn as floats and quantized with simple
vectorized q8_0 / q4_k quantizers (iq3_xxs is not offered for embeddings and
falls back to q4_k). Other non-expert matrices whose row length is not a
multiple of the requested block size fall back to q8_0, then f16. Routers,
norms and other vectors are f32.

qwen4exp
--------
The pin's qwen4exp architecture (src/models/qwen4exp.cpp, Qwen3.8-Flash-Next):
gated delta net (linear attention) layers with a full-attention layer every
full_attn_interval-th layer, QSA sparse attention on every full-attention
layer (a lightning indexer scoring mean-pooled blocks of compress_ratio keys),
hyper-connections (hc_count residual streams, a low-rank gated mixer before the
token mixer and before the FFN, and a final mixer in place of output_norm, so
there is no layer norm anywhere), a MoE with a gated shared expert, one MTP
block (a QSA layer with its own final mixer) and PLE n-gram hash embeddings on
one linear layer: per_layer_token_embd is a flat (n_embd_per_layer, rows)
table that (ple_ngram_size - 1) * ple_heads_per_ngram hash heads index, head h
owning the row range [offset_h, offset_h + size_h); the sizes are the largest
primes below ple_head_rows and n_embd = n_embd_per_layer * heads. The layer
multipliers of the hash are odd 44/45-bit integers drawn from --seed. The pin
has no qwen4exp vocabulary or chat template, so the preset uses Qwen3.5's
(ggml-vocab-qwen35.gguf, Qwen3.5-4B.jinja); ple.eos_token_id is the
vocabulary's EOS. All hyper-connection and PLE norm gammas are 1 (the
converter folds them to 1 + w) and are stored 1-D (hc_count * n_embd), which
the loader reshapes.

The default is tiny (4 trunk layers: linear, linear + PLE, linear, QSA; then
the MTP block; n_embd 64, 16 experts, a 16336-row f16 PLE table of 0.5 MB;
27 MiB in all, most of it the 152k-token embedding and output matrices). The
80b-a3b shape is an 80B-A3B-class model (48 layers of 2048, 512 experts top-10
of width 512, hc 4, 8 PLE heads of 256 and a 16.8M-row PLE table, 4.56 GB at
q8_0). For a GPU machine with ~40 GB of disk to spare:

    python3 tools/mkmodel.py qwen4exp --shape 80b-a3b --quant iq3_xxs --out qwen4exp-80b.gguf

(35 GiB, a few minutes; the PLE table follows --quant-rest: q8_0 by default,
q4_k halves it). See docs/qwen4exp-model.md.

Router skew
-----------
MoE presets reserve residual channel 0 as a bias channel: every token
embedding has the constant BIAS_CHANNEL_VALUE (c = 2) there, every matrix that
writes into the residual stream has a zero output row 0, and every matrix
that reads the normalized residual (q/k/v, gate/up, shared expert, linear
attention inputs) has a zero input column 0 (for iq3_xxs, which has no zero
code, the smallest code of the grid). Channel 0 of the residual therefore
stays at c (to within the embedding's quantization, < 1 % for q8_0), and
after RMS normalization the router input has

    x_0 ~= X0 = c * sqrt(n_embd / (c**2 + n_embd - 1))

(a few percent lower in deeper layers as the residual grows). For trunk layer
l, expert e gets the popularity rank

    rank_e = router_ranks(seed, l, n_expert)[e]      (a seeded permutation)

and the bias

    b_e = -S * ln(1 + rank_e)                        (S = --router-skew)

Router row e is N(0, 1/n_embd) on channels 1.. and exactly b_e / X0 on
channel 0, so the router logit of expert e is about N(0, 1) + b_e: a
Zipf-like routing prior exp(b_e) = (1 + rank_e) ** -S. In qwen4exp the
hyper-connection mixers would scale channel 0 by a token-dependent gate, so
the gate rows of channel 0 of every stream are zero as well: the gate is
sigmoid(0) = 1/2 there, the router sees x_0 ~= X0 / 2, and row e of its router
has b_e / (X0 / 2) on channel 0. S = 0 is uniform; the
larger S, the more tokens go to the low-rank experts. MTP/NextN layers get no
skew. Measured share of tokens routed to each expert, by rank, for the default
qwen3moe preset (16 experts, top-4; a numpy forward pass over 512 random
tokens, averaged over the 4 layers):

    S = 0  0.23 .. 0.27 for every rank (0.25 = uniform)
    S = 1  .88 .68 .50 .40 .31 .23 .21 .17 .12 .12 .09 .08 .07 .04 .05 .05
    S = 2  .99 .93 .72 .52 .32 .18 .13 .08 .04 .03 .02 .01 .01 .01 .01 .00

MTP acceptance
--------------
With --mtp-accept P (0 <= P <= 1; the presets with an MTP head, qwen4exp and
qwen35moe-mtp) the token embeddings, the lm head and the MTP block's eh_proj
are built, not random, so that greedy decoding walks a fixed cycle of tokens
and the MTP head's top draft is the main model's next token at a fraction of
about P of the positions: a model for benchmarking llama.cpp's
--spec-type draft-mtp at a chosen acceptance. Every other tensor is byte for
byte what the same arguments write without the option, and the file gets one
more key, strata.mtp_accept (FLOAT32, P). With h = (n_embd - 1) // 2, block
X = residual channels 1..h and block Y = channels h+1..2h (channel 0 is the
bias channel, a leftover last channel is 0):

  cycle      V' = n_vocab - n_vocab % 128 and sigma(t) = (t + K) mod V' for
             t < V', where K = 128 k and k, prime to V'/128, is drawn from
             --seed: 128 cycles of V'/128 tokens (1187 for Qwen's 151936)
  per token  x_t ~ N(0, 1)^h, then u_t ~ U(0, 1), from
             np.random.default_rng([seed, 0xACCE, t // 128]) for each block
             of 128 tokens; S = {t : u_t < P} (nested: S grows with P);
             x_t = 0 for t >= V'
  token_embd row t = [c, x_t, x_t if t in S else 0]     (c = BIAS_CHANNEL_VALUE)
  output     row s = [0, g x_{sigma^-1(s)}, 0], g = MTP_OUTPUT_GAIN / sqrt(h)
             = 2 / sqrt(h); zero for s >= V' and for the EOS/EOT/EOM and
             control tokens (tokenizer.ggml.token_type 3), so generation
             never stops (the token before one continues elsewhere)
  eh_proj    output channel 0 <- input 0 (the bias channel of
             enorm(embedding)), X channel j <- input h + j (the Y block of
             enorm(embedding)), weight 1; all else 0, the hnorm(hidden) half
             included (qwen4exp applies it to every hyper-connection stream,
             qwen35moe to its single residual: the same matrix serves both)

Main model: its final hidden state is the normalized embedding plus the
bounded noise of the random layers, so logit s ~ g x_{sigma^-1(s)} . x_t is
largest at s = sigma(t), by a margin of ~h over ~sqrt(2 h ln V) for the best
other token: greedy output follows t -> sigma(t). MTP head: it reads the
embedding of the token t' just sampled and its residual starts as ~[c', y_t',
0]; for t' in S the lm head then picks sigma(t'), the main model's next token,
with a probability near 1 (an accepted draft); for t' not in S only the MTP
block's own noise reaches the lm head, so the draft is a random token of low
probability (at P = 0 none of 128 drafts reached 0.5), and a draft minimum
probability (--spec-draft-p-min 0.5) stops drafting there, as a real model's
unsure drafts do. A generated stretch of n tokens of the cycle has an S
fraction of P +- sqrt(P (1 - P) / n). Which server numbers show P:

  --spec-draft-n-max 1 --spec-draft-p-min 0   draft_n_accepted / draft_n ~ P
  --spec-draft-n-max N --spec-draft-p-min 0.5 drafts stop at the first token
      outside S, so draft_n_accepted / draft_n ~ 1 and P sets the draft
      length: tokens per verify step = predicted_n / (predicted_n -
      draft_n_accepted), at most N + 1

Measured with strata-server on a CPU (qwen4exp and qwen35moe-mtp, --seed 10
--embd 256 --expert-ffn 256, prompt "The quick brown fox jumps over the lazy
dog. Once upon a time", 128 greedy tokens; speculation left the text
unchanged in every run, and the main model followed sigma at every position;
both presets gave the same numbers):

  P     S fraction of   n-max 1, p-min 0      n-max 4, p-min 0.5
        the 127 tokens  accepted / drafted    accepted / drafted  tokens/step
  0     0.00            0 / 126 = 0.00        0 / 0               1.00
  0.5   0.43            40 / 86 = 0.47        54 / 54             1.73
  0.9   0.87            58 / 68 = 0.85        94 / 94             3.76
  1     1.00            63 / 63 = 1.00        101 / 101           4.74

Over 512 tokens (qwen35moe-mtp) one-token drafts were accepted at 167 / 344 =
0.49 for P = 0.5 and 242 / 269 = 0.90 for P = 0.9.

Width: the margin above shrinks with h while the noise of the random layers
does not, so --mtp-accept needs n_embd >= MTP_MIN_EMBD = 128. Measured share
of positions at which the main model follows sigma (qwen4exp and
qwen35moe-mtp, P = 0.9): n_embd 64 0.73 and 0.78 (refused); 128 1.00 (0.998
for qwen4exp with --quant-rest q4_k over 512 tokens); 192, 256 1.00; 2048
(80b-a3b with 4 layers and 64 experts, 64 tokens) 1.00, with 30 of 33
one-token drafts accepted. The residual-writing matrices therefore keep their
usual scale.

Only token_embd depends on P (through Y); output and eh_proj depend on the
seed and the vocabulary. --rewrite-mtp-accept, with the arguments that wrote
--out and a new --mtp-accept, turns that file into the one these arguments
would write, in place: it checks that the header is the plan's but for the
strata.mtp_accept value (every key, tensor name, shape, type and offset, and
the file size) and that the first rows of output and eh_proj are the
construction's, and refuses otherwise; then it sets strata.mtp_accept to NaN,
rewrites token_embd and writes the new P (an interrupted rewrite leaves NaN
behind and a rerun completes it). For the 80b-a3b shape (token_embd 2048 x
151936 at q8_0, 315 MiB) it takes about 7 s on 2 CPU cores.

LoRA adapters
-------------
With --lora-rank R the output is not a model but a LoRA adapter GGUF (as
convert_lora_to_gguf.py writes them) for the model that the same arguments
would write: general.type = "adapter", adapter.type = "lora",
adapter.lora.alpha = A (--lora-alpha, default R), general.architecture of the
base, and for every layer and every target T (--lora-targets, default
attn_q,attn_v,ffn_up,ffn_down) a pair

    blk.N.T.weight.lora_a   ne = (n_in, R)      [ggml order]
    blk.N.T.weight.lora_b   ne = (R, n_out)

where blk.N.T.weight has ne = (n_in, n_out); llama.cpp (llama-adapter.cpp)
checks exactly these shapes and adds scale * A/R * B(A x) to W x. lora_a is
N(0, 1/n_in) and lora_b is scaled so that at adapter scale 1 the entries of
(A/R) * B A have G (--lora-gain, default 1) times the standard deviation of
the base matrix: at scale 1 the adapter is as strong as the weights it
modifies, enough to change greedy output, and at scale 0 it is a no-op. The
bias-channel rules above carry over (lora_a input column 0 / lora_b output
row 0 are zero where the base matrix's are). Tensor values come from the same
per-name generators as the model's, seeded from (--seed, crc32(name)); the
tokenizer is not copied.
"""

from __future__ import annotations

import argparse
import functools
import math
import mmap
import os
import struct
import sys
import time
import types
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

GENERATOR_VERSION = 1

REPO = Path(__file__).resolve().parents[2]


def llama_src() -> Path:
    return Path(os.environ.get("STRATA_LLAMA_SRC") or REPO / "vendor" / "llama.cpp")


def _import_gguf():
    sys.path.insert(0, str(llama_src() / "gguf-py"))
    try:
        import yaml  # noqa: F401
    except ImportError:
        # gguf/metadata.py imports yaml at module level but only uses it for model cards
        sys.modules["yaml"] = types.ModuleType("yaml")
    import gguf
    return gguf


gguf = _import_gguf()
GT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType

QUANT_NAMES = {
    "f32": GT.F32,
    "f16": GT.F16,
    "q8_0": GT.Q8_0,
    "q4_k": GT.Q4_K,
    "iq3_xxs": GT.IQ3_XXS,
}

FILE_TYPES = {
    GT.F32: gguf.LlamaFileType.ALL_F32,
    GT.F16: gguf.LlamaFileType.MOSTLY_F16,
    GT.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    GT.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M,
    GT.IQ3_XXS: gguf.LlamaFileType.MOSTLY_IQ3_XXS,
}

BIAS_CHANNEL_VALUE = 2.0

# ---------------------------------------------------------------------------
# presets

PRESETS: dict[str, dict] = {
    "qwen3moe": dict(
        arch="qwen3moe", vocab="qwen2", template="Qwen-Qwen3-0.6B.jinja",
        n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32,
        n_expert=16, n_expert_used=4, n_ff_exp=64,
        n_ctx=4096, rope_base=1_000_000.0, rms_eps=1e-6,
        tied_output=False, embd_std=1.0, bias_channel=True,
    ),
    "llama": dict(
        arch="llama", vocab="llama-spm", template=None,
        n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
        n_ctx=4096, rope_base=10_000.0, rms_eps=1e-5,
        tied_output=False, embd_std=1.0, bias_channel=False,
    ),
    "gemma4": dict(
        arch="gemma4", vocab="gemma-4", template="google-gemma-4-31B-it.jinja",
        n_layer=4, n_embd=64, n_head=4, n_head_kv_swa=2, n_head_kv_full=1,
        head_dim_swa=32, head_dim_full=64, rope_partial_full=0.25,
        n_ff=128, n_embd_per_layer=8, swa_period=2, kv_shared_frac=0.5,
        sliding_window=128, final_softcap=30.0,
        n_ctx=8192, rope_base=1_000_000.0, rope_base_swa=10_000.0, rms_eps=1e-6,
        tied_output=True, bias_channel=False,
    ),
    # gemma3n: llama.cpp fixes altup (4 streams), laurel rank 64 and a per-layer input width of
    # 256 in code, not in the file, so the per-layer table has 256 values per layer and token; a
    # 32k vocabulary (llama's) keeps the tiny model's table at 17 MB (gemma's 262k: 140 MB)
    "gemma3n": dict(
        arch="gemma3n", vocab="llama-spm", template=None,
        n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
        n_embd_altup=256, n_altup=4, laurel_rank=64, swa_period=5, sliding_window=128,
        n_ctx=8192, rope_base=1_000_000.0, rope_base_swa=10_000.0, rms_eps=1e-6,
        tied_output=True, bias_channel=False,
    ),
    "qwen35moe-mtp": dict(
        arch="qwen35moe", vocab="qwen35", template="Qwen3.5-4B.jinja",
        n_layer=4, n_nextn=1, full_attn_interval=4,
        n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_rot=16, rope_sections=[3, 3, 2, 0],
        n_expert=16, n_expert_used=4, n_ff_exp=64, n_ff_shexp=64,
        ssm_d_conv=4, ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=4,
        n_ctx=4096, rope_base=10_000_000.0, rms_eps=1e-6,
        tied_output=False, embd_std=1.0, bias_channel=True,
    ),
    # the pin has no qwen4exp vocabulary or template: Qwen3.5's
    "qwen4exp": dict(
        arch="qwen4exp", vocab="qwen35", template="Qwen3.5-4B.jinja",
        n_layer=4, n_nextn=1, full_attn_interval=4,
        n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_rot=16, rope_sections=[3, 3, 2, 0],
        n_expert=16, n_expert_used=4, n_ff_exp=64, n_ff_shexp=64,
        ssm_d_conv=4, ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=4,
        hc_count=4, hc_low_rank=32,
        # 4 heads of 128: a shape the CUDA lightning indexer takes
        indexer_n_head=4, indexer_head_dim=128, indexer_top_k=32, compress_ratio=4,
        ple_layer=1, ple_ngram_size=3, ple_heads_per_ngram=2, ple_conv_kernel=4, ple_head_rows=4096,
        n_ctx=4096, rope_base=10_000_000.0, rms_eps=1e-6,
        tied_output=False, embd_std=1.0, bias_channel=True,
    ),
    # BERT encoders as convert_hf_to_gguf.py writes bge-small / bge-reranker:
    # post-norm LayerNorm blocks with biases, learned absolute positions,
    # non-causal attention, WordPiece vocabulary.
    "bert": dict(
        arch="bert", vocab="bert-bge", template=None,
        n_layer=2, n_embd=64, n_head=2, n_ff=128,
        n_ctx=512, norm_eps=1e-12, pooling="mean", cls_labels=None,
        embd_std=1.0, bias_std=0.1, bias_channel=False, quant_rest="f16",
    ),
    "bert-rerank": dict(
        arch="bert", vocab="bert-bge", template=None,
        n_layer=2, n_embd=64, n_head=2, n_ff=128,
        n_ctx=512, norm_eps=1e-12, pooling="rank", cls_labels=["LABEL_0"],
        embd_std=1.0, bias_std=0.1, bias_channel=False, quant_rest="f16",
    ),
}

POOLING_TYPES = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}

SHAPES: dict[str, dict[str, dict]] = {
    # a dense 8B-class llama (Llama-3-8B's dimensions, the preset's 32k vocabulary) for measuring
    # dense GEMM dispatch on a GPU
    "llama": {
        "8b": dict(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_ctx=8192),
    },
    "qwen3moe": {
        "80b-a3b": dict(
            n_layer=48, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256,
            n_expert=512, n_expert_used=10, n_ff_exp=512,
            n_ctx=262144, tied_output=False,
        ),
    },
    # the tiny gemma4 with a 4.3 GB q8_0 per-layer embedding table (262144 rows x 16 KB), for
    # measuring PLE I/O on a table far larger than a batch touches
    "gemma4": {
        "ple-4g": dict(n_embd_per_layer=3840),
    },
    "qwen4exp": {
        "80b-a3b": dict(
            n_layer=48, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, n_rot=64, rope_sections=[11, 11, 10, 0],
            n_expert=512, n_expert_used=10, n_ff_exp=512, n_ff_shexp=512,
            ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32,
            hc_low_rank=64, indexer_top_k=2048,
            ple_heads_per_ngram=4, ple_head_rows=2_097_152,
            n_ctx=262144,
        ),
    },
}


# ---------------------------------------------------------------------------
# tensor plan

@dataclass
class TensorSpec:
    name: str
    ne: tuple[int, ...]           # ggml order: ne[0] is the row length
    role: str                     # expert | matrix | embd | router | f32
    std: float = 0.0
    col0: float | np.ndarray | None = None  # embd/router: value(s) of input column 0 (per row)
    zero_col0: bool = False       # input column 0 is zero (reads the bias channel)
    zero_row0: bool = False       # output row 0 of every matrix is zero (writes the bias channel)
    row0_period: int = 0          # with zero_row0: zero every output row at a multiple of this (default ne[1])
    init: Callable[[np.random.Generator, tuple[int, ...]], np.ndarray] | None = None  # f32 tensors
    qtype: int = GT.F32
    # rows(r0, r) -> (r, ne[0]) float32: the tensor's rows r0 .. r0+r-1, encoded with encode_floats
    rows: Callable[[int, int], np.ndarray] | None = None

    @property
    def n_rows(self) -> int:
        return math.prod(self.ne[1:])

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.n_rows * (self.ne[0] // block) * size


@dataclass
class Model:
    arch: str
    n_layer: int                  # all blocks, MTP/NextN included
    bias_channel: bool
    kv: list[tuple[str, int, object]] = field(default_factory=list)
    tensors: list[TensorSpec] = field(default_factory=list)

    def add_kv(self, key: str, vtype: int, value) -> None:
        self.kv.append((key.format(arch=self.arch), vtype, value))

    def u32(self, key: str, value: int) -> None:
        self.add_kv(key, VT.UINT32, int(value))

    def f32(self, key: str, value: float) -> None:
        self.add_kv(key, VT.FLOAT32, float(value))

    def arr(self, key: str, vtype: int, values) -> None:
        self.add_kv(key, VT.ARRAY, (vtype, list(values)))

    def weight(self, name: str, ne: tuple[int, ...], role: str = "matrix",
               reads: bool = False, writes: bool = False, row0_period: int = 0, **kw) -> None:
        """reads / writes: the matrix reads the normalized residual / writes into the residual.
        row0_period: the output rows at its multiples are zero (channel 0 of each hyper-connection stream)."""
        std = 1.0 / math.sqrt(ne[0])
        if writes:
            std /= math.sqrt(2 * self.n_layer)
        self.tensors.append(TensorSpec(name, tuple(ne), role, std=std,
                                       zero_col0=reads and self.bias_channel,
                                       zero_row0=(writes or row0_period > 0) and self.bias_channel,
                                       row0_period=row0_period, **kw))

    def vec(self, name: str, ne: tuple[int, ...], init) -> None:
        self.tensors.append(TensorSpec(name, tuple(ne), "f32", init=init))

    def norm(self, name: str, n: int) -> None:
        self.vec(name, (n,), ones)


def bias_channel_x0(n_embd: int) -> float:
    """expected channel 0 of the RMS-normalized residual when channel 0 holds BIAS_CHANNEL_VALUE."""
    c = BIAS_CHANNEL_VALUE
    return c * math.sqrt(n_embd / (c * c + n_embd - 1))


def ones(rng, shape):
    return np.ones(shape, dtype=np.float32)


def const(value: float):
    return lambda rng, shape: np.full(shape, value, dtype=np.float32)


def normal(std: float):
    return lambda rng, shape: rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def uniform(lo: float, hi: float):
    return lambda rng, shape: (rng.random(shape, dtype=np.float32) * np.float32(hi - lo) + np.float32(lo))


def router_ranks(seed: int, layer: int, n_expert: int) -> np.ndarray:
    """rank of each expert (0 = most popular) in trunk layer `layer`."""
    return np.random.default_rng([seed, 0x5EED, layer]).permutation(n_expert)


def router_bias(seed: int, layer: int, n_expert: int, skew: float) -> np.ndarray:
    """b_e = -skew * ln(1 + rank_e): the intended additive router-logit bias per expert."""
    return (-skew * np.log1p(router_ranks(seed, layer, n_expert))).astype(np.float32)


def add_router(m: Model, hp: dict, il: int, skew_layer: bool, x0_scale: float = 1.0) -> None:
    """x0_scale: the router input's channel 0 is x0_scale * X0."""
    n_embd, n_expert = hp["n_embd"], hp["n_expert"]
    col0 = None
    if m.bias_channel:
        col0 = np.zeros(n_expert, dtype=np.float32)
        if skew_layer:
            x0 = x0_scale * bias_channel_x0(n_embd)
            col0 = router_bias(hp["seed"], il, n_expert, hp["router_skew"]) / np.float32(x0)
    m.weight(f"blk.{il}.ffn_gate_inp.weight", (n_embd, n_expert), role="router", col0=col0)


def add_experts(m: Model, hp: dict, il: int) -> None:
    n_embd, n_ff, n_exp = hp["n_embd"], hp["n_ff_exp"], hp["n_expert"]
    m.weight(f"blk.{il}.ffn_gate_exps.weight", (n_embd, n_ff, n_exp), role="expert", reads=True)
    m.weight(f"blk.{il}.ffn_up_exps.weight", (n_embd, n_ff, n_exp), role="expert", reads=True)
    m.weight(f"blk.{il}.ffn_down_exps.weight", (n_ff, n_embd, n_exp), role="expert", writes=True)


def add_common(m: Model, hp: dict, n_vocab: int, embd_std: float, output_norm: bool = True) -> None:
    n_embd = hp["n_embd"]
    m.u32("{arch}.context_length", hp["n_ctx"])
    m.u32("{arch}.embedding_length", n_embd)
    m.f32("{arch}.attention.layer_norm_rms_epsilon", hp["rms_eps"])
    m.f32("{arch}.rope.freq_base", hp["rope_base"])
    m.tensors.append(TensorSpec("token_embd.weight", (n_embd, n_vocab), "embd", std=embd_std,
                                col0=BIAS_CHANNEL_VALUE if m.bias_channel else None))
    if output_norm:
        m.norm("output_norm.weight", n_embd)
    if not hp["tied_output"]:
        m.weight("output.weight", (n_embd, n_vocab))


def add_moe_kv(m: Model, hp: dict) -> None:
    m.u32("{arch}.expert_count", hp["n_expert"])
    m.u32("{arch}.expert_used_count", hp["n_expert_used"])
    m.u32("{arch}.expert_feed_forward_length", hp["n_ff_exp"])


def add_attention(m: Model, p: str, n_embd: int, hd: int, nh: int, nkv: int) -> None:
    m.norm(p + "attn_norm.weight", n_embd)
    m.weight(p + "attn_q.weight", (n_embd, hd * nh), reads=True)
    m.weight(p + "attn_k.weight", (n_embd, hd * nkv), reads=True)
    m.weight(p + "attn_v.weight", (n_embd, hd * nkv), reads=True)
    m.weight(p + "attn_output.weight", (hd * nh, n_embd), writes=True)


def build_qwen3moe(m: Model, hp: dict, n_vocab: int) -> None:
    n_embd, hd, nh, nkv = hp["n_embd"], hp["head_dim"], hp["n_head"], hp["n_head_kv"]
    m.u32("{arch}.block_count", hp["n_layer"])
    m.u32("{arch}.feed_forward_length", hp["n_ff_exp"])
    m.u32("{arch}.attention.head_count", nh)
    m.u32("{arch}.attention.head_count_kv", nkv)
    m.u32("{arch}.attention.key_length", hd)
    m.u32("{arch}.attention.value_length", hd)
    m.u32("{arch}.rope.dimension_count", hd)
    add_moe_kv(m, hp)
    add_common(m, hp, n_vocab, hp["embd_std"])
    for il in range(hp["n_layer"]):
        p = f"blk.{il}."
        add_attention(m, p, n_embd, hd, nh, nkv)
        m.norm(p + "attn_q_norm.weight", hd)
        m.norm(p + "attn_k_norm.weight", hd)
        m.norm(p + "ffn_norm.weight", n_embd)
        add_router(m, hp, il, True)
        add_experts(m, hp, il)


def build_llama(m: Model, hp: dict, n_vocab: int) -> None:
    n_embd, nh, nkv, n_ff = hp["n_embd"], hp["n_head"], hp["n_head_kv"], hp["n_ff"]
    if n_embd % nh:
        raise SystemExit(f"llama: n_embd {n_embd} must be a multiple of n_head {nh}")
    hd = n_embd // nh
    m.u32("{arch}.block_count", hp["n_layer"])
    m.u32("{arch}.feed_forward_length", n_ff)
    m.u32("{arch}.attention.head_count", nh)
    m.u32("{arch}.attention.head_count_kv", nkv)
    m.u32("{arch}.rope.dimension_count", hd)
    m.u32("{arch}.vocab_size", n_vocab)
    add_common(m, hp, n_vocab, hp["embd_std"])
    for il in range(hp["n_layer"]):
        p = f"blk.{il}."
        add_attention(m, p, n_embd, hd, nh, nkv)
        m.norm(p + "ffn_norm.weight", n_embd)
        m.weight(p + "ffn_gate.weight", (n_embd, n_ff), reads=True)
        m.weight(p + "ffn_up.weight", (n_embd, n_ff), reads=True)
        m.weight(p + "ffn_down.weight", (n_ff, n_embd), writes=True)


def gemma4_layout(hp: dict) -> tuple[list[bool], int]:
    """SWA pattern and number of KV-sharing layers.

    llama.cpp lets a KV-sharing layer reuse the cache of layer n_kv-2 (SWA) or
    n_kv-1 (full attention), so the last two layers that own a cache must be
    SWA then full; ending every period with a full-attention layer and making
    n_kv a multiple of the period guarantees that."""
    n_layer, period = hp["n_layer"], hp["swa_period"]
    swa = [(il + 1) % period != 0 for il in range(n_layer)]
    periods = max(1, round(n_layer * (1 - hp["kv_shared_frac"]) / period))
    n_kv = min(periods * period, n_layer // period * period)
    if n_kv < 2:
        return swa, 0
    return swa, n_layer - n_kv


def add_gemma_ple_table(m: Model, hp: dict, n_vocab: int, n_pl: int) -> None:
    """embeddings, output, and the per-layer table with its projection (gemma3n and gemma4)."""
    n_embd, n_layer = hp["n_embd"], hp["n_layer"]
    add_common(m, hp, n_vocab, 1.0 / math.sqrt(n_embd))  # the graph scales embeddings by sqrt(n_embd)
    m.tensors.append(TensorSpec("per_layer_token_embd.weight", (n_pl * n_layer, n_vocab), "embd",
                                std=1.0 / math.sqrt(n_pl)))
    m.weight("per_layer_model_proj.weight", (n_embd, n_pl * n_layer))
    m.norm("per_layer_proj_norm.weight", n_pl)


def add_gemma_attention(m: Model, p: str, n_embd: int, hd: int, nh: int, nkv: int) -> None:
    m.norm(p + "attn_norm.weight", n_embd)
    m.weight(p + "attn_q.weight", (n_embd, hd * nh))
    m.weight(p + "attn_k.weight", (n_embd, hd * nkv))
    m.weight(p + "attn_v.weight", (n_embd, hd * nkv))
    m.weight(p + "attn_output.weight", (hd * nh, n_embd))
    m.norm(p + "attn_q_norm.weight", hd)
    m.norm(p + "attn_k_norm.weight", hd)
    m.norm(p + "post_attention_norm.weight", n_embd)


def add_gemma_ffn_ple(m: Model, p: str, n_embd: int, n_ff: int, n_pl: int) -> None:
    """the feed-forward block and the layer's per-layer input gate and projection."""
    m.norm(p + "ffn_norm.weight", n_embd)
    m.weight(p + "ffn_gate.weight", (n_embd, n_ff))
    m.weight(p + "ffn_up.weight", (n_embd, n_ff))
    m.weight(p + "ffn_down.weight", (n_ff, n_embd))
    m.norm(p + "post_ffw_norm.weight", n_embd)
    m.weight(p + "inp_gate.weight", (n_embd, n_pl))
    m.weight(p + "proj.weight", (n_pl, n_embd))
    m.norm(p + "post_norm.weight", n_embd)


def build_gemma4(m: Model, hp: dict, n_vocab: int) -> None:
    n_embd, n_layer, nh, n_ff = hp["n_embd"], hp["n_layer"], hp["n_head"], hp["n_ff"]
    hd_swa, hd_full, n_pl = hp["head_dim_swa"], hp["head_dim_full"], hp["n_embd_per_layer"]
    swa, n_shared = gemma4_layout(hp)
    n_kv = [hp["n_head_kv_swa"] if s else hp["n_head_kv_full"] for s in swa]

    m.u32("{arch}.block_count", n_layer)
    m.u32("{arch}.feed_forward_length", n_ff)
    m.u32("{arch}.attention.head_count", nh)
    m.arr("{arch}.attention.head_count_kv", VT.INT32, n_kv)
    m.u32("{arch}.attention.key_length", hd_full)
    m.u32("{arch}.attention.value_length", hd_full)
    m.u32("{arch}.attention.key_length_swa", hd_swa)
    m.u32("{arch}.attention.value_length_swa", hd_swa)
    m.u32("{arch}.rope.dimension_count", hd_full)
    m.u32("{arch}.rope.dimension_count_swa", hd_swa)
    m.f32("{arch}.rope.freq_base_swa", hp["rope_base_swa"])
    m.u32("{arch}.attention.sliding_window", hp["sliding_window"])
    m.arr("{arch}.attention.sliding_window_pattern", VT.BOOL, swa)
    m.u32("{arch}.attention.shared_kv_layers", n_shared)
    m.u32("{arch}.embedding_length_per_layer_input", n_pl)
    m.f32("{arch}.final_logit_softcapping", hp["final_softcap"])

    add_gemma_ple_table(m, hp, n_vocab, n_pl)

    # proportional rope on full-attention layers: only the first pairs rotate
    n_rot_pairs = int(hd_full * hp["rope_partial_full"] / 2)
    freqs = np.array([1.0] * n_rot_pairs + [1e30] * (hd_full // 2 - n_rot_pairs), dtype=np.float32)
    m.vec("rope_freqs.weight", (hd_full // 2,), lambda rng, shape: freqs.copy())

    for il in range(n_layer):
        p = f"blk.{il}."
        add_gemma_attention(m, p, n_embd, hd_swa if swa[il] else hd_full, nh, n_kv[il])
        m.vec(p + "layer_output_scale.weight", (1,), ones)
        add_gemma_ffn_ple(m, p, n_embd, n_ff, n_pl)


def build_gemma3n(m: Model, hp: dict, n_vocab: int) -> None:
    n_embd, n_layer, nh, nkv, hd, n_ff = hp["n_embd"], hp["n_layer"], hp["n_head"], hp["n_head_kv"], hp["head_dim"], hp["n_ff"]
    n_pl, n_altup, rank = hp["n_embd_altup"], hp["n_altup"], hp["laurel_rank"]
    swa = [(il + 1) % hp["swa_period"] != 0 for il in range(n_layer)]

    m.u32("{arch}.block_count", n_layer)
    m.u32("{arch}.feed_forward_length", n_ff)
    m.u32("{arch}.attention.head_count", nh)
    m.u32("{arch}.attention.head_count_kv", nkv)
    m.u32("{arch}.attention.key_length", hd)
    m.u32("{arch}.attention.value_length", hd)
    m.u32("{arch}.rope.dimension_count", hd)
    m.f32("{arch}.rope.freq_base_swa", hp["rope_base_swa"])
    m.u32("{arch}.attention.sliding_window", hp["sliding_window"])
    m.arr("{arch}.attention.sliding_window_pattern", VT.BOOL, swa)
    m.u32("{arch}.embedding_length_per_layer_input", n_pl)

    add_gemma_ple_table(m, hp, n_vocab, n_pl)
    m.weight("altup_proj.weight", (n_embd, n_embd, n_altup - 1))
    m.weight("altup_unembd_proj.weight", (n_embd, n_embd, n_altup - 1))

    # small mixing coefficients keep the four altup streams close to the active one
    coef = normal(0.05)
    for il in range(n_layer):
        p = f"blk.{il}."
        add_gemma_attention(m, p, n_embd, hd, nh, nkv)
        add_gemma_ffn_ple(m, p, n_embd, n_ff, n_pl)
        m.vec(p + "altup_correct_coef.weight", (n_altup, n_altup), coef)
        m.vec(p + "altup_correct_scale.weight", (n_embd,), ones)
        m.vec(p + "altup_predict_coef.weight", (n_altup, n_altup * n_altup), coef)
        m.weight(p + "altup_router.weight", (n_embd, n_altup))
        m.norm(p + "altup_router_norm.weight", n_embd)
        m.weight(p + "laurel_l.weight", (n_embd, rank))
        m.weight(p + "laurel_r.weight", (rank, n_embd))
        m.norm(p + "laurel_post_norm.weight", n_embd)


def add_qwen35_kv(m: Model, hp: dict) -> None:
    """the hybrid Qwen3.5 keys that qwen35moe and qwen4exp share."""
    d_state, dt_rank = hp["ssm_d_state"], hp["ssm_dt_rank"]
    m.u32("{arch}.block_count", hp["n_layer"] + hp["n_nextn"])
    m.u32("{arch}.nextn_predict_layers", hp["n_nextn"])
    m.u32("{arch}.feed_forward_length", hp["n_ff_exp"])
    m.u32("{arch}.attention.head_count", hp["n_head"])
    m.u32("{arch}.attention.head_count_kv", hp["n_head_kv"])
    m.u32("{arch}.attention.key_length", hp["head_dim"])
    m.u32("{arch}.attention.value_length", hp["head_dim"])
    m.u32("{arch}.rope.dimension_count", hp["n_rot"])
    m.arr("{arch}.rope.dimension_sections", VT.INT32, hp["rope_sections"])
    m.u32("{arch}.expert_shared_feed_forward_length", hp["n_ff_shexp"])
    m.u32("{arch}.ssm.conv_kernel", hp["ssm_d_conv"])
    m.u32("{arch}.ssm.state_size", d_state)
    m.u32("{arch}.ssm.group_count", hp["ssm_n_group"])
    m.u32("{arch}.ssm.time_step_rank", dt_rank)
    m.u32("{arch}.ssm.inner_size", d_state * dt_rank)
    m.u32("{arch}.full_attention_interval", hp["full_attn_interval"])
    add_moe_kv(m, hp)


def add_gated_attention(m: Model, hp: dict, p: str) -> None:
    n_embd, hd, nh, nkv = hp["n_embd"], hp["head_dim"], hp["n_head"], hp["n_head_kv"]
    m.weight(p + "attn_q.weight", (n_embd, hd * nh * 2), reads=True)  # query and output gate
    m.weight(p + "attn_k.weight", (n_embd, hd * nkv), reads=True)
    m.weight(p + "attn_v.weight", (n_embd, hd * nkv), reads=True)
    m.weight(p + "attn_output.weight", (hd * nh, n_embd), writes=True)
    m.norm(p + "attn_q_norm.weight", hd)
    m.norm(p + "attn_k_norm.weight", hd)


def add_gated_delta_net(m: Model, hp: dict, p: str) -> None:
    n_embd = hp["n_embd"]
    d_conv, d_state, n_group, dt_rank = hp["ssm_d_conv"], hp["ssm_d_state"], hp["ssm_n_group"], hp["ssm_dt_rank"]
    key_dim, value_dim = d_state * n_group, d_state * dt_rank
    conv_dim = 2 * key_dim + value_dim
    m.weight(p + "attn_qkv.weight", (n_embd, conv_dim), reads=True)
    m.weight(p + "attn_gate.weight", (n_embd, value_dim), reads=True)
    m.vec(p + "ssm_conv1d.weight", (d_conv, conv_dim), normal(1.0 / math.sqrt(d_conv)))
    m.vec(p + "ssm_dt.bias", (dt_rank,), const(0.0))
    m.vec(p + "ssm_a", (dt_rank,), uniform(-8.0, -1.0))  # -exp(A_log)
    m.weight(p + "ssm_beta.weight", (n_embd, dt_rank), reads=True)
    m.weight(p + "ssm_alpha.weight", (n_embd, dt_rank), reads=True)
    m.norm(p + "ssm_norm.weight", d_state)
    m.weight(p + "ssm_out.weight", (value_dim, n_embd), writes=True)


def add_moe_shexp(m: Model, hp: dict, il: int, skew_layer: bool, x0_scale: float = 1.0) -> None:
    n_embd, n_ff_sh = hp["n_embd"], hp["n_ff_shexp"]
    p = f"blk.{il}."
    add_router(m, hp, il, skew_layer, x0_scale)
    add_experts(m, hp, il)
    m.vec(p + "ffn_gate_inp_shexp.weight", (n_embd,), normal(1.0 / math.sqrt(n_embd)))
    m.weight(p + "ffn_gate_shexp.weight", (n_embd, n_ff_sh), reads=True)
    m.weight(p + "ffn_up_shexp.weight", (n_embd, n_ff_sh), reads=True)
    m.weight(p + "ffn_down_shexp.weight", (n_ff_sh, n_embd), writes=True)


def build_qwen35moe(m: Model, hp: dict, n_vocab: int) -> None:
    n_embd, n_trunk, n_nextn, interval = hp["n_embd"], hp["n_layer"], hp["n_nextn"], hp["full_attn_interval"]
    add_qwen35_kv(m, hp)
    add_common(m, hp, n_vocab, hp["embd_std"])

    for il in range(n_trunk):
        p = f"blk.{il}."
        m.norm(p + "attn_norm.weight", n_embd)
        m.norm(p + "post_attention_norm.weight", n_embd)
        if (il + 1) % interval == 0:
            add_gated_attention(m, hp, p)
        else:
            add_gated_delta_net(m, hp, p)
        add_moe_shexp(m, hp, il, True)

    for il in range(n_trunk, n_trunk + n_nextn):
        p = f"blk.{il}."
        m.norm(p + "attn_norm.weight", n_embd)
        m.norm(p + "post_attention_norm.weight", n_embd)
        add_gated_attention(m, hp, p)
        add_moe_shexp(m, hp, il, False)
        m.weight(p + "nextn.eh_proj.weight", (2 * n_embd, n_embd))
        m.norm(p + "nextn.enorm.weight", n_embd)
        m.norm(p + "nextn.hnorm.weight", n_embd)
        m.norm(p + "nextn.shared_head_norm.weight", n_embd)


def is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def ple_head_vocab_sizes(rows: int, n_heads: int) -> list[int]:
    """the n_heads largest primes below rows: the row count of each PLE hash head."""
    out, k = [], rows - 1
    while len(out) < n_heads:
        if k < 2:
            raise SystemExit(f"ple_head_rows {rows} is too small for {n_heads} heads")
        if is_prime(k):
            out.append(k)
        k -= 1
    return out


def ple_layer_multipliers(seed: int, ngram: int) -> list[int]:
    """odd multipliers of 44 to 45 bits, one per n-gram position."""
    rng = np.random.default_rng([seed, 0x91E])
    return [2 * int(x) + 1 for x in rng.integers(1 << 43, 1 << 44, size=ngram)]


def qwen4exp_layout(hp: dict) -> tuple[list[bool], int, int]:
    """which blocks (trunk, then MTP) are full attention, the PLE row width and head count."""
    n_trunk, interval = hp["n_layer"], hp["full_attn_interval"]
    full = [(il + 1) % interval == 0 for il in range(n_trunk)] + [True] * hp["n_nextn"]
    n_heads = (hp["ple_ngram_size"] - 1) * hp["ple_heads_per_ngram"]
    il = hp["ple_layer"]
    if not 0 <= il < n_trunk or full[il]:
        raise SystemExit(f"qwen4exp: ple_layer {il} must be a linear attention trunk layer")
    if not 2 <= hp["ple_ngram_size"] <= 8 or not 0 < n_heads <= 64 or hp["n_embd"] % n_heads:
        raise SystemExit(f"qwen4exp: n_embd {hp['n_embd']} must split into 1..64 PLE heads, got {n_heads}")
    if hp["indexer_head_dim"] < hp["n_rot"]:
        raise SystemExit("qwen4exp: the indexer head must be at least n_rot wide (its keys are roped)")
    if hp["compress_ratio"] < 2 or hp["indexer_top_k"] % hp["compress_ratio"]:
        raise SystemExit("qwen4exp: need compress_ratio >= 2 dividing indexer_top_k")
    if hp["hc_count"] < 2:
        raise SystemExit("qwen4exp: hc_count must be at least 2")
    return full, hp["n_embd"] // n_heads, n_heads


def build_qwen4exp(m: Model, hp: dict, n_vocab: int) -> None:
    n_embd, n_trunk, n_nextn = hp["n_embd"], hp["n_layer"], hp["n_nextn"]
    hc, hc_lr = hp["hc_count"], hp["hc_low_rank"]
    hc_dim = hc * n_embd
    idx_nh, idx_dim, ratio = hp["indexer_n_head"], hp["indexer_head_dim"], hp["compress_ratio"]
    full, ple_dim, ple_heads = qwen4exp_layout(hp)
    sizes = ple_head_vocab_sizes(hp["ple_head_rows"], ple_heads)
    offsets = [sum(sizes[:h]) for h in range(ple_heads)]

    add_qwen35_kv(m, hp)
    m.u32("{arch}.hyper_connection.count", hc)
    m.u32("{arch}.hyper_connection.low_rank", hc_lr)
    m.u32("{arch}.attention.indexer.head_count", idx_nh)
    m.u32("{arch}.attention.indexer.key_length", idx_dim)
    m.u32("{arch}.attention.indexer.top_k", hp["indexer_top_k"])
    m.arr("{arch}.attention.compress_ratios", VT.UINT32, [ratio if f else 0 for f in full])
    m.arr("{arch}.ple.layers", VT.UINT32, [hp["ple_layer"]])
    m.u32("{arch}.ple.ngram_size", hp["ple_ngram_size"])
    m.u32("{arch}.ple.heads_per_ngram", hp["ple_heads_per_ngram"])
    m.u32("{arch}.ple.conv_kernel", hp["ple_conv_kernel"])
    m.u32("{arch}.ple.eos_token_id", hp["eos_token_id"])
    m.u32("{arch}.embedding_length_per_layer_input", ple_dim)
    m.arr("{arch}.ple.layer_multipliers", VT.UINT64, ple_layer_multipliers(hp["seed"], hp["ple_ngram_size"]))
    m.arr("{arch}.ple.head_offsets", VT.UINT64, offsets)
    m.arr("{arch}.ple.head_vocab_sizes", VT.UINT64, sizes)
    add_common(m, hp, n_vocab, hp["embd_std"], output_norm=False)  # the final hc mixer is the output norm

    def mixer(p: str, inject: bool) -> None:
        m.norm(p + "_norm.weight", hc_dim)
        m.weight(p + "_down.weight", (hc_dim, hc_lr))
        m.weight(p + "_up.weight", (hc_lr, hc_dim), row0_period=n_embd if inject else 0)
        if inject:
            m.weight(p + "_inject.weight", (hc_dim, hc))

    mixer("output_hc", False)
    m.tensors.append(TensorSpec("per_layer_token_embd.weight", (ple_dim, sum(sizes)), "embd", std=1.0))

    for il in range(n_trunk + n_nextn):
        p = f"blk.{il}."
        mixer(p + "hc_attn", True)
        if full[il]:
            add_gated_attention(m, hp, p)
            m.weight(p + "indexer.q_proj.weight", (n_embd, idx_nh * idx_dim), reads=True)
            m.weight(p + "indexer.k_proj.weight", (n_embd, idx_dim), reads=True)
            m.norm(p + "indexer.q_norm.weight", idx_dim)
            m.norm(p + "indexer.k_norm.weight", idx_dim)
        else:
            add_gated_delta_net(m, hp, p)
        if il == hp["ple_layer"]:
            m.weight(p + "ple_key.weight", (n_embd, hc_dim))
            m.weight(p + "ple_value.weight", (n_embd, n_embd), writes=True)
            m.norm(p + "ple_norm_key.weight", hc_dim)
            m.norm(p + "ple_norm_query.weight", hc_dim)
            m.norm(p + "ple_norm_conv.weight", hc_dim)
            m.vec(p + "ple_conv1d.weight", (hp["ple_conv_kernel"], hc_dim),
                  normal(1.0 / math.sqrt(hp["ple_conv_kernel"])))
        mixer(p + "hc_ffn", True)
        add_moe_shexp(m, hp, il, il < n_trunk, x0_scale=0.5)  # the zeroed gate rows: sigmoid(0)
        if il >= n_trunk:
            m.weight(p + "nextn.eh_proj.weight", (2 * n_embd, n_embd))
            m.norm(p + "nextn.enorm.weight", n_embd)
            m.norm(p + "nextn.hnorm.weight", hc_dim)
            mixer(p + "nextn.hc_head", False)


def build_bert(m: Model, hp: dict, n_vocab: int) -> None:
    """BERT encoder (llama.cpp src/models/bert.cpp).

    Linear and LayerNorm biases are N(0, bias_std) so a runtime that drops a bias
    gives visibly different vectors; LayerNorm weights are 1. position_embd and
    token_types are f32 like convert_hf_to_gguf.py writes them. A rank preset adds
    the classification head: cls (n_embd x n_embd, tanh) then cls.output
    (n_embd -> one score per label)."""
    n_embd, nh, n_ff, n_ctx = hp["n_embd"], hp["n_head"], hp["n_ff"], hp["n_ctx"]
    if n_embd % nh:
        raise SystemExit(f"bert: n_embd {n_embd} must be a multiple of n_head {nh}")
    bias = normal(hp["bias_std"])
    m.u32("{arch}.block_count", hp["n_layer"])
    m.u32("{arch}.context_length", n_ctx)
    m.u32("{arch}.embedding_length", n_embd)
    m.u32("{arch}.feed_forward_length", n_ff)
    m.u32("{arch}.attention.head_count", nh)
    m.f32("{arch}.attention.layer_norm_epsilon", hp["norm_eps"])
    m.add_kv("{arch}.attention.causal", VT.BOOL, False)
    m.u32("{arch}.pooling_type", POOLING_TYPES[hp["pooling"]])
    if hp["cls_labels"]:
        m.arr("{arch}.classifier.output_labels", VT.STRING, hp["cls_labels"])

    m.tensors.append(TensorSpec("token_embd.weight", (n_embd, n_vocab), "embd", std=hp["embd_std"]))
    m.vec("token_types.weight", (n_embd, hp["n_token_types"]), normal(hp["embd_std"]))
    m.vec("position_embd.weight", (n_embd, n_ctx), normal(hp["embd_std"]))
    m.norm("token_embd_norm.weight", n_embd)
    m.vec("token_embd_norm.bias", (n_embd,), bias)
    for il in range(hp["n_layer"]):
        p = f"blk.{il}."
        for name, n_in, n_out in (("attn_q", n_embd, n_embd), ("attn_k", n_embd, n_embd),
                                  ("attn_v", n_embd, n_embd), ("attn_output", n_embd, n_embd)):
            m.weight(p + name + ".weight", (n_in, n_out))
            m.vec(p + name + ".bias", (n_out,), bias)
        m.norm(p + "attn_output_norm.weight", n_embd)
        m.vec(p + "attn_output_norm.bias", (n_embd,), bias)
        m.weight(p + "ffn_up.weight", (n_embd, n_ff))
        m.vec(p + "ffn_up.bias", (n_ff,), bias)
        m.weight(p + "ffn_down.weight", (n_ff, n_embd))
        m.vec(p + "ffn_down.bias", (n_embd,), bias)
        m.norm(p + "layer_output_norm.weight", n_embd)
        m.vec(p + "layer_output_norm.bias", (n_embd,), bias)
    if hp["pooling"] == "rank":
        n_out = len(hp["cls_labels"] or [None])
        m.weight("cls.weight", (n_embd, n_embd))
        m.vec("cls.bias", (n_embd,), bias)
        m.weight("cls.output.weight", (n_embd, n_out))
        m.vec("cls.output.bias", (n_out,), bias)


BUILDERS = {
    "bert": build_bert,
    "qwen3moe": build_qwen3moe,
    "llama": build_llama,
    "gemma4": build_gemma4,
    "gemma3n": build_gemma3n,
    "qwen35moe": build_qwen35moe,
    "qwen4exp": build_qwen4exp,
}


# ---------------------------------------------------------------------------
# MTP acceptance (--mtp-accept)

MTP_ACCEPT_KEY = "strata.mtp_accept"
MTP_BLOCK = 128               # tokens per generator block; the cycle shift K is a multiple of it
MTP_MIN_EMBD = 128            # narrower: the random layers push the main model off the cycle (see the docstring)
MTP_OUTPUT_GAIN = 2.0         # lm head rows are x * gain / sqrt(h)
MTP_P_TENSORS = ("token_embd.weight",)  # the tensors whose bytes depend on P
CONTROL_TOKEN_TYPE = 3


def _kv_uint(blob: bytes) -> int:
    """the value of a raw scalar UINT32 KV blob (pack_kv layout)."""
    return struct.unpack_from("<I", blob, len(blob) - 4)[0]


def _kv_int_array(blob: bytes) -> np.ndarray:
    """the values of a raw INT32/UINT32 array KV blob (pack_kv layout)."""
    klen = struct.unpack_from("<Q", blob, 0)[0]
    sub, n = struct.unpack_from("<IQ", blob, 8 + klen + 4)
    return np.frombuffer(blob, dtype="<i4" if sub == VT.INT32 else "<u4", count=n, offset=8 + klen + 16)


@dataclass
class MtpAccept:
    """The --mtp-accept construction for one model (see the module docstring)."""
    p: float
    seed: int
    n_embd: int
    n_vocab: int
    dead: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # zero lm head rows

    @property
    def h(self) -> int:
        return (self.n_embd - 1) // 2

    @property
    def n_cycle(self) -> int:
        """V': the tokens on the cycles."""
        return self.n_vocab - self.n_vocab % MTP_BLOCK

    @functools.cached_property
    def shift(self) -> int:
        """K: sigma(t) = (t + K) mod V'; K / 128 is prime to V' / 128 and drawn from the seed."""
        nb = self.n_cycle // MTP_BLOCK
        steps = [k for k in range(1, nb) if math.gcd(k, nb) == 1]
        return MTP_BLOCK * steps[int(np.random.default_rng([self.seed, 0x5417]).integers(len(steps)))]

    def sigma(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=np.int64)
        return np.where(t < self.n_cycle, (t + self.shift) % max(self.n_cycle, 1), t)

    def block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """x (128, h) and membership in S (128,) of the tokens of block b."""
        rng = np.random.default_rng([self.seed, 0xACCE, b])
        x = rng.standard_normal((MTP_BLOCK, self.h), dtype=np.float32)
        return x, rng.random(MTP_BLOCK) < self.p

    def _rows_of_blocks(self, t0: int, n: int, fill) -> np.ndarray:
        """rows t0 .. t0+n-1 of an (n_vocab, n_embd) matrix: fill(out rows, block, in-block slice)
        for every block they touch."""
        out = np.zeros((n, self.n_embd), dtype=np.float32)
        for b in range(t0 // MTP_BLOCK, (t0 + n - 1) // MTP_BLOCK + 1):
            lo, hi = max(t0, b * MTP_BLOCK), min(t0 + n, (b + 1) * MTP_BLOCK)
            fill(out[lo - t0:hi - t0], b, slice(lo - b * MTP_BLOCK, hi - b * MTP_BLOCK))
        return out

    def in_s(self, t: np.ndarray) -> np.ndarray:
        """whether each token is in S (its MTP draft is the main model's next token)."""
        t = np.asarray(t, dtype=np.int64)
        return np.array([bool(self.block(int(v) // MTP_BLOCK)[1][int(v) % MTP_BLOCK]) and v < self.n_cycle
                         for v in t.ravel()]).reshape(t.shape)

    def _fill_embd(self, out: np.ndarray, b: int, sl: slice) -> None:
        out[:, 0] = BIAS_CHANNEL_VALUE
        if b * MTP_BLOCK >= self.n_cycle:
            return
        x, s = self.block(b)
        h = self.h
        out[:, 1:1 + h] = x[sl]
        out[:, 1 + h:1 + 2 * h] = x[sl] * s[sl, None]

    def _fill_out(self, out: np.ndarray, b: int, sl: slice) -> None:
        if b * MTP_BLOCK >= self.n_cycle:
            return
        nb = self.n_cycle // MTP_BLOCK
        x, _ = self.block((b - self.shift // MTP_BLOCK) % nb)  # row s holds x of sigma^-1(s)
        out[:, 1:1 + self.h] = x[sl] * np.float32(MTP_OUTPUT_GAIN / math.sqrt(self.h))

    def embd_rows(self, r0: int, r: int) -> np.ndarray:
        return self._rows_of_blocks(r0, r, self._fill_embd)

    def output_rows(self, r0: int, r: int) -> np.ndarray:
        out = self._rows_of_blocks(r0, r, self._fill_out)
        dead = self.dead[(self.dead >= r0) & (self.dead < r0 + r)]
        out[dead - r0] = 0
        return out

    def eh_proj_rows(self, r0: int, r: int) -> np.ndarray:
        """output channel j (a row of 2 n_embd inputs: enorm(embedding), then hnorm(hidden)):
        channel 0 <- input 0 (the bias channel) and X channel j <- input h + j (Y); the hidden half is unread."""
        out = np.zeros((r, 2 * self.n_embd), dtype=np.float32)
        for j in range(r0, min(r0 + r, self.h + 1)):
            out[j - r0, j + self.h if j else 0] = 1.0
        return out


def dead_tokens(tok_kv: dict[str, bytes]) -> np.ndarray:
    """end-of-generation and control tokens: the lm head never picks them, so the chain never stops."""
    ids = [_kv_uint(tok_kv[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                          "tokenizer.ggml.eom_token_id") if k in tok_kv]
    if "tokenizer.ggml.token_type" in tok_kv:
        ids += np.nonzero(_kv_int_array(tok_kv["tokenizer.ggml.token_type"]) == CONTROL_TOKEN_TYPE)[0].tolist()
    return np.unique(np.array(ids, dtype=np.int64))


def apply_mtp_accept(m: Model, hp: dict, tok_kv: dict[str, bytes], n_vocab: int, p: float) -> MtpAccept:
    """Replace token_embd, output and the MTP eh_proj by the construction's rows."""
    if not hp.get("n_nextn"):
        raise SystemExit(f"--mtp-accept needs a preset with an MTP head (qwen4exp, qwen35moe-mtp), not {hp['arch']}")
    if not 0.0 <= p <= 1.0:
        raise SystemExit("--mtp-accept needs 0 <= P <= 1")
    if hp["n_embd"] < MTP_MIN_EMBD:
        raise SystemExit(f"--mtp-accept needs --embd {MTP_MIN_EMBD} or more (got {hp['n_embd']}): "
                         "narrower models do not follow the token cycle reliably")
    if n_vocab < 2 * MTP_BLOCK:
        raise SystemExit(f"--mtp-accept needs a vocabulary of at least {2 * MTP_BLOCK} tokens")
    c = MtpAccept(p=p, seed=hp["seed"], n_embd=hp["n_embd"], n_vocab=n_vocab, dead=dead_tokens(tok_kv))
    eh = [f"blk.{il}.nextn.eh_proj.weight" for il in range(hp["n_layer"], hp["n_layer"] + hp["n_nextn"])]
    hooks = {"token_embd.weight": c.embd_rows, "output.weight": c.output_rows, **{n: c.eh_proj_rows for n in eh}}
    for t in m.tensors:
        if t.name in hooks:
            t.rows = hooks.pop(t.name)
    if hooks:
        raise SystemExit(f"--mtp-accept: {hp['arch']} has no {', '.join(hooks)}")
    return c


# ---------------------------------------------------------------------------
# quantized block writers

def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).astype(np.float16).view(np.uint8).reshape(-1, 2)


Q8_CODE_STD = math.sqrt(2 * sum(k * k for k in range(128)) / 256)  # random bytes, -128 -> 0
Q4_CODE_STD = math.sqrt(2 * sum(k * k for k in range(8)) / 16)     # q - 8 for random nibbles, 0 -> 8
Q4_SCALE_LO, Q4_SCALE_HI = 16, 63
Q4_SCALE_RMS = math.sqrt(np.mean(np.arange(Q4_SCALE_LO, Q4_SCALE_HI + 1, dtype=np.float64) ** 2))


def _iq3_unit_rms() -> float:
    gguf.quants.IQ3_XXS.init_grid()
    grid_ms = float(np.mean(gguf.quants.IQ3_XXS.grid.astype(np.float64) ** 2))
    scale_ms = float(np.mean((np.arange(16) + 0.5) ** 2))   # db = d * (0.5 + s) * 0.5
    return math.sqrt(0.25 * scale_ms * grid_ms)


IQ3_UNIT_RMS = _iq3_unit_rms()


def pack_q4_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and mins per block into the 12-byte q4_K layout."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def pack_q4_k_codes(q: np.ndarray) -> np.ndarray:
    """q: (n_blocks, 8, 32) codes 0..15 -> (n_blocks, 128) bytes; sub-blocks 2j and 2j+1 share bytes."""
    q = q.astype(np.uint8)
    return (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(q.shape[0], 128)


def random_blocks(qtype: int, rng: np.random.Generator, n_rows: int, row_len: int, std: float) -> np.ndarray:
    """Random but valid data for n_rows rows; dequantized values have standard deviation ~std."""
    if qtype in (GT.F32, GT.F16):
        x = rng.standard_normal((n_rows, row_len), dtype=np.float32) * np.float32(std)
        return x.astype(np.float16 if qtype == GT.F16 else np.float32).view(np.uint8)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    nb = n_rows * (row_len // block)
    if qtype == GT.Q8_0:
        d = (rng.random(nb, dtype=np.float32) * np.float32(0.5) + np.float32(0.75)) * np.float32(std / Q8_CODE_STD)
        qs = rng.integers(0, 256, size=(nb, 32), dtype=np.uint8)
        qs[qs == 0x80] = 0
        return np.concatenate([_f16_bytes(d), qs], axis=1)
    if qtype == GT.Q4_K:
        sc = rng.integers(Q4_SCALE_LO, Q4_SCALE_HI + 1, size=(nb, 8), dtype=np.uint8)
        d = np.full(nb, std / (Q4_CODE_STD * Q4_SCALE_RMS), dtype=np.float32)
        qs = rng.integers(0, 256, size=(nb, 128), dtype=np.uint8)
        lo, hi = qs & 0x0F, qs >> 4
        lo[lo == 0] = 8
        hi[hi == 0] = 8
        # dmin = 8 d and m = sc: d*sc*q - dmin*m = d*sc*(q - 8)
        return np.concatenate([_f16_bytes(d), _f16_bytes(d * 8), pack_q4_k_scales(sc, sc), lo | (hi << 4)], axis=1)
    if qtype == GT.IQ3_XXS:
        d = np.full(nb, std / IQ3_UNIT_RMS, dtype=np.float32)
        body = rng.integers(0, 256, size=(nb, 96), dtype=np.uint8)
        return np.concatenate([_f16_bytes(d), body], axis=1)
    raise ValueError(f"no random writer for {qtype.name}")


def zero_first_element(qtype: int, rows: np.ndarray) -> None:
    """Make element 0 of every row (rows: one row of bytes each) dequantize to zero."""
    if qtype == GT.F32:
        rows[:, 0:4] = 0
    elif qtype == GT.F16:
        rows[:, 0:2] = 0
    elif qtype == GT.Q8_0:
        rows[:, 2] = 0
    elif qtype == GT.Q4_K:
        rows[:, 16] = (rows[:, 16] & 0xF0) | 8
    elif qtype == GT.IQ3_XXS:
        rows[:, 2] = 0  # grid entry 0 is (4, 4, 4, 4), the smallest magnitude available
    else:
        raise ValueError(qtype)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    b = x.reshape(-1, 32)
    d = np.abs(b).max(axis=1) / np.float32(127)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint(b * inv[:, None]), -127, 127).astype(np.int8)
    return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    b = x.reshape(-1, 8, 32)
    lo = np.minimum(b.min(axis=2), 0)
    hi = b.max(axis=2)
    scale = (hi - lo) / np.float32(15)
    mins = -lo
    d = (scale.max(axis=1) / np.float32(63)).astype(np.float16).astype(np.float32)
    dmin = (mins.max(axis=1) / np.float32(63)).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), 0, 63)
    mn = np.clip(np.rint(np.divide(mins, dmin[:, None], out=np.zeros_like(mins), where=dmin[:, None] > 0)), 0, 63)
    eff_scale = d[:, None] * sc
    eff_min = dmin[:, None] * mn
    num = b + eff_min[:, :, None]
    den = np.broadcast_to(eff_scale[:, :, None], num.shape)
    q = np.clip(np.rint(np.divide(num, den, out=np.zeros_like(num), where=den > 0)), 0, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin),
                           pack_q4_k_scales(sc.astype(np.uint8), mn.astype(np.uint8)),
                           pack_q4_k_codes(q)], axis=1)


def encode_floats(qtype: int, x: np.ndarray) -> np.ndarray:
    if qtype == GT.F32:
        return x.astype(np.float32).view(np.uint8)
    if qtype == GT.F16:
        return x.astype(np.float16).view(np.uint8)
    if qtype == GT.Q8_0:
        return quantize_q8_0(x)
    if qtype == GT.Q4_K:
        return quantize_q4_k(x)
    raise ValueError(f"no float quantizer for {qtype.name}")


CHUNK_ELEMS = 1 << 24


def tensor_chunks(t: TensorSpec, seed: int) -> Iterator[np.ndarray]:
    """The tensor's bytes, a bounded number of rows at a time."""
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    if t.role == "f32":
        yield t.init(rng, tuple(reversed(t.ne))).astype(np.float32).view(np.uint8)
        return
    row_len, n_rows = t.ne[0], t.n_rows
    step = max(1, CHUNK_ELEMS // row_len)
    for r0 in range(0, n_rows, step):
        r = min(step, n_rows - r0)
        if t.rows is not None:
            data = encode_floats(t.qtype, t.rows(r0, r))
        elif t.role in ("embd", "router"):
            x = rng.standard_normal((r, row_len), dtype=np.float32) * np.float32(t.std)
            if t.col0 is not None:
                x[:, 0] = t.col0 if np.isscalar(t.col0) else t.col0[r0:r0 + r]
            data = encode_floats(t.qtype, x)
        else:
            data = random_blocks(t.qtype, rng, r, row_len, t.std)
        data = data.reshape(r, -1)
        if t.zero_col0:
            zero_first_element(t.qtype, data)
        if t.zero_row0:
            data[(np.arange(r0, r0 + r) % (t.row0_period or t.ne[1])) == 0] = 0
        yield data


# ---------------------------------------------------------------------------
# type selection

def _fits(qtype: int, row_len: int) -> bool:
    return row_len % gguf.GGML_QUANT_SIZES[qtype][0] == 0


def assign_types(m: Model, quant: int, quant_rest: int) -> None:
    for t in m.tensors:
        if t.role in ("f32", "router"):
            t.qtype = GT.F32
        elif t.role == "expert":
            if not _fits(quant, t.ne[0]):
                block = gguf.GGML_QUANT_SIZES[quant][0]
                raise SystemExit(f"{t.name}: row length {t.ne[0]} is not a multiple of {block} "
                                 f"({quant.name}); choose --embd/--expert-ffn accordingly")
            t.qtype = quant
        else:
            want = quant_rest
            if (t.role == "embd" or t.rows is not None) and want == GT.IQ3_XXS:
                want = GT.Q4_K
            for q in (want, GT.Q8_0, GT.F16):
                if _fits(q, t.ne[0]):
                    t.qtype = q
                    break


# ---------------------------------------------------------------------------
# GGUF output

_SCALAR_FMT = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h",
    VT.UINT32: "<I", VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<?",
    VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d",
}
ALIGNMENT = 32


def _pack_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _pack_value(vtype: int, value) -> bytes:
    if vtype == VT.STRING:
        return _pack_str(value)
    if vtype == VT.ARRAY:
        sub, items = value
        out = [struct.pack("<IQ", sub, len(items))]
        out += [_pack_value(sub, v) for v in items]
        return b"".join(out)
    return struct.pack(_SCALAR_FMT[vtype], value)


def pack_kv(key: str, vtype: int, value) -> bytes:
    return _pack_str(key) + struct.pack("<I", vtype) + _pack_value(vtype, value)


def walk_kvs(buf, off: int, n_kv: int) -> tuple[list[tuple[str, int, int, int | None]], int]:
    """(key, start, end, element count of an array or None) of the n_kv KV pairs of a GGUF header
    in buf from off, and the offset after them; ValueError for an array longer than the file."""
    unpack_q = struct.Struct("<Q").unpack_from

    def skip(vtype: int, pos: int, n: int = 1) -> int:
        if n > len(buf) - pos:
            raise ValueError("an array longer than the file")
        if vtype == VT.STRING:
            for _ in range(n):
                pos += 8 + unpack_q(buf, pos)[0]
            return pos
        return pos + n * struct.calcsize(_SCALAR_FMT[vtype])

    kvs = []
    for _ in range(n_kv):
        start = off
        klen = unpack_q(buf, off)[0]
        key = bytes(buf[off + 8: off + 8 + klen]).decode()
        off += 8 + klen
        vtype = struct.unpack_from("<I", buf, off)[0]
        off += 4
        count = None
        if vtype == VT.ARRAY:
            sub, count = struct.unpack_from("<IQ", buf, off)
            off = skip(sub, off + 12, count)
        else:
            off = skip(vtype, off)
        kvs.append((key, start, off, count))
    return kvs, off


def scan_kvs(path: Path) -> tuple[dict[str, bytes], dict[str, int]]:
    """Raw bytes of every KV pair in a GGUF file, and the element count of each array KV."""
    buf = memoryview(path.read_bytes())
    magic, version, _n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
    if magic != gguf.GGUF_MAGIC or version < 2:
        raise SystemExit(f"{path}: not a GGUF v2+ file")
    kvs, _ = walk_kvs(buf, 24, n_kv)
    raw = {key: bytes(buf[start:end]) for key, start, end, _ in kvs}
    counts = {key: n for key, _, _, n in kvs if n is not None}
    return raw, counts


PARALLEL_MIN_BYTES = 256 << 20
_JOB_TENSORS: list[TensorSpec] = []


def _write_tensor(job: tuple[int, int, int, str]) -> None:
    """Writes tensor i of _JOB_TENSORS at byte `start` of the (pre-sized) file."""
    i, start, seed, path = job
    t = _JOB_TENSORS[i]
    written = 0
    with open(path, "r+b") as f:
        f.seek(start)
        for chunk in tensor_chunks(t, seed):
            f.write(np.ascontiguousarray(chunk).data)
            written += chunk.nbytes
    if written != t.nbytes:
        raise RuntimeError(f"{t.name}: wrote {written} bytes, expected {t.nbytes}")


def gguf_layout(kv_blobs: list[bytes], tensors: list[TensorSpec]) -> tuple[bytes, list[int], int]:
    """The file's header (KVs and tensor infos, padded to the data section), each tensor's offset
    in the data section, and the data section's size."""
    parts = [struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, len(tensors), len(kv_blobs)), *kv_blobs]
    offsets = []
    offset = 0
    for t in tensors:
        info = _pack_str(t.name) + struct.pack("<I", len(t.ne))
        info += b"".join(struct.pack("<Q", n) for n in t.ne)
        info += struct.pack("<IQ", t.qtype, offset)
        parts.append(info)
        offsets.append(offset)
        offset += -(-t.nbytes // ALIGNMENT) * ALIGNMENT
    header = b"".join(parts)
    return header + b"\0" * (-len(header) % ALIGNMENT), offsets, offset


def parse_gguf_header(buf) -> tuple[list[tuple[str, int, int]], list[tuple[str, tuple[int, ...], int, int]], int]:
    """(key, start, end) of every KV pair, (name, ne, type, offset) of every tensor, and the data
    section's start, of the GGUF file in buf (bytes or mmap); raises ValueError on a malformed header."""
    try:
        magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
        if magic != gguf.GGUF_MAGIC or version < 2:
            raise ValueError("not a GGUF v2+ file")
        walked, off = walk_kvs(buf, 24, n_kv)
        kvs = [(key, start, end) for key, start, end, _ in walked]
        unpack_q = struct.Struct("<Q").unpack_from
        infos = []
        for _ in range(n_tensors):
            nlen = unpack_q(buf, off)[0]
            name = bytes(buf[off + 8: off + 8 + nlen]).decode()
            off += 8 + nlen
            n_dims = struct.unpack_from("<I", buf, off)[0]
            ne = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            qtype, offset = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            infos.append((name, tuple(ne), qtype, offset))
    except (struct.error, KeyError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed GGUF header ({e})") from None
    if off > len(buf):
        raise ValueError("truncated GGUF header")
    return kvs, infos, off + (-off % ALIGNMENT)


def write_gguf(path: Path, kv_blobs: list[bytes], tensors: list[TensorSpec], seed: int, jobs: int = 1) -> None:
    """Each tensor's bytes depend only on the seed and its name, so with jobs > 1 worker processes
    write tensors at their offsets in parallel and the file is the same byte for byte."""
    global _JOB_TENSORS
    tmp = path.with_name(path.name + ".tmp")
    header, offsets, size = gguf_layout(kv_blobs, tensors)
    with open(tmp, "wb") as f:
        f.write(header)
        data_start = f.tell()
        # alignment padding stays zero: the file is sized before any tensor is written
        f.truncate(data_start + size)
    # largest first, so no worker is left with a big tensor at the end; alone, in file order
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].nbytes) if jobs > 1 else range(len(tensors))
    work = [(i, data_start + offsets[i], seed, str(tmp)) for i in order]
    _JOB_TENSORS = tensors
    try:
        if jobs > 1:
            import multiprocessing
            # fork: the workers inherit the tensor specs, whose initializers do not pickle
            with multiprocessing.get_context("fork").Pool(jobs) as pool:
                for _ in pool.imap_unordered(_write_tensor, work):
                    pass
        else:
            for job in work:
                _write_tensor(job)
    finally:
        _JOB_TENSORS = []
    os.replace(tmp, path)


def rewrite_mtp_accept(path: Path, m: Model, kv_blobs: list[bytes], seed: int) -> tuple[float, float]:
    """Turn the file at path, written by the same arguments with another --mtp-accept, into the one
    these arguments write: checks that its header is the plan's but for the strata.mtp_accept value,
    then rewrites that value and the tensors in MTP_P_TENSORS in place. Returns (old P, new P)."""
    header, offsets, size = gguf_layout(kv_blobs, m.tensors)
    want_kvs, want_tensors, data_start = parse_gguf_header(header)

    def refuse(why: str):
        raise SystemExit(f"--rewrite-mtp-accept: {path} is not a file these arguments wrote with another "
                         f"--mtp-accept ({why}); write it afresh without --rewrite-mtp-accept")

    if not path.is_file():
        raise SystemExit(f"--rewrite-mtp-accept: {path} does not exist; write it first without --rewrite-mtp-accept")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        try:
            got_kvs, got_tensors, got_start = parse_gguf_header(mm)
        except ValueError as e:
            refuse(str(e))
        got_keys, want_keys = [k for k, _, _ in got_kvs], [k for k, _, _ in want_kvs]
        if MTP_ACCEPT_KEY not in got_keys:
            refuse(f"no {MTP_ACCEPT_KEY} key: written without --mtp-accept")
        if got_keys != want_keys:
            diff = sorted(set(got_keys) ^ set(want_keys)) or ["their order"]
            refuse(f"the keys differ: {', '.join(diff[:5])}")
        value_at = None
        for (key, a, b), (_, wa, wb) in zip(got_kvs, want_kvs, strict=True):
            if key == MTP_ACCEPT_KEY:
                if (a, b) != (wa, wb) or mm[a:b - 4] != header[wa:wb - 4]:
                    refuse(f"{key} is not a FLOAT32")
                value_at = b - 4
            elif mm[a:b] != header[wa:wb]:
                refuse(f"key {key} differs")
        if len(got_tensors) != len(want_tensors):
            refuse(f"{len(got_tensors)} tensors, planned {len(want_tensors)}")
        for got, want in zip(got_tensors, want_tensors, strict=True):
            if got != want:
                refuse(f"tensor {got[0]} (ne, type, offset) {got[1:]}, planned {want[0]} {want[1:]}")
        if got_start != data_start or len(mm) != data_start + size:
            refuse(f"{len(mm)} bytes, planned {data_start + size}")
        # the first rows of every constructed tensor that P does not change: catches files of other code
        for t, off in zip(m.tensors, offsets, strict=True):
            if t.rows is not None and t.name not in MTP_P_TENSORS:
                chunk = np.ascontiguousarray(next(tensor_chunks(t, seed))).tobytes()
                if mm[data_start + off:data_start + off + len(chunk)] != chunk:
                    refuse(f"{t.name} differs from the construction's")
        old = struct.unpack("<f", mm[value_at:value_at + 4])[0]
    new = struct.unpack("<f", header[value_at:value_at + 4])[0]
    with open(path, "r+b") as f:
        # NaN while the tensors are half written: a later rewrite still accepts the file and completes it
        f.seek(value_at)
        f.write(struct.pack("<f", math.nan))
        f.flush()
        os.fsync(f.fileno())
        for t, off in zip(m.tensors, offsets, strict=True):
            if t.name in MTP_P_TENSORS:
                f.seek(data_start + off)
                for chunk in tensor_chunks(t, seed):
                    f.write(np.ascontiguousarray(chunk).data)
        f.flush()
        os.fsync(f.fileno())
        f.seek(value_at)
        f.write(header[value_at:value_at + 4])
        f.flush()
        os.fsync(f.fileno())
    return old, new


# ---------------------------------------------------------------------------

def resolve_hparams(args: argparse.Namespace) -> dict:
    hp = dict(PRESETS[args.arch])
    if args.shape:
        shapes = SHAPES.get(args.arch, {})
        if args.shape not in shapes:
            raise SystemExit(f"unknown shape {args.shape!r} for {args.arch}; known: {', '.join(shapes) or 'none'}")
        hp.update(shapes[args.shape])
    overrides = {
        "n_layer": args.layers, "n_embd": args.embd, "n_expert": args.experts,
        "n_expert_used": args.experts_used, "n_ff_exp": args.expert_ffn, "vocab": args.vocab,
    }
    for key, value in overrides.items():
        if value is not None:
            if key not in hp:
                raise SystemExit(f"{args.arch} has no {key} to override")
            hp[key] = value
    if args.quant_rest is None:
        args.quant_rest = hp.get("quant_rest", "q8_0")
    hp["seed"] = args.seed
    hp["router_skew"] = args.router_skew
    if "n_expert" in hp and not 0 < hp["n_expert_used"] <= hp["n_expert"]:
        raise SystemExit("need 0 < experts-used <= experts")
    return hp


def plan(args: argparse.Namespace) -> tuple[Model, list[bytes], dict]:
    hp = resolve_hparams(args)
    src = llama_src()
    vocab_path = src / "models" / f"ggml-vocab-{hp['vocab']}.gguf"
    if not vocab_path.is_file():
        raise SystemExit(f"vocabulary not found: {vocab_path} (set STRATA_LLAMA_SRC)")
    vocab_kv, counts = scan_kvs(vocab_path)
    tok_kv = {k: v for k, v in vocab_kv.items() if k.startswith("tokenizer.")}
    if hp["template"]:
        template = (src / "models" / "templates" / hp["template"]).read_text(encoding="utf-8")
        tok_kv["tokenizer.chat_template"] = pack_kv("tokenizer.chat_template", VT.STRING, template)
    n_vocab = counts["tokenizer.ggml.tokens"]
    eos = tok_kv.get("tokenizer.ggml.eos_token_id")
    hp["eos_token_id"] = struct.unpack_from("<I", eos, len(eos) - 4)[0] if eos else 0
    if hp["arch"] == "bert":
        # the token type count is a tokenizer key (convert_hf_to_gguf.py: type_vocab_size);
        # BERT vocabularies carry it, others get BERT's 2
        key = "tokenizer.ggml.token_type_count"
        if key in tok_kv:
            hp["n_token_types"] = struct.unpack_from("<I", tok_kv[key], len(tok_kv[key]) - 4)[0]
        else:
            hp["n_token_types"] = 2
            tok_kv[key] = pack_kv(key, VT.UINT32, 2)

    m = Model(arch=hp["arch"], n_layer=hp["n_layer"] + hp.get("n_nextn", 0), bias_channel=hp["bias_channel"])
    BUILDERS[hp["arch"]](m, hp, n_vocab)
    if args.mtp_accept is not None:
        if args.lora_rank is not None:
            raise SystemExit("--mtp-accept writes a model, not a LoRA adapter")
        hp["mtp"] = apply_mtp_accept(m, hp, tok_kv, n_vocab, args.mtp_accept)
    assign_types(m, QUANT_NAMES[args.quant], QUANT_NAMES[args.quant_rest])
    if args.lora_rank is not None:
        return plan_lora(m, args, hp)

    main_type = QUANT_NAMES[args.quant] if any(t.role == "expert" for t in m.tensors) else QUANT_NAMES[args.quant_rest]
    desc = (f"synthetic model written by strata tools/mkmodel.py v{GENERATOR_VERSION}: "
            f"preset={args.arch} shape={args.shape or '-'} seed={args.seed} router_skew={args.router_skew} "
            f"quant={args.quant} quant_rest={args.quant_rest}")
    head = [
        pack_kv("general.architecture", VT.STRING, hp["arch"]),
        pack_kv("general.type", VT.STRING, "model"),
        pack_kv("general.name", VT.STRING, f"strata-synthetic-{args.arch}"),
        pack_kv("general.description", VT.STRING, desc),
        pack_kv("general.file_type", VT.UINT32, int(FILE_TYPES[main_type])),
        pack_kv("general.quantization_version", VT.UINT32, gguf.GGML_QUANT_VERSION),
    ]
    if args.mtp_accept is not None:
        head.append(pack_kv(MTP_ACCEPT_KEY, VT.FLOAT32, args.mtp_accept))  # fixed size: rewritable in place
    blobs = head + [pack_kv(k, t, v) for k, t, v in m.kv] + list(tok_kv.values())
    return m, blobs, hp


LORA_TARGETS = "attn_q,attn_v,ffn_up,ffn_down"


def lora_pairs(m: Model, rank: int, alpha: float, targets: list[str], qtype: int,
               gain: float) -> list[TensorSpec]:
    """lora_a / lora_b for every 2-D blk.N.<target>.weight of the base model m."""
    out = []
    found = set()
    for t in m.tensors:
        parts = t.name.split(".")
        if (len(parts) != 4 or parts[0] != "blk" or parts[2] not in targets or parts[3] != "weight"
                or len(t.ne) != 2 or t.role != "matrix"):
            continue
        found.add(parts[2])
        n_in, n_out = t.ne
        # (alpha/rank) * B A has entry std (alpha/rank) * sqrt(rank) * std_a * std_b = gain * t.std
        std_a = 1.0 / math.sqrt(n_in)
        std_b = gain * t.std * math.sqrt(n_in / rank) * rank / alpha
        out.append(TensorSpec(t.name + ".lora_a", (n_in, rank), "matrix", std=std_a,
                              zero_col0=t.zero_col0, qtype=qtype))
        out.append(TensorSpec(t.name + ".lora_b", (rank, n_out), "matrix", std=std_b,
                              zero_row0=t.zero_row0, row0_period=t.row0_period, qtype=qtype))
    missing = [x for x in targets if x not in found]
    if missing:
        raise SystemExit(f"{m.arch}: no 2-D blk.N.<target>.weight matrices for LoRA target(s) {', '.join(missing)}")
    return out


def plan_lora(m: Model, args: argparse.Namespace, hp: dict) -> tuple[Model, list[bytes], dict]:
    """Turn the planned base model m into the plan of a LoRA adapter for it."""
    rank = args.lora_rank
    alpha = float(args.lora_alpha if args.lora_alpha is not None else rank)
    if rank < 1 or alpha <= 0:
        raise SystemExit("need --lora-rank >= 1 and --lora-alpha > 0")
    targets = [x for x in args.lora_targets.split(",") if x]
    qtype = QUANT_NAMES[args.lora_type]
    lora = Model(arch=m.arch, n_layer=m.n_layer, bias_channel=m.bias_channel)
    lora.tensors = lora_pairs(m, rank, alpha, targets, qtype, args.lora_gain)
    desc = (f"synthetic LoRA adapter written by strata tools/mkmodel.py v{GENERATOR_VERSION}: "
            f"base preset={args.arch} shape={args.shape or '-'} seed={args.seed} vocab={hp['vocab']} "
            f"rank={rank} alpha={alpha:g} targets={','.join(targets)} type={args.lora_type} gain={args.lora_gain:g}")
    blobs = [
        pack_kv("general.architecture", VT.STRING, hp["arch"]),
        pack_kv("general.type", VT.STRING, gguf.GGUFType.ADAPTER),
        pack_kv("general.name", VT.STRING, f"strata-synthetic-{args.arch}-lora"),
        pack_kv("general.description", VT.STRING, desc),
        pack_kv("general.file_type", VT.UINT32, int(FILE_TYPES[qtype])),
        pack_kv(gguf.Keys.Adapter.TYPE, VT.STRING, "lora"),
        pack_kv(gguf.Keys.Adapter.LORA_ALPHA, VT.FLOAT32, alpha),
    ]
    if args.alora_tokens:
        tokens = [int(t) for t in args.alora_tokens.split(",") if t]
        if not tokens or min(tokens) < 0:
            raise SystemExit("--alora-tokens needs token ids >= 0")
        blobs.append(pack_kv("adapter.alora.invocation_tokens", VT.ARRAY, (VT.UINT32, tokens)))
    return lora, blobs, hp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arch", choices=sorted(PRESETS))
    ap.add_argument("--out", type=Path, help="output .gguf file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", help="named hyperparameter set from SHAPES")
    ap.add_argument("--layers", type=int, help="number of (trunk) layers")
    ap.add_argument("--embd", type=int, help="embedding width")
    ap.add_argument("--experts", type=int, help="experts per MoE layer")
    ap.add_argument("--experts-used", type=int, help="experts routed per token")
    ap.add_argument("--expert-ffn", type=int, help="per-expert FFN width")
    ap.add_argument("--router-skew", type=float, default=0.0, help="Zipf exponent of the router bias (0 = uniform)")
    ap.add_argument("--quant", choices=sorted(QUANT_NAMES), default="q8_0", help="type of expert tensors")
    ap.add_argument("--quant-rest", choices=sorted(QUANT_NAMES),
                    help="type of other matrices (default: the preset's, else q8_0)")
    ap.add_argument("--vocab", help="vocabulary name: models/ggml-vocab-<name>.gguf")
    ap.add_argument("--dry-run", action="store_true", help="print the tensor plan and size, write nothing")
    ap.add_argument("--lora-rank", type=int,
                    help="write a LoRA adapter of this rank for the model these arguments describe, not the model")
    ap.add_argument("--lora-alpha", type=float, help="adapter.lora.alpha (default: the rank)")
    ap.add_argument("--lora-targets", default=LORA_TARGETS,
                    help=f"comma-separated blk.N.<target>.weight names to adapt (default {LORA_TARGETS})")
    ap.add_argument("--lora-type", choices=["f32", "f16"], default="f32", help="type of lora_a / lora_b")
    ap.add_argument("--lora-gain", type=float, default=1.0,
                    help="std of the scale-1 weight delta relative to the base matrix's (default 1)")
    ap.add_argument("--alora-tokens", default="",
                    help="comma-separated token ids: an activated LoRA (aLoRA) invoked by them "
                         "(adapter.alora.invocation_tokens)")
    ap.add_argument("--mtp-accept", type=float, metavar="P",
                    help="qwen4exp / qwen35moe-mtp: make the MTP head's greedy draft the main model's next token "
                         "at a fraction P of positions (see 'MTP acceptance' in the module docstring)")
    ap.add_argument("--rewrite-mtp-accept", action="store_true",
                    help="with --mtp-accept: rewrite the existing --out, written by the same arguments with another "
                         "--mtp-accept, in place (only the P-dependent tensors and the strata.mtp_accept key)")
    ap.add_argument("--jobs", type=int,
                    help="processes writing tensors (default: up to 8 for models of 256 MiB or more, else 1); "
                         "the file is the same for any number")
    ap.add_argument("--version", action="version", version=str(GENERATOR_VERSION))
    args = ap.parse_args(argv)
    if args.out is None and not args.dry_run:
        ap.error("--out is required unless --dry-run")
    if args.rewrite_mtp_accept and args.mtp_accept is None:
        ap.error("--rewrite-mtp-accept needs --mtp-accept")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    m, blobs, hp = plan(args)
    total = sum(-(-t.nbytes // ALIGNMENT) * ALIGNMENT for t in m.tensors) + sum(map(len, blobs))
    if args.dry_run:
        for t in m.tensors:
            print(f"{t.name:40s} {t.qtype.name:8s} {str(t.ne):24s} {t.nbytes}")
        print(f"total ~{total / 2**20:.1f} MiB in {len(m.tensors)} tensors")
        return 0
    if args.rewrite_mtp_accept:
        t0 = time.monotonic()
        old, new = rewrite_mtp_accept(args.out, m, blobs, args.seed)
        print(f"rewrote {args.out} in place: {MTP_ACCEPT_KEY} {old:g} -> {new:g}, "
              f"{', '.join(MTP_P_TENSORS)} ({time.monotonic() - t0:.1f} s)")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    jobs = args.jobs or (min(8, os.cpu_count() or 1) if total >= PARALLEL_MIN_BYTES else 1)
    write_gguf(args.out, blobs, m.tensors, args.seed, max(1, jobs))
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB, {len(m.tensors)} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
