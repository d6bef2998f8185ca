"""Tests for tools/mkmodel.py, the synthetic GGUF model writer.

gguf-py's GGUFReader needs many seconds for the 150k-260k token vocabularies,
so the structural checks read copies of each preset written with the small
llama-spm vocabulary; the real vocabularies are checked with mkmodel's own fast
KV scanner.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import servers
from strata_tools import post_json, stop

REPO = Path(__file__).resolve().parents[2]
SERVER = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
UPSTREAM = Path(os.environ.get("STRATA_UPSTREAM_SERVER", REPO / "target" / "upstream" / "bin" / "llama-server"))
try:
    from strata_tools import mkmodel
except (ImportError, FileNotFoundError) as e:  # no llama.cpp source tree with gguf-py
    pytest.skip(f"mkmodel unavailable: {e}", allow_module_level=True)

gguf = mkmodel.gguf
GT = mkmodel.GT
PRESETS = sorted(mkmodel.PRESETS)
SMALL_VOCAB = "llama-spm"


def generate(path: Path, preset: str, *args: str) -> Path:
    assert mkmodel.main([preset, "--out", str(path), *args]) == 0
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Each preset written with the small vocabulary, seed 0, and read back with GGUFReader."""
    d = tmp_path_factory.mktemp("small")
    return {p: gguf.GGUFReader(generate(d / f"{p}.gguf", p, "--vocab", SMALL_VOCAB)) for p in PRESETS}


def kv(reader, key):
    return reader.fields[key].contents()


def tensors(reader):
    return {t.name: t for t in reader.tensors}


def dequant(t) -> np.ndarray:
    x = gguf.quants.dequantize(t.data, t.tensor_type)
    return x.reshape(tuple(int(n) for n in reversed(t.shape)))


EXPECTED = {
    "qwen3moe": dict(arch="qwen3moe", kv={"qwen3moe.expert_count": 16, "qwen3moe.expert_used_count": 4,
                                          "qwen3moe.expert_feed_forward_length": 64, "qwen3moe.block_count": 4},
                     tensors=["blk.3.ffn_gate_exps.weight", "blk.0.attn_q_norm.weight", "output.weight"]),
    "llama": dict(arch="llama", kv={"llama.block_count": 4, "llama.feed_forward_length": 128},
                  tensors=["blk.3.ffn_down.weight", "output.weight"]),
    "gemma4": dict(arch="gemma4", kv={"gemma4.embedding_length_per_layer_input": 8,
                                      "gemma4.attention.shared_kv_layers": 2,
                                      "gemma4.attention.sliding_window_pattern": [True, False, True, False]},
                   tensors=["per_layer_token_embd.weight", "per_layer_model_proj.weight", "rope_freqs.weight",
                            "blk.3.inp_gate.weight", "blk.3.proj.weight", "blk.3.post_norm.weight"]),
    "gemma3n": dict(arch="gemma3n", kv={"gemma3n.embedding_length_per_layer_input": 256, "gemma3n.block_count": 2,
                                        "gemma3n.attention.sliding_window_pattern": [True, True]},
                    tensors=["per_layer_token_embd.weight", "altup_proj.weight", "altup_unembd_proj.weight",
                             "blk.1.altup_predict_coef.weight", "blk.1.laurel_l.weight", "blk.1.inp_gate.weight"]),
    "qwen35moe-mtp": dict(arch="qwen35moe", kv={"qwen35moe.block_count": 5, "qwen35moe.nextn_predict_layers": 1,
                                                "qwen35moe.full_attention_interval": 4,
                                                "qwen35moe.rope.dimension_sections": [3, 3, 2, 0]},
                          tensors=["blk.0.ssm_a", "blk.0.ssm_conv1d.weight", "blk.3.attn_q.weight",
                                   "blk.4.nextn.eh_proj.weight", "blk.4.nextn.enorm.weight",
                                   "blk.4.nextn.hnorm.weight", "blk.4.ffn_gate_exps.weight"]),
    "qwen4exp": dict(arch="qwen4exp", kv={"qwen4exp.block_count": 5, "qwen4exp.nextn_predict_layers": 1,
                                          "qwen4exp.hyper_connection.count": 4,
                                          "qwen4exp.attention.compress_ratios": [0, 0, 0, 4, 4],
                                          "qwen4exp.ple.layers": [1]},
                     tensors=["per_layer_token_embd.weight", "output_hc_norm.weight", "blk.1.ple_conv1d.weight",
                              "blk.3.indexer.k_proj.weight", "blk.4.nextn.hc_head_up.weight"]),
    "bert": dict(arch="bert", kv={"bert.block_count": 2, "bert.pooling_type": 1, "bert.attention.causal": False,
                                  "bert.context_length": 512, "tokenizer.ggml.token_type_count": 2},
                 tensors=["token_types.weight", "position_embd.weight", "token_embd_norm.bias",
                          "blk.1.attn_q.bias", "blk.1.layer_output_norm.bias"]),
    "bert-rerank": dict(arch="bert", kv={"bert.pooling_type": 4, "bert.attention.causal": False,
                                         "bert.classifier.output_labels": ["LABEL_0"]},
                        tensors=["cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias"]),
}

# f32 by convention although they are matrices (convert_hf_to_gguf.py keeps them f32)
F32_MATRICES = ("position_embd.weight", "token_types.weight")
# gemma3n's altup mixing coefficients: tiny matrices kept f32
F32_SUFFIXES = ("altup_correct_coef.weight", "altup_predict_coef.weight")


@pytest.mark.parametrize("preset", PRESETS)
def test_structure(small, preset):
    r = small[preset]
    exp = EXPECTED[preset]
    assert kv(r, "general.architecture") == exp["arch"]
    for key, value in exp["kv"].items():
        assert kv(r, key) == value, key
    ts = tensors(r)
    for name in exp["tensors"]:
        assert name in ts, name
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    assert int(ts["token_embd.weight"].shape[1]) == n_vocab
    for t in r.tensors:
        if ".ffn_gate_inp." in t.name or len(t.shape) == 1 or "conv1d" in t.name or t.name in F32_MATRICES or t.name.endswith(F32_SUFFIXES):
            assert t.tensor_type == GT.F32, t.name
        elif "_exps." in t.name:
            assert t.tensor_type == GT.Q8_0, t.name
        else:
            assert t.tensor_type in (GT.Q8_0, GT.F16), t.name
        # every tensor offset is aligned and the data is in the file
        assert t.data_offset % 32 == 0


@pytest.mark.parametrize("preset", PRESETS)
def test_weights_finite_and_scaled(small, preset):
    model, _, _ = mkmodel.plan(mkmodel.parse_args([preset, "--vocab", SMALL_VOCAB, "--dry-run"]))
    target = {t.name: t.std for t in model.tensors}
    for t in small[preset].tensors:
        x = dequant(t)
        assert np.isfinite(x).all(), t.name
        if t.name.endswith("norm.weight"):
            assert np.all(x == 1.0), t.name
        elif t.tensor_type != GT.F32 and t.name != "token_embd.weight" and x.size >= 1024:
            nz = x[x != 0]
            assert abs(nz.std() / target[t.name] - 1) < 0.15, t.name


@pytest.mark.parametrize("preset", PRESETS)
def test_real_vocab_copied(tmp_path, preset):
    path = generate(tmp_path / "m.gguf", preset)
    hp = mkmodel.PRESETS[preset]
    src_kv, src_counts = mkmodel.scan_kvs(mkmodel.llama_src() / "models" / f"ggml-vocab-{hp['vocab']}.gguf")
    out_kv, out_counts = mkmodel.scan_kvs(path)
    tok_keys = [k for k in src_kv if k.startswith("tokenizer.")]
    assert "tokenizer.ggml.tokens" in tok_keys and "tokenizer.ggml.model" in tok_keys
    for key in tok_keys:
        if key == "tokenizer.chat_template" and hp["template"]:
            continue
        assert out_kv[key] == src_kv[key], key
    assert out_counts["tokenizer.ggml.tokens"] == src_counts["tokenizer.ggml.tokens"]
    if hp["template"]:
        template = (mkmodel.llama_src() / "models" / "templates" / hp["template"]).read_text(encoding="utf-8")
        assert out_kv["tokenizer.chat_template"].endswith(template.encode())


@pytest.mark.parametrize("preset", PRESETS)
def test_deterministic(tmp_path, preset):
    a = generate(tmp_path / "a.gguf", preset, "--vocab", SMALL_VOCAB, "--seed", "7").read_bytes()
    b = generate(tmp_path / "b.gguf", preset, "--vocab", SMALL_VOCAB, "--seed", "7").read_bytes()
    c = generate(tmp_path / "c.gguf", preset, "--vocab", SMALL_VOCAB, "--seed", "8").read_bytes()
    assert a == b
    assert len(a) == len(c) and a != c


def router_tensors(reader):
    return {t.name: dequant(t) for t in reader.tensors if t.name.endswith("ffn_gate_inp.weight")}


def test_router_skew(tmp_path):
    skew = 1.5
    flat = router_tensors(gguf.GGUFReader(generate(tmp_path / "s0.gguf", "qwen3moe", "--vocab", SMALL_VOCAB)))
    skewed = router_tensors(gguf.GGUFReader(
        generate(tmp_path / "s1.gguf", "qwen3moe", "--vocab", SMALL_VOCAB, "--router-skew", str(skew))))
    n_embd = mkmodel.PRESETS["qwen3moe"]["n_embd"]
    x0 = mkmodel.bias_channel_x0(n_embd)
    assert 1.8 < x0 < 2.0
    for il in range(4):
        name = f"blk.{il}.ffn_gate_inp.weight"
        w0, w1 = flat[name], skewed[name]          # (n_expert, n_embd)
        assert np.all(w0[:, 0] == 0)
        np.testing.assert_array_equal(w0[:, 1:], w1[:, 1:])
        b = w1[:, 0] * x0                          # the documented logit bias b_e
        ranks = mkmodel.router_ranks(0, il, w1.shape[0])
        np.testing.assert_allclose(b, -skew * np.log1p(ranks), rtol=1e-5, atol=1e-6)
        # the bias dominates the random part of the logit for the least popular experts
        assert b.max() == 0 and b.min() < -3


def test_mtp_layer_has_no_skew(tmp_path):
    r = gguf.GGUFReader(generate(tmp_path / "m.gguf", "qwen35moe-mtp", "--vocab", SMALL_VOCAB, "--router-skew", "1"))
    routers = router_tensors(r)
    assert np.all(routers["blk.4.ffn_gate_inp.weight"][:, 0] == 0)
    assert routers["blk.0.ffn_gate_inp.weight"][:, 0].min() < 0


def test_bias_channel(small):
    ts = tensors(small["qwen3moe"])
    embd = dequant(ts["token_embd.weight"])
    np.testing.assert_allclose(embd[:, 0], 2.0, rtol=0.01)  # q8_0 rounding
    for name, t in ts.items():
        x = dequant(t)
        if name.endswith(("attn_output.weight", "ffn_down_exps.weight")):
            assert np.all(x[..., 0, :] == 0), name   # output row 0 of every (expert) matrix
        if name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight", "gate_exps.weight", "up_exps.weight")):
            assert np.all(x[..., 0] == 0), name      # input column 0


@pytest.mark.parametrize("qname", ["q8_0", "q4_k", "iq3_xxs", "f16", "f32"])
def test_random_blocks(qname):
    qtype = mkmodel.QUANT_NAMES[qname]
    rng = np.random.default_rng(0)
    std = 0.02
    data = mkmodel.random_blocks(qtype, rng, 256, 512, std).reshape(256, -1)
    assert data.nbytes == 256 * 512 // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1]
    x = gguf.quants.dequantize(data, qtype)
    assert np.isfinite(x).all()
    assert abs(x.std() / std - 1) < 0.05
    assert abs(x.mean()) < 0.2 * std
    mkmodel.zero_first_element(qtype, data)
    first = gguf.quants.dequantize(data, qtype)[:, 0]
    if qtype == GT.IQ3_XXS:  # no zero code: the smallest grid entry instead
        assert np.abs(first).mean() < 0.2 * np.abs(x).mean()
    else:
        assert np.all(first == 0)


@pytest.mark.parametrize("qname", ["q8_0", "q4_k"])
def test_float_quantizers_round_trip(qname):
    qtype = mkmodel.QUANT_NAMES[qname]
    x = np.random.default_rng(1).standard_normal((64, 512)).astype(np.float32)
    x[:, 0] = 2.0
    y = gguf.quants.dequantize(mkmodel.encode_floats(qtype, x).reshape(64, -1), qtype)
    tol = {"q8_0": 0.01, "q4_k": 0.12}[qname]
    assert np.sqrt(np.mean((y - x) ** 2)) < tol
    if qtype == GT.Q8_0:
        np.testing.assert_allclose(y, gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype), atol=1e-6)


def test_kquant_experts(tmp_path):
    path = generate(tmp_path / "k.gguf", "qwen3moe", "--vocab", SMALL_VOCAB, "--layers", "2", "--embd", "256",
                    "--expert-ffn", "256", "--quant", "iq3_xxs", "--quant-rest", "q4_k")
    ts = tensors(gguf.GGUFReader(path))
    assert ts["blk.1.ffn_down_exps.weight"].tensor_type == GT.IQ3_XXS
    assert ts["blk.1.attn_q.weight"].tensor_type == GT.Q4_K
    assert ts["token_embd.weight"].tensor_type == GT.Q4_K
    with pytest.raises(SystemExit):
        generate(tmp_path / "bad.gguf", "qwen3moe", "--vocab", SMALL_VOCAB, "--quant", "iq3_xxs")


def test_big_shape_plan(capsys):
    assert mkmodel.main(["qwen3moe", "--shape", "80b-a3b", "--quant", "iq3_xxs", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "blk.47.ffn_down_exps.weight" in out and "(512, 2048, 512)" in out
    size_mib = float(out.strip().splitlines()[-1].split("~")[1].split()[0])
    assert 25_000 < size_mib < 35_000


def qwen4exp_loader_shapes(hp: dict, n_vocab: int, ple_rows: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (ne, reshapable) of every tensor llama.cpp's qwen4exp load_arch_tensors creates
    (src/models/qwen4exp.cpp); a reshapable one may be stored with the same element count."""
    e, hc, lr = hp["n_embd"], hp["hc_count"], hp["hc_low_rank"]
    hcd = hc * e
    hd, nh, nkv = hp["head_dim"], hp["n_head"], hp["n_head_kv"]
    d_state, nk, nv = hp["ssm_d_state"], hp["ssm_n_group"], hp["ssm_dt_rank"]
    key_dim, value_dim = d_state * nk, d_state * nv
    n_exp, ff, ff_sh = hp["n_expert"], hp["n_ff_exp"], hp["n_ff_shexp"]
    idx_nh, idx_dim = hp["indexer_n_head"], hp["indexer_head_dim"]
    ple_dim = e // ((hp["ple_ngram_size"] - 1) * hp["ple_heads_per_ngram"])
    n_layer = hp["n_layer"]

    def mixer(p):
        return {p + "_norm.weight": ((e, hc), True), p + "_down.weight": ((hcd, lr), False),
                p + "_up.weight": ((lr, hcd), False)}

    s = {"token_embd.weight": ((e, n_vocab), False), "output.weight": ((e, n_vocab), False),
         "per_layer_token_embd.weight": ((ple_dim, ple_rows), False), **mixer("output_hc")}
    for il in range(n_layer + hp["n_nextn"]):
        p = f"blk.{il}."
        for m in ("hc_attn", "hc_ffn"):
            s.update(mixer(p + m))
            s[p + m + "_inject.weight"] = ((hcd, hc), False)
        if il >= n_layer or (il + 1) % hp["full_attn_interval"] == 0:
            s.update({p + "attn_q.weight": ((e, hd * nh * 2), False), p + "attn_k.weight": ((e, hd * nkv), False),
                      p + "attn_v.weight": ((e, hd * nkv), False), p + "attn_output.weight": ((hd * nh, e), False),
                      p + "attn_q_norm.weight": ((hd,), False), p + "attn_k_norm.weight": ((hd,), False),
                      p + "indexer.q_proj.weight": ((e, idx_nh * idx_dim), False),
                      p + "indexer.k_proj.weight": ((e, idx_dim), False),
                      p + "indexer.q_norm.weight": ((idx_dim,), False), p + "indexer.k_norm.weight": ((idx_dim,), False)})
        else:
            s.update({p + "attn_qkv.weight": ((e, 2 * key_dim + value_dim), False),
                      p + "attn_gate.weight": ((e, value_dim), False),
                      p + "ssm_conv1d.weight": ((hp["ssm_d_conv"], 2 * key_dim + value_dim), False),
                      p + "ssm_dt.bias": ((nv,), False), p + "ssm_a": ((nv,), False),
                      p + "ssm_beta.weight": ((e, nv), False), p + "ssm_alpha.weight": ((e, nv), False),
                      p + "ssm_norm.weight": ((d_state,), False), p + "ssm_out.weight": ((value_dim, e), False)})
        if il == hp["ple_layer"]:
            s.update({p + "ple_key.weight": ((e, hcd), False), p + "ple_value.weight": ((e, e), False),
                      p + "ple_norm_key.weight": ((e, hc), True), p + "ple_norm_query.weight": ((e, hc), True),
                      p + "ple_norm_conv.weight": ((e, hc), True),
                      p + "ple_conv1d.weight": ((hp["ple_conv_kernel"], hcd), False)})
        s.update({p + "ffn_gate_inp.weight": ((e, n_exp), False), p + "ffn_down_exps.weight": ((ff, e, n_exp), False),
                  p + "ffn_gate_exps.weight": ((e, ff, n_exp), False), p + "ffn_up_exps.weight": ((e, ff, n_exp), False),
                  p + "ffn_gate_inp_shexp.weight": ((e,), False), p + "ffn_gate_shexp.weight": ((e, ff_sh), False),
                  p + "ffn_up_shexp.weight": ((e, ff_sh), False), p + "ffn_down_shexp.weight": ((ff_sh, e), False)})
        if il >= n_layer:
            s.update({p + "nextn.eh_proj.weight": ((2 * e, e), False), p + "nextn.enorm.weight": ((e,), False),
                      p + "nextn.hnorm.weight": ((e, hc), True), **mixer(p + "nextn.hc_head")})
    return s


def test_qwen4exp_matches_loader(small):
    """every tensor and key that llama.cpp's qwen4exp loader requires, with the shapes and types it checks."""
    r = small["qwen4exp"]
    hp = dict(mkmodel.PRESETS["qwen4exp"])
    a = "qwen4exp."
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    n_heads = (hp["ple_ngram_size"] - 1) * hp["ple_heads_per_ngram"]

    # the PLE arrays must be uint64 (the loader reads them at that width), the rest 32-bit
    for key in ("ple.layer_multipliers", "ple.head_offsets", "ple.head_vocab_sizes"):
        assert r.fields[a + key].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT64], key
    for key in ("attention.compress_ratios", "ple.layers"):
        assert r.fields[a + key].types[1] in (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32), key
    mult, offsets, sizes = (kv(r, a + k) for k in ("ple.layer_multipliers", "ple.head_offsets", "ple.head_vocab_sizes"))
    assert len(mult) == hp["ple_ngram_size"] and all(m % 2 == 1 and m < 1 << 45 for m in mult)
    assert len(offsets) == len(sizes) == n_heads
    assert offsets == [sum(sizes[:h]) for h in range(n_heads)]
    assert all(mkmodel.is_prime(n) and n < hp["ple_head_rows"] for n in sizes) and len(set(sizes)) == n_heads
    ple_dim = kv(r, a + "embedding_length_per_layer_input")
    assert ple_dim * n_heads == hp["n_embd"]   # the PLE key/value projections read n_heads rows of ple_dim
    assert kv(r, a + "ple.eos_token_id") == kv(r, "tokenizer.ggml.eos_token_id")
    for key in ("ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
                "hyper_connection.low_rank", "attention.indexer.head_count", "attention.indexer.key_length",
                "attention.indexer.top_k", "ple.conv_kernel", "expert_shared_feed_forward_length"):
        assert kv(r, a + key) > 0, key
    assert kv(r, a + "hyper_connection.count") > 1
    assert kv(r, a + "attention.indexer.key_length") >= kv(r, a + "rope.dimension_count")
    assert kv(r, a + "attention.indexer.top_k") % 4 == 0
    assert len(kv(r, a + "rope.dimension_sections")) == 4
    # the PLE conv history is a row of the recurrent cache, which only linear layers have
    assert (kv(r, a + "ple.layers")[0] + 1) % kv(r, a + "full_attention_interval") != 0

    want = qwen4exp_loader_shapes(hp, n_vocab, sum(sizes))
    got = {t.name: tuple(int(n) for n in t.shape) for t in r.tensors}
    assert set(got) == set(want)
    for name, (ne, reshapable) in want.items():
        if reshapable:
            assert int(np.prod(got[name])) == int(np.prod(ne)), name
        else:
            assert got[name] == ne, name
    assert "output_norm.weight" not in got


def test_qwen4exp_bias_channel(tmp_path):
    """stream channel 0 keeps the bias value through the mixers, and the routers see half of X0."""
    skew = 1.0
    ts = tensors(gguf.GGUFReader(generate(tmp_path / "q.gguf", "qwen4exp", "--vocab", SMALL_VOCAB,
                                          "--router-skew", str(skew))))
    hp = mkmodel.PRESETS["qwen4exp"]
    e, hc = hp["n_embd"], hp["hc_count"]
    x0 = 0.5 * mkmodel.bias_channel_x0(e)
    for il in range(hp["n_layer"] + hp["n_nextn"]):
        p = f"blk.{il}."
        for m in ("hc_attn", "hc_ffn"):
            up = dequant(ts[p + m + "_up.weight"])                   # (hc * n_embd, low_rank)
            assert np.all(up[::e] == 0) and up.reshape(hc, e, -1)[:, 1:].std() > 0
        for name in ("ssm_out", "attn_output", "ple_value", "ffn_down_shexp"):
            if p + name + ".weight" in ts:
                assert np.all(dequant(ts[p + name + ".weight"])[0] == 0), p + name
        assert np.all(dequant(ts[p + "ffn_down_exps.weight"])[:, 0, :] == 0)
        for name in ("attn_qkv", "attn_q", "indexer.q_proj", "indexer.k_proj", "ffn_gate_exps", "ffn_up_shexp"):
            if p + name + ".weight" in ts:
                assert np.all(dequant(ts[p + name + ".weight"])[..., 0] == 0), p + name
        router = dequant(ts[p + "ffn_gate_inp.weight"])
        if il < hp["n_layer"]:
            ranks = mkmodel.router_ranks(0, il, hp["n_expert"])
            np.testing.assert_allclose(router[:, 0] * x0, -skew * np.log1p(ranks), rtol=1e-5, atol=1e-6)
        else:
            assert np.all(router[:, 0] == 0)


def test_qwen4exp_big_shape_plan(capsys):
    assert mkmodel.main(["qwen4exp", "--shape", "80b-a3b", "--quant", "iq3_xxs", "--dry-run"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.strip().splitlines()[:-1]}
    assert "(512, 2048, 512)" in rows["blk.47.ffn_down_exps.weight"]
    assert "blk.48.nextn.eh_proj.weight" in rows and "blk.47.indexer.k_proj.weight" in rows
    assert "blk.1.ple_conv1d.weight" in rows
    ple_bytes = int(rows["per_layer_token_embd.weight"].split()[-1])
    assert ple_bytes > 4 * 2**30
    size_mib = float(out.strip().splitlines()[-1].split("~")[1].split()[0])
    assert 30_000 < size_mib < 40_000


def test_qwen4exp_loads_and_generates(tmp_path):
    """the pin's llama.cpp (through strata-server) loads the tiny preset, MTP block included, and generates."""
    if not SERVER.exists():
        pytest.skip("strata-server is not built (run tools/setup)")
    model = generate(tmp_path / "q.gguf", "qwen4exp", "--seed", "10")
    log = tmp_path / "server.log"
    with open(log, "wb") as err:
        proc, url = servers.start(SERVER, ["-m", str(model), "-c", "512", "-t", "2", "--spec-type", "draft-mtp"],
                                  stderr=err)
        try:
            # longer than the QSA budget, so the indexer selects
            prompt = " ".join(f"word{i}" for i in range(60))
            out = post_json(url + "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0}, timeout=300)
        finally:
            stop(proc)
    assert out["tokens_predicted"] == 8 and out["content"]
    assert out["tokens_evaluated"] > mkmodel.PRESETS["qwen4exp"]["indexer_top_k"]
    text = log.read_text(errors="replace")
    assert "unused tensor" not in text and "missing tensor" not in text


def bert_tensor_shapes(n_vocab: int, rank: bool) -> dict[str, tuple[int, ...]]:
    """every tensor llama.cpp's bert loader reads for the preset sizes (ggml order)."""
    e, ff = 64, 128
    shapes = {"token_embd.weight": (e, n_vocab), "token_types.weight": (e, 2), "position_embd.weight": (e, 512),
              "token_embd_norm.weight": (e,), "token_embd_norm.bias": (e,)}
    for il in range(2):
        p = f"blk.{il}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            shapes[p + name + ".weight"] = (e, e)
            shapes[p + name + ".bias"] = (e,)
        for name in ("attn_output_norm", "layer_output_norm"):
            shapes[p + name + ".weight"] = (e,)
            shapes[p + name + ".bias"] = (e,)
        shapes.update({p + "ffn_up.weight": (e, ff), p + "ffn_up.bias": (ff,),
                       p + "ffn_down.weight": (ff, e), p + "ffn_down.bias": (e,)})
    if rank:
        shapes.update({"cls.weight": (e, e), "cls.bias": (e,), "cls.output.weight": (e, 1), "cls.output.bias": (1,)})
    return shapes


@pytest.mark.parametrize("preset", ["bert", "bert-rerank"])
def test_bert(small, preset):
    r = small[preset]
    rank = preset == "bert-rerank"
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    got = {t.name: tuple(int(n) for n in t.shape) for t in r.tensors}
    assert got == bert_tensor_shapes(n_vocab, rank)
    for key, value in {"bert.embedding_length": 64, "bert.feed_forward_length": 128,
                       "bert.attention.head_count": 2, "bert.pooling_type": 4 if rank else 1,
                       "bert.attention.causal": False}.items():
        assert kv(r, key) == value, key
    assert kv(r, "bert.attention.layer_norm_epsilon") == pytest.approx(1e-12)
    assert ("bert.classifier.output_labels" in r.fields) == rank
    assert "bert.attention.head_count_kv" not in r.fields and "output.weight" not in got
    ts = tensors(r)
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        assert ts[name].tensor_type == GT.F16, name
    for t in r.tensors:
        x = dequant(t)
        if t.name.endswith(".bias"):   # random, so a dropped bias shows
            assert x.std() > 0.05 or x.size == 1, t.name


def test_bert_real_vocab(tmp_path):
    path = generate(tmp_path / "b.gguf", "bert-rerank", "--seed", "3")
    raw, counts = mkmodel.scan_kvs(path)
    src, _ = mkmodel.scan_kvs(mkmodel.llama_src() / "models" / "ggml-vocab-bert-bge.gguf")
    assert raw["tokenizer.ggml.model"].endswith(b"bert")
    for key in ("tokenizer.ggml.cls_token_id", "tokenizer.ggml.seperator_token_id", "tokenizer.ggml.padding_token_id",
                "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.mask_token_id", "tokenizer.ggml.token_type",
                "tokenizer.ggml.token_type_count"):
        assert raw[key] == src[key], key
    assert counts["tokenizer.ggml.tokens"] == 30522
    assert mkmodel.main(["bert", "--quant-rest", "q8_0", "--vocab", SMALL_VOCAB, "--out", str(tmp_path / "q.gguf")]) == 0
    ts = tensors(gguf.GGUFReader(tmp_path / "q.gguf"))
    assert ts["blk.0.attn_q.weight"].tensor_type == GT.Q8_0
    assert ts["position_embd.weight"].tensor_type == GT.F32


LORA_TARGETS = ("attn_q", "attn_v", "ffn_up", "ffn_down")


def check_lora_against_base(adapter, base, rank: int, alpha: float, targets=LORA_TARGETS) -> None:
    """the adapter is what llama.cpp's llama_adapter_lora_init_impl accepts for this base model."""
    assert kv(adapter, "general.type") == "adapter"
    assert kv(adapter, "adapter.type") == "lora"
    assert kv(adapter, "adapter.lora.alpha") == pytest.approx(alpha)
    assert kv(adapter, "general.architecture") == kv(base, "general.architecture")
    assert not any(k.startswith("tokenizer.") for k in adapter.fields)
    arch = kv(base, "general.architecture")
    n_layer = kv(base, f"{arch}.block_count")
    bts = tensors(base)
    ats = tensors(adapter)
    want = {f"blk.{il}.{t}.weight.lora_{ab}" for il in range(n_layer) for t in targets for ab in "ab"}
    assert set(ats) == want
    for il in range(n_layer):
        for t in targets:
            name = f"blk.{il}.{t}.weight"
            w, a, b = bts[name], ats[name + ".lora_a"], ats[name + ".lora_b"]
            w_ne, a_ne, b_ne = (tuple(int(n) for n in x.shape) for x in (w, a, b))
            # llama-adapter.cpp: w.ne[0] == a.ne[0], w.ne[1] == b.ne[1], a.ne[1] == b.ne[0]
            assert len(w_ne) == 2 and a_ne == (w_ne[0], rank) and b_ne == (rank, w_ne[1]), name
            assert a.tensor_type == b.tensor_type and a.tensor_type in (GT.F32, GT.F16), name
            # the scale-1 delta (alpha/rank) * B A is about as strong as the base matrix
            delta = (alpha / rank) * dequant(b) @ dequant(a)          # (n_out, n_in), like dequant(w)
            x = dequant(w)
            assert delta.shape == x.shape, name
            assert 0.6 < delta[delta != 0].std() / x[x != 0].std() < 1.6, name


@pytest.fixture(scope="module")
def llama_lora(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = generate(d / "base.gguf", "llama", "--vocab", SMALL_VOCAB, "--seed", "2")
    lora = generate(d / "lora.gguf", "llama", "--vocab", SMALL_VOCAB, "--seed", "2",
                    "--lora-rank", "8", "--lora-alpha", "16")
    return gguf.GGUFReader(base), gguf.GGUFReader(lora), lora


def test_lora_adapter_structure(llama_lora):
    base, adapter, path = llama_lora
    check_lora_against_base(adapter, base, rank=8, alpha=16.0)
    assert all(t.tensor_type == GT.F32 for t in adapter.tensors)
    assert kv(adapter, "general.file_type") == int(gguf.LlamaFileType.ALL_F32)
    assert path.stat().st_size < 200_000
    for t in adapter.tensors:
        assert t.data_offset % 32 == 0
        assert np.isfinite(dequant(t)).all() and dequant(t).std() > 0, t.name


def test_lora_adapter_options(tmp_path):
    base = gguf.GGUFReader(generate(tmp_path / "b.gguf", "llama", "--vocab", SMALL_VOCAB, "--layers", "2"))
    args = ["llama", "--vocab", SMALL_VOCAB, "--layers", "2", "--lora-rank", "4", "--lora-type", "f16",
            "--lora-targets", "attn_q,attn_k,attn_output,ffn_gate"]
    a = generate(tmp_path / "a.gguf", *args)
    adapter = gguf.GGUFReader(a)
    check_lora_against_base(adapter, base, rank=4, alpha=4.0,
                            targets=("attn_q", "attn_k", "attn_output", "ffn_gate"))
    assert all(t.tensor_type == GT.F16 for t in adapter.tensors)
    assert generate(tmp_path / "a2.gguf", *args).read_bytes() == a.read_bytes()
    with pytest.raises(SystemExit):
        generate(tmp_path / "bad.gguf", "llama", "--vocab", SMALL_VOCAB, "--lora-rank", "4", "--lora-targets", "nope")


def test_lora_adapter_bias_channel(tmp_path):
    """on a bias-channel preset the adapter neither reads nor writes residual channel 0."""
    base = gguf.GGUFReader(generate(tmp_path / "b.gguf", "qwen3moe", "--vocab", SMALL_VOCAB))
    adapter = gguf.GGUFReader(generate(tmp_path / "a.gguf", "qwen3moe", "--vocab", SMALL_VOCAB, "--lora-rank", "4",
                                       "--lora-targets", "attn_q,attn_v,attn_output"))
    check_lora_against_base(adapter, base, rank=4, alpha=4.0, targets=("attn_q", "attn_v", "attn_output"))
    ts = tensors(adapter)
    for il in range(4):
        for t in ("attn_q", "attn_v"):
            assert np.all(dequant(ts[f"blk.{il}.{t}.weight.lora_a"])[:, 0] == 0)
        assert np.all(dequant(ts[f"blk.{il}.attn_output.weight.lora_b"])[0, :] == 0)


def test_mkmodels_lora_entry(tmp_path):
    """tools/mkmodels writes tiny-llama-lora from tiny-llama's arguments and stamps it with them."""
    env = dict(os.environ, STRATA_MODELS=str(tmp_path), STRATA_PYTHON=sys.executable)
    run = lambda: subprocess.run([str(REPO / "tools" / "mkmodels"), "tiny-llama", "tiny-llama-lora"], env=env,
                                 check=True, capture_output=True, text=True).stdout
    run()
    base_stamp = (tmp_path / "tiny-llama.gguf.stamp").read_text().strip()
    lora_stamp = (tmp_path / "tiny-llama-lora.gguf.stamp").read_text().strip()
    assert lora_stamp.startswith(base_stamp + " ") and "--lora-rank" in lora_stamp
    base = gguf.GGUFReader(tmp_path / "tiny-llama.gguf")
    adapter = gguf.GGUFReader(tmp_path / "tiny-llama-lora.gguf")
    check_lora_against_base(adapter, base, rank=8, alpha=16.0)
    assert run().count("up to date") == 2


def test_parallel_writers_give_the_same_file(tmp_path):
    args = ["--vocab", SMALL_VOCAB, "--seed", "3", "--layers", "2", "--embd", "256", "--expert-ffn", "256", "--quant", "iq3_xxs"]
    one = generate(tmp_path / "one.gguf", "qwen3moe", *args, "--jobs", "1").read_bytes()
    three = generate(tmp_path / "three.gguf", "qwen3moe", *args, "--jobs", "3").read_bytes()
    assert len(one) > 1 << 20
    assert one == three
    gguf.GGUFReader(tmp_path / "three.gguf")


# --mtp-accept: the MTP head drafts the main model's next token at a fraction P of positions

MTP_PRESETS = ["qwen4exp", "qwen35moe-mtp"]
MTP_ARGS = ["--vocab", SMALL_VOCAB, "--seed", "4", "--embd", "128", "--expert-ffn", "64"]


def mtp_construction(preset: str, p: float, *args: str) -> mkmodel.MtpAccept:
    _, _, hp = mkmodel.plan(mkmodel.parse_args([preset, *MTP_ARGS, *args, "--mtp-accept", str(p), "--dry-run"]))
    return hp["mtp"]


def test_mtp_accept_cycle():
    c = mtp_construction("qwen4exp", 0.5)
    n = c.n_cycle
    assert n == c.n_vocab - c.n_vocab % 128 and c.shift % 128 == 0
    s = c.sigma(np.arange(c.n_vocab))
    assert sorted(s[:n]) == list(range(n)) and np.all(s[n:] == np.arange(n, c.n_vocab))
    # every cycle visits V' / 128 tokens: sigma^k(t) != t for 0 < k < V' / 128
    t, seen = np.arange(128), np.zeros(n, dtype=np.int64)
    for _ in range(n // 128):
        seen[t] += 1
        t = c.sigma(t)
    assert np.all(seen == 1) and np.array_equal(t, np.arange(128))
    shifts = {mtp_construction("qwen4exp", 0.5, "--seed", str(seed)).shift for seed in range(6)}
    assert len(shifts) > 1


@pytest.mark.parametrize("preset", MTP_PRESETS)
def test_mtp_accept_tensors(tmp_path, preset):
    p = 0.7
    c = mtp_construction(preset, p)
    r = gguf.GGUFReader(generate(tmp_path / "m.gguf", preset, *MTP_ARGS, "--mtp-accept", str(p)))
    assert kv(r, mkmodel.MTP_ACCEPT_KEY) == pytest.approx(p)
    assert r.fields[mkmodel.MTP_ACCEPT_KEY].types == [gguf.GGUFValueType.FLOAT32]
    ts = tensors(r)
    e, h, n = 128, c.h, c.n_cycle
    embd, out = dequant(ts["token_embd.weight"]), dequant(ts["output.weight"])
    np.testing.assert_allclose(embd[:, 0], mkmodel.BIAS_CHANNEL_VALUE, rtol=0.01)
    x, y = embd[:, 1:1 + h], embd[:, 1 + h:1 + 2 * h]
    assert np.all(embd[:, 1 + 2 * h:] == 0) and np.all(embd[n:, 1:] == 0)
    np.testing.assert_allclose(x[:128], c.block(0)[0], atol=0.05)       # q8_0 rounding
    in_s = np.concatenate([c.block(b)[1] for b in range(n // 128)])
    assert abs(in_s.mean() - p) < 0.02
    assert np.array_equal(np.any(y[:n] != 0, axis=1), in_s)
    np.testing.assert_allclose(y[:n][in_s], x[:n][in_s], atol=0.05)
    # lm head row sigma(t) is x_t (scaled): the main model's argmax follows t -> sigma(t)
    sig = c.sigma(np.arange(n))
    live = np.setdiff1d(np.arange(n), c.dead)
    src = np.argsort(sig)[live]                                          # sigma^-1 of each live row
    gain = mkmodel.MTP_OUTPUT_GAIN / np.sqrt(h)
    np.testing.assert_allclose(out[live, 1:1 + h], x[src] * gain, atol=0.05 * gain * np.abs(x).max())
    assert np.all(out[:, 0] == 0) and np.all(out[:, 1 + h:] == 0) and np.all(out[n:] == 0)
    dead = c.dead
    assert len(dead) and kv(r, "tokenizer.ggml.eos_token_id") in dead and np.all(out[dead] == 0)
    # eh_proj: bias channel kept, X <- the Y block of enorm(embedding), nothing from the hidden state
    eh = dequant(ts[f"blk.{mkmodel.PRESETS[preset]['n_layer']}.nextn.eh_proj.weight"])   # (n_embd, 2 n_embd)
    want = np.zeros((e, 2 * e), dtype=np.float32)
    want[0, 0] = 1
    want[np.arange(1, h + 1), np.arange(h + 1, 2 * h + 1)] = 1
    np.testing.assert_allclose(eh, want, atol=1e-3)


@pytest.mark.parametrize("preset", MTP_PRESETS)
def test_mtp_accept_changes_only_its_tensors(tmp_path, preset):
    """every other tensor and key is what the same arguments write without --mtp-accept."""
    a = generate(tmp_path / "plain.gguf", preset, *MTP_ARGS).read_bytes()
    b = generate(tmp_path / "mtp.gguf", preset, *MTP_ARGS, "--mtp-accept", "0.5").read_bytes()
    (kv_a, ts_a, start_a), (kv_b, ts_b, start_b) = mkmodel.parse_gguf_header(a), mkmodel.parse_gguf_header(b)
    keys_a = [k for k, _, _ in kv_a]
    assert [k for k, _, _ in kv_b] == keys_a[:6] + [mkmodel.MTP_ACCEPT_KEY] + keys_a[6:]
    raw_b = {k: b[i:j] for k, i, j in kv_b}
    for key, i, j in kv_a:
        assert a[i:j] == raw_b[key], key
    changed = {"token_embd.weight", "output.weight", f"blk.{mkmodel.PRESETS[preset]['n_layer']}.nextn.eh_proj.weight"}
    assert [t[:3] for t in ts_a] == [t[:3] for t in ts_b]     # names, shapes, types
    ends = [t[3] for t in ts_a[1:]] + [len(a) - start_a]
    for (name, _, _, off_a), (_, _, _, off_b), end in zip(ts_a, ts_b, ends, strict=True):
        n = end - off_a
        same = a[start_a + off_a:start_a + off_a + n] == b[start_b + off_b:start_b + off_b + n]
        assert same != (name in changed), name
    # no option, no construction: the plan is the one the rest of this file checks
    model, blobs, hp = mkmodel.plan(mkmodel.parse_args([preset, *MTP_ARGS, "--dry-run"]))
    assert "mtp" not in hp and all(t.rows is None for t in model.tensors)
    assert not any(mkmodel.MTP_ACCEPT_KEY.encode() in blob for blob in blobs)


def test_mtp_accept_rewrite_in_place(tmp_path, capsys):
    args = ["qwen4exp", *MTP_ARGS]
    path = generate(tmp_path / "m.gguf", *args, "--mtp-accept", "0.5")
    fresh = generate(tmp_path / "fresh.gguf", *args, "--mtp-accept", "0.9").read_bytes()
    assert path.read_bytes() != fresh
    assert mkmodel.main([*args, "--out", str(path), "--mtp-accept", "0.9", "--rewrite-mtp-accept"]) == 0
    assert "0.5 -> 0.9" in capsys.readouterr().out
    assert path.read_bytes() == fresh
    assert mkmodel.main([*args, "--out", str(path), "--mtp-accept", "0", "--rewrite-mtp-accept"]) == 0
    assert path.read_bytes() == generate(tmp_path / "zero.gguf", *args, "--mtp-accept", "0").read_bytes()

    # refused, the file untouched: other arguments, no --mtp-accept in the file, a missing file
    before = path.read_bytes()
    for other in (["--seed", "5"], ["--embd", "256"], ["--router-skew", "1"], ["--layers", "3"]):
        with pytest.raises(SystemExit, match="not a file these arguments wrote"):
            mkmodel.main([*args, *other, "--out", str(path), "--mtp-accept", "0.9", "--rewrite-mtp-accept"])
    assert path.read_bytes() == before
    plain = generate(tmp_path / "plain.gguf", *args)
    plain_bytes = plain.read_bytes()
    with pytest.raises(SystemExit, match="written without --mtp-accept"):
        mkmodel.main([*args, "--out", str(plain), "--mtp-accept", "0.9", "--rewrite-mtp-accept"])
    assert plain.read_bytes() == plain_bytes
    with pytest.raises(SystemExit, match="does not exist"):
        mkmodel.main([*args, "--out", str(tmp_path / "none.gguf"), "--mtp-accept", "0.9", "--rewrite-mtp-accept"])
    # a file with the right header whose constructed tensors are not the construction's
    broken = bytearray(before)
    _, infos, start = mkmodel.parse_gguf_header(bytes(before))
    off = next(o for name, _, _, o in infos if name == "output.weight")
    broken[start + off:start + off + 64] = bytes(64)
    (tmp_path / "broken.gguf").write_bytes(broken)
    with pytest.raises(SystemExit, match="output.weight differs"):
        mkmodel.main([*args, "--out", str(tmp_path / "broken.gguf"), "--mtp-accept", "0.9", "--rewrite-mtp-accept"])


def test_mtp_accept_refusals(tmp_path):
    out = str(tmp_path / "x.gguf")
    for bad in (["qwen3moe", "--mtp-accept", "0.5"],
                ["qwen4exp", "--mtp-accept", "1.5"],
                ["qwen4exp", "--mtp-accept", "0.5"],                       # the tiny n_embd 64
                ["qwen4exp", "--embd", "128", "--mtp-accept", "0.5", "--lora-rank", "4"]):
        with pytest.raises(SystemExit):
            mkmodel.main([*bad, "--vocab", SMALL_VOCAB, "--out", out])
    with pytest.raises(SystemExit):
        mkmodel.parse_args(["qwen4exp", "--out", out, "--rewrite-mtp-accept"])
    assert not (tmp_path / "x.gguf").exists()


def mtp_acceptance(model: Path, log: Path) -> float:
    """draft_n_accepted / draft_n with one-token drafts and no confidence cut: the per-position rate,
    measured with the pin's llama-server, which drafts every step (strata-server backs off from
    drafts that are never accepted)."""
    with open(log, "wb") as err:
        proc, url = servers.start(UPSTREAM, ["-m", str(model), "-c", "1024", "-t", "2", "--spec-type", "draft-mtp",
                                           "--spec-draft-n-max", "1", "--spec-draft-p-min", "0"], stderr=err)
        try:
            out = post_json(url + "/completion", {"prompt": "Once upon a time", "n_predict": 64, "temperature": 0,
                                                  "cache_prompt": False}, timeout=300)
        finally:
            stop(proc)
    t = out["timings"]
    assert out["tokens_predicted"] == 64 and t["draft_n"] > 20
    return t["draft_n_accepted"] / t["draft_n"]


@pytest.mark.parametrize("preset", MTP_PRESETS)
def test_mtp_accept_through_server(tmp_path, preset):
    """llama.cpp's draft-mtp accepts the drafts at about the rate asked for."""
    if not UPSTREAM.exists():
        pytest.skip("the pin's llama-server is not built (run tools/build-upstream)")
    rates = {}
    for p in (0.0, 0.9):
        model = generate(tmp_path / f"m{p}.gguf", preset, *MTP_ARGS, "--mtp-accept", str(p))
        rates[p] = mtp_acceptance(model, tmp_path / f"server{p}.log")
    assert rates[0.0] < 0.1 and rates[0.9] > 0.7, rates
