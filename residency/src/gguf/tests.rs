use super::*;
use sha2::{Digest, Sha256};

const F32: u32 = 0;
const Q8_0: u32 = 8;
const ARCH: &str = "qwen3moe";

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn preamble(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    put_u32(&mut out, version);
    put_u64(&mut out, n_tensors);
    put_u64(&mut out, n_kv);
    out
}

#[derive(Clone)]
enum Kv {
    U32(u32),
    U64(u64),
    F32(f32),
    Str(String),
    Strs(Vec<String>),
    /// Value type id followed by the encoded value.
    Raw(Vec<u8>),
}

#[derive(Clone)]
struct Tensor {
    name: String,
    ne: Vec<u64>,
    ty: u32,
    offset: Option<u64>,
}

/// A minimal GGUF writer; tensors without an explicit offset are packed in order.
#[derive(Clone)]
struct Writer {
    version: u32,
    alignment: u64,
    kv: Vec<(String, Kv)>,
    tensors: Vec<Tensor>,
}

fn tensor_bytes(t: &Tensor) -> u64 {
    let Some(row) = ggml_type(t.ty).and_then(|g| g.row_bytes(t.ne[0])) else { return 0 };
    t.ne[1..].iter().try_fold(row, |acc, &n| acc.checked_mul(n)).unwrap_or(0)
}

impl Writer {
    fn set(&mut self, key: &str, value: Kv) {
        match self.kv.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.kv.push((key.to_string(), value)),
        }
    }

    fn tensor(&mut self, name: &str) -> &mut Tensor {
        self.tensors.iter_mut().find(|t| t.name == name).expect("test tensor")
    }

    fn remove(&mut self, name: &str) {
        self.tensors.retain(|t| t.name != name);
    }

    fn add(&mut self, name: &str, ty: u32, ne: &[u64]) {
        self.tensors.push(Tensor { name: name.to_string(), ne: ne.to_vec(), ty, offset: None });
    }

    /// The file and the data-section offset of each tensor.
    fn build(&self) -> (Vec<u8>, Vec<u64>) {
        let mut out = preamble(self.version, self.tensors.len() as u64, self.kv.len() as u64);
        for (key, value) in &self.kv {
            put_str(&mut out, key);
            match value {
                Kv::U32(v) => {
                    put_u32(&mut out, 4);
                    put_u32(&mut out, *v);
                }
                Kv::U64(v) => {
                    put_u32(&mut out, 10);
                    put_u64(&mut out, *v);
                }
                Kv::F32(v) => {
                    put_u32(&mut out, 6);
                    out.extend_from_slice(&v.to_le_bytes());
                }
                Kv::Str(s) => {
                    put_u32(&mut out, 8);
                    put_str(&mut out, s);
                }
                Kv::Strs(items) => {
                    put_u32(&mut out, 9);
                    put_u32(&mut out, 8);
                    put_u64(&mut out, items.len() as u64);
                    for s in items {
                        put_str(&mut out, s);
                    }
                }
                Kv::Raw(raw) => out.extend_from_slice(raw),
            }
        }
        let mut offsets = Vec::new();
        let mut next = 0;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            put_u32(&mut out, t.ne.len() as u32);
            for &n in &t.ne {
                put_u64(&mut out, n);
            }
            put_u32(&mut out, t.ty);
            let offset = t.offset.unwrap_or(next);
            next = (offset + tensor_bytes(t)).next_multiple_of(self.alignment);
            put_u64(&mut out, offset);
            offsets.push(offset);
        }
        let data_start = out.len().next_multiple_of(self.alignment as usize);
        out.resize(data_start, 0);
        let data_len = self.tensors.iter().zip(&offsets).map(|(t, &o)| o + tensor_bytes(t)).max().unwrap_or(0);
        out.extend((0..data_len).map(|i| (i * 7 % 251) as u8));
        (out, offsets)
    }

    fn bytes(&self) -> Vec<u8> {
        self.build().0
    }

    fn parse(&self) -> Result<GgufInfo, GgufError> {
        let bytes = self.bytes();
        parse_header(&bytes, bytes.len() as u64)
    }

    fn layout(&self) -> Result<ExpertLayout, GgufError> {
        expert_layout(&self.parse().expect("test file parses"))
    }
}

/// qwen3moe, 2 layers, 4 experts, n_embd 64, n_ff 32; layer 0 split Q8_0, layer 1 fused F32.
fn tiny_moe() -> Writer {
    let mut w = Writer { version: 3, alignment: 32, kv: Vec::new(), tensors: Vec::new() };
    w.set("general.architecture", Kv::Str(ARCH.into()));
    w.set("general.alignment", Kv::U32(32));
    w.set("qwen3moe.block_count", Kv::U32(2));
    w.set("qwen3moe.expert_count", Kv::U32(4));
    w.set("qwen3moe.expert_used_count", Kv::U32(2));
    w.set("qwen3moe.rope.freq_base", Kv::F32(1e6));
    w.set("tokenizer.ggml.tokens", Kv::Strs(vec!["a".into(), "bc".into(), "<0x80>".into()]));
    w.add("token_embd.weight", F32, &[64, 3]);
    w.add("blk.0.ffn_gate_inp.weight", F32, &[64, 4]);
    w.add("blk.0.ffn_gate_exps.weight", Q8_0, &[64, 32, 4]);
    w.add("blk.0.ffn_up_exps.weight", Q8_0, &[64, 32, 4]);
    w.add("blk.0.ffn_down_exps.weight", Q8_0, &[32, 64, 4]);
    w.add("blk.1.ffn_gate_inp.weight", F32, &[64, 4]);
    w.add("blk.1.ffn_gate_up_exps.weight", F32, &[64, 64, 4]);
    w.add("blk.1.ffn_down_exps.weight", F32, &[32, 64, 4]);
    w.add("output_norm.weight", F32, &[64]);
    w
}

fn temp_file(bytes: &[u8]) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    std::io::Write::write_all(&mut file, bytes).expect("write temp file");
    file
}

#[test]
fn valid_file_has_the_expected_layout() {
    let w = tiny_moe();
    let (bytes, offsets) = w.build();
    let info = parse_header(&bytes, bytes.len() as u64).expect("valid file");
    assert_eq!(info.version, 3);
    assert_eq!(info.alignment, 32);
    assert_eq!(info.data_offset % 32, 0);
    assert!(info.data_offset >= info.header_len && info.data_offset - info.header_len < 32);
    assert_eq!(info.get("qwen3moe.rope.freq_base"), Some(&Value::F32(1e6)));
    assert_eq!(info.get("tokenizer.ggml.tokens"), Some(&Value::Array { elem: ValueType::Str, len: 3 }));
    assert_eq!(info.tensors.len(), 9);
    for (t, rel) in info.tensors.iter().zip(&offsets) {
        assert_eq!(t.offset, info.data_offset + rel, "{}", t.name);
    }
    assert_eq!(info.tensor("output_norm.weight").map(|t| (t.n_dims, t.ne)), Some((1, [64, 1, 1, 1])));

    let layout = expert_layout(&info).expect("valid layout");
    assert_eq!((layout.arch.as_str(), layout.n_layer, layout.n_expert, layout.n_expert_used), (ARCH, 2, 4, 2));
    assert_eq!(layout.n_embd, 64);
    assert_eq!(layout.layers.iter().map(|l| (l.layer, l.n_ff)).collect::<Vec<_>>(), [(0, 32), (1, 32)]);

    let l0 = &layout.layers[0];
    let kinds: Vec<MatKind> = l0.mats.iter().map(|m| m.kind).collect();
    assert_eq!(kinds, [MatKind::Gate, MatKind::Up, MatKind::Down]);
    // Q8_0: 34 bytes per 32 elements.
    assert!(l0.mats.iter().all(|m| m.expert_bytes == 2176));
    assert_eq!(l0.expert_bytes(), 3 * 2176);
    let up = l0.mat(MatKind::Up).expect("up");
    let up_info = info.tensor("blk.0.ffn_up_exps.weight").expect("up info");
    assert_eq!(up.offset, up_info.offset);
    assert_eq!(up.ne, [64, 32, 4]);
    assert_eq!(up.expert_range(0), Some(up.offset..up.offset + 2176));
    assert_eq!(up.expert_range(3), Some(up.offset + 3 * 2176..up.offset + 4 * 2176));
    assert_eq!(up.expert_range(3).map(|r| r.end), Some(up_info.data_range().end));
    assert_eq!(up.expert_range(4), None);

    let l1 = &layout.layers[1];
    assert_eq!(l1.mats.iter().map(|m| (m.kind, m.expert_bytes)).collect::<Vec<_>>(), [(MatKind::GateUp, 64 * 64 * 4), (MatKind::Down, 32 * 64 * 4)]);
    assert_eq!(layout.total_expert_bytes(), 4 * (3 * 2176 + 64 * 64 * 4 + 32 * 64 * 4));
    assert_eq!(layout.layer(1), Some(l1));
    assert_eq!(layout.layer(2), None);

    let file = temp_file(&bytes);
    assert_eq!(read_info(file.path()).expect("read_info"), info);
    let (validated, validated_layout) = validate(file.path()).expect("validate");
    assert_eq!((validated, validated_layout), (info, layout));
}

#[test]
fn version_2_and_default_alignment() {
    let mut w = tiny_moe();
    w.version = 2;
    w.kv.retain(|(k, _)| k != ALIGNMENT_KEY);
    let info = w.parse().expect("v2 without general.alignment");
    assert_eq!((info.version, info.alignment), (2, DEFAULT_ALIGNMENT));
    expert_layout(&info).expect("layout");
}

#[test]
fn larger_alignment_is_honoured() {
    let mut w = tiny_moe();
    w.alignment = 4096;
    w.set(ALIGNMENT_KEY, Kv::U32(4096));
    let info = w.parse().expect("aligned to 4096");
    assert_eq!(info.data_offset, 4096);
    assert!(info.tensors.iter().all(|t| t.offset % 4096 == 0));
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = tiny_moe().bytes();
    let full = bytes.len() as u64;
    let info = parse_header(&bytes, full).expect("valid");
    let header_len = info.header_len as usize;
    // Every cut inside the header and the padding; inside the data, a stride plus each tensor's edges.
    let data_cuts = info.tensors.iter().flat_map(|t| [t.offset, t.data_range().end - 1]).map(|n| n as usize);
    let cuts = (0..=info.data_offset as usize).chain((0..bytes.len()).step_by(97)).chain(data_cuts);
    for n in cuts {
        let prefix = &bytes[..n];
        assert!(parse_header(prefix, n as u64).is_err(), "a file cut at {n} bytes parsed");
        let partial = parse_header(prefix, full);
        if n < header_len {
            assert!(matches!(partial, Err(GgufError::NeedMoreBytes { .. })), "prefix {n}: {partial:?}");
        } else {
            assert!(partial.is_ok(), "prefix {n} holds the whole header: {partial:?}");
        }
    }
}

#[test]
fn truncated_data_names_the_tensor() {
    let bytes = tiny_moe().bytes();
    let cut = &bytes[..bytes.len() - 1];
    let err = parse_header(cut, cut.len() as u64).unwrap_err();
    assert!(matches!(&err, GgufError::PastEnd { tensor, .. } if tensor == "output_norm.weight"), "{err}");
    assert!(err.to_string().contains("runs past the end of the file"), "{err}");
    let file = temp_file(cut);
    assert!(matches!(read_info(file.path()), Err(GgufError::PastEnd { .. })));
}

#[test]
fn read_info_reads_the_header_in_growing_steps() {
    let mut w = tiny_moe();
    let vocab = (0..80_000).map(|i| format!("token-{i}")).collect();
    w.set("tokenizer.ggml.tokens", Kv::Strs(vocab));
    let bytes = w.bytes();
    assert!(bytes.len() as u64 > FIRST_READ);
    let expected = parse_header(&bytes, bytes.len() as u64).expect("valid");
    let file = temp_file(&bytes);
    assert_eq!(read_info(file.path()).expect("default first read"), expected);
    assert_eq!(read_info_from(file.path(), 1).expect("one byte first"), expected);
    let empty = temp_file(&[]);
    assert!(matches!(read_info(empty.path()), Err(GgufError::Truncated { .. })));
    assert!(matches!(read_info(Path::new("/nonexistent/model.gguf")), Err(GgufError::Io { .. })));
}

#[test]
fn huge_lengths_and_counts_fail_without_allocating() {
    let mut key = preamble(3, 0, 1);
    put_u64(&mut key, 1 << 60);
    key.extend_from_slice(&[0; 32]);
    assert!(matches!(parse_header(&key, key.len() as u64), Err(GgufError::Truncated { need, .. }) if need == 1 << 60));

    let mut value = preamble(3, 0, 1);
    put_str(&mut value, "general.name");
    put_u32(&mut value, 8);
    put_u64(&mut value, u64::MAX);
    assert!(matches!(parse_header(&value, value.len() as u64), Err(GgufError::Truncated { .. })));

    let tensors = preamble(3, 1 << 40, 0);
    let err = parse_header(&tensors, tensors.len() as u64).unwrap_err();
    assert!(matches!(&err, GgufError::CountTooLarge { count, .. } if *count == 1 << 40), "{err}");
    assert!(err.to_string().contains("tensor count"), "{err}");
    let kvs = preamble(3, 0, u64::MAX);
    assert!(matches!(parse_header(&kvs, kvs.len() as u64), Err(GgufError::CountTooLarge { .. })));

    for (elem, len) in [(10u32, 1u64 << 61), (8, 1 << 40), (9, u64::MAX), (0, u64::MAX)] {
        let mut array = preamble(3, 0, 1);
        put_str(&mut array, "tokenizer.ggml.tokens");
        put_u32(&mut array, 9);
        put_u32(&mut array, elem);
        put_u64(&mut array, len);
        let err = parse_header(&array, array.len() as u64).unwrap_err();
        assert!(matches!(err, GgufError::CountTooLarge { .. }), "array of type {elem}: {err}");
    }

    let mut name = preamble(3, 1, 0);
    put_u64(&mut name, 1 << 62);
    name.extend_from_slice(&[0; 32]);
    assert!(matches!(parse_header(&name, name.len() as u64), Err(GgufError::Truncated { .. })));
}

fn nested_array(depth: u32) -> Vec<u8> {
    let mut out = preamble(3, 0, 1);
    put_str(&mut out, "nested");
    put_u32(&mut out, 9);
    for _ in 1..depth {
        put_u32(&mut out, 9);
        put_u64(&mut out, 1);
    }
    put_u32(&mut out, 5);
    put_u64(&mut out, 2);
    put_u32(&mut out, 7);
    put_u32(&mut out, 8);
    out
}

#[test]
fn nested_arrays_parse_up_to_a_depth_limit() {
    let ok = nested_array(MAX_ARRAY_DEPTH);
    let info = parse_header(&ok, ok.len() as u64).expect("nested arrays");
    assert_eq!(info.get("nested"), Some(&Value::Array { elem: ValueType::Array, len: 1 }));
    let deep = nested_array(MAX_ARRAY_DEPTH + 1);
    assert!(matches!(parse_header(&deep, deep.len() as u64), Err(GgufError::ArrayTooDeep { .. })));
    let very_deep = nested_array(100_000);
    assert!(matches!(parse_header(&very_deep, very_deep.len() as u64), Err(GgufError::ArrayTooDeep { .. })));
}

#[test]
fn bad_keys_are_rejected() {
    let mut w = tiny_moe();
    w.kv.push(("general.architecture".into(), Kv::Str("llama".into())));
    assert!(matches!(w.parse(), Err(GgufError::DuplicateKey(k)) if k == "general.architecture"));

    let mut w = tiny_moe();
    w.set("", Kv::U32(1));
    assert!(matches!(w.parse(), Err(GgufError::EmptyKey { .. })));

    let mut w = tiny_moe();
    w.set("odd", Kv::Raw(vec![13, 0, 0, 0]));
    assert!(matches!(w.parse(), Err(GgufError::BadValueType { type_id: 13, .. })));

    let mut w = tiny_moe();
    w.set("odd", Kv::Raw(vec![9, 0, 0, 0, 200, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]));
    assert!(matches!(w.parse(), Err(GgufError::BadValueType { type_id: 200, .. })));
}

#[test]
fn bad_alignment_is_rejected() {
    for bad in [0, 3, 48] {
        let mut w = tiny_moe();
        w.set(ALIGNMENT_KEY, Kv::U32(bad));
        assert!(matches!(w.parse(), Err(GgufError::BadAlignment(a)) if a == u64::from(bad)));
    }
    let mut w = tiny_moe();
    w.set(ALIGNMENT_KEY, Kv::U64(32));
    assert!(matches!(w.parse(), Err(GgufError::KeyType { expected: "uint32", found: "uint64", .. })));
}

#[test]
fn bad_versions_and_magic_are_rejected() {
    let mut w = tiny_moe();
    w.version = 1;
    assert!(matches!(w.parse(), Err(GgufError::VersionOne)));
    w.version = 3u32.swap_bytes();
    assert!(matches!(w.parse(), Err(GgufError::BigEndian(_))));
    w.version = 4;
    assert!(matches!(w.parse(), Err(GgufError::UnsupportedVersion(4))));
    w.version = 0;
    assert!(matches!(w.parse(), Err(GgufError::UnsupportedVersion(0))));
    let mut bytes = tiny_moe().bytes();
    bytes[..4].copy_from_slice(b"GGML");
    assert!(matches!(parse_header(&bytes, bytes.len() as u64), Err(GgufError::BadMagic { .. })));
}

#[test]
fn bad_tensor_infos_are_rejected() {
    let mut w = tiny_moe();
    w.tensor("blk.0.ffn_up_exps.weight").offset = Some(16);
    let err = w.parse().unwrap_err();
    assert!(matches!(&err, GgufError::Misaligned { tensor, offset: 16, alignment: 32 } if tensor == "blk.0.ffn_up_exps.weight"));

    let mut w = tiny_moe();
    w.tensor("blk.0.ffn_up_exps.weight").offset = Some(0);
    let err = w.parse().unwrap_err();
    assert!(matches!(&err, GgufError::Overlap { .. }), "{err}");
    assert!(err.to_string().contains("blk.0.ffn_up_exps.weight") && err.to_string().contains("token_embd.weight"));

    let mut w = tiny_moe();
    w.add("output_norm.weight", F32, &[64]);
    assert!(matches!(w.parse(), Err(GgufError::DuplicateTensor(n)) if n == "output_norm.weight"));

    for type_id in [4, 5, 31, 36, 43, 1000] {
        let mut w = tiny_moe();
        w.tensor("output_norm.weight").ty = type_id;
        assert!(matches!(w.parse(), Err(GgufError::UnknownType { type_id: t, .. }) if t == type_id));
    }

    let mut w = tiny_moe();
    w.tensor("blk.0.ffn_up_exps.weight").ne = vec![48, 32, 4];
    let err = w.parse().unwrap_err();
    assert!(matches!(err, GgufError::NotBlockMultiple { ne0: 48, block_size: 32, .. }), "{err}");

    let mut w = tiny_moe();
    w.tensor("output_norm.weight").ne = vec![64, 1, 1, 1, 1];
    assert!(matches!(w.parse(), Err(GgufError::TooManyDims { n_dims: 5, .. })));

    let mut w = tiny_moe();
    w.tensor("output_norm.weight").ne = vec![64, u64::MAX];
    assert!(matches!(w.parse(), Err(GgufError::NegativeDim { dim: 1, value: -1, .. })));

    let mut w = tiny_moe();
    w.tensor("output_norm.weight").ne = vec![1 << 40, 1 << 40];
    assert!(matches!(w.parse(), Err(GgufError::TensorTooLarge { .. })));

    let mut w = tiny_moe();
    w.tensor("output_norm.weight").name = "x".repeat(64);
    assert!(matches!(w.parse(), Err(GgufError::NameTooLong { len: 64, .. })));
}

#[test]
fn past_end_offsets_do_not_overflow() {
    let mut out = preamble(3, 1, 0);
    put_str(&mut out, "t");
    put_u32(&mut out, 1);
    put_u64(&mut out, 32);
    put_u32(&mut out, F32);
    put_u64(&mut out, u64::MAX - 31);
    out.resize(out.len().next_multiple_of(32) + 128, 0);
    for claimed in [out.len() as u64, u64::MAX] {
        assert!(matches!(parse_header(&out, claimed), Err(GgufError::PastEnd { .. })));
    }
}

#[test]
fn bad_expert_shapes_are_rejected() {
    let mut w = tiny_moe();
    for name in ["blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"] {
        w.tensor(name).ne = vec![64, 32, 8];
    }
    w.tensor("blk.0.ffn_down_exps.weight").ne = vec![32, 64, 8];
    let err = w.layout().unwrap_err();
    assert!(matches!(err, GgufError::ExpertShape { .. }), "{err}");
    assert!(err.to_string().contains("8 experts, but the expert count is 4"), "{err}");

    let mut w = tiny_moe();
    w.tensor("blk.0.ffn_gate_exps.weight").ne = vec![64, 64, 4];
    let err = w.layout().unwrap_err();
    assert!(matches!(&err, GgufError::ExpertShape { tensor, .. } if tensor == "blk.0.ffn_gate_exps.weight"), "{err}");

    let mut w = tiny_moe();
    w.tensor("blk.0.ffn_down_exps.weight").ne = vec![64, 32, 4];
    let err = w.layout().unwrap_err();
    assert!(matches!(&err, GgufError::ExpertShape { tensor, .. } if tensor == "blk.0.ffn_down_exps.weight"), "{err}");

    let mut w = tiny_moe();
    w.tensor("blk.1.ffn_gate_up_exps.weight").ne = vec![32, 64, 4];
    w.tensor("blk.1.ffn_down_exps.weight").ne = vec![32, 32, 4];
    let err = w.layout().unwrap_err();
    assert!(err.to_string().contains("earlier layers have 64"), "{err}");

    let mut w = tiny_moe();
    w.tensor("blk.1.ffn_gate_up_exps.weight").ne = vec![64, 63, 4];
    assert!(matches!(w.layout(), Err(GgufError::ExpertShape { .. })));

    let mut w = tiny_moe();
    w.add("blk.1.ffn_up_exps.weight", F32, &[64, 32, 4]);
    assert!(matches!(w.layout(), Err(GgufError::ExpertShape { tensor, .. }) if tensor == "blk.1.ffn_up_exps.weight"));

    let mut w = tiny_moe();
    w.tensor("blk.0.ffn_up_exps.weight").ne = vec![64, 32, 4, 2];
    w.tensor("blk.0.ffn_gate_exps.weight").ne = vec![64, 32, 4, 2];
    let err = w.layout().unwrap_err();
    assert!(err.to_string().contains("not 3-dimensional"), "{err}");
}

#[test]
fn missing_expert_pieces_are_rejected() {
    let mut w = tiny_moe();
    w.remove("blk.0.ffn_down_exps.weight");
    let err = w.layout().unwrap_err();
    assert!(matches!(&err, GgufError::MissingExpertMatrix { layer: 0, missing } if missing == "blk.0.ffn_down_exps.weight"));

    let mut w = tiny_moe();
    w.remove("blk.0.ffn_up_exps.weight");
    assert!(matches!(w.layout(), Err(GgufError::MissingExpertMatrix { layer: 0, missing }) if missing.contains("ffn_up_exps")));

    let mut w = tiny_moe();
    w.remove("blk.0.ffn_gate_exps.weight");
    let layout = w.layout().expect("experts without a gate are fine");
    assert_eq!(layout.layers[0].expert_bytes(), 2 * 2176);

    let mut w = tiny_moe();
    w.add("blk.2.ffn_down_exps.weight", Q8_0, &[32, 64, 4]);
    assert!(matches!(w.layout(), Err(GgufError::LayerOutOfRange { layer: 2, n_layer: 2, .. })));

    let mut w = tiny_moe();
    w.tensors.retain(|t| !t.name.contains("_exps"));
    assert!(matches!(w.layout(), Err(GgufError::NoExperts { .. })));

    let mut w = tiny_moe();
    w.kv.retain(|(k, _)| k != "qwen3moe.expert_count");
    assert!(matches!(w.layout(), Err(GgufError::MissingKey(k)) if k == "qwen3moe.expert_count"));

    let mut w = tiny_moe();
    w.set("qwen3moe.expert_used_count", Kv::U32(5));
    assert!(matches!(w.layout(), Err(GgufError::BadKey { value: 5, .. })));

    let mut w = tiny_moe();
    w.set("general.architecture", Kv::U32(1));
    assert!(matches!(w.layout(), Err(GgufError::KeyType { expected: "string", .. })));

    let mut w = tiny_moe();
    w.tensor("blk.1.ffn_gate_up_exps.weight").name = "blk.01.ffn_gate_up_exps.weight".into();
    w.tensor("blk.1.ffn_down_exps.weight").name = "blk.+1.ffn_down_exps.weight".into();
    assert_eq!(w.layout().expect("odd names are not expert tensors").layers.len(), 1);
}

#[test]
fn model_hash_covers_header_and_routers_only() {
    let w = tiny_moe();
    let (bytes, _) = w.build();
    let hash = |bytes: &[u8]| {
        let file = temp_file(bytes);
        let info = read_info(file.path()).expect("valid");
        (model_sha256(file.path(), &info).expect("hash"), info)
    };
    let (base, info) = hash(&bytes);
    assert_eq!(base.len(), 64);
    assert!(base.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
    assert_eq!(hash(&bytes).0, base);

    let mut header = Vec::new();
    header.extend_from_slice(&bytes[..info.data_offset as usize]);
    for router in ["blk.0.ffn_gate_inp.weight", "blk.1.ffn_gate_inp.weight"] {
        let range = info.tensor(router).expect("router").data_range();
        header.extend_from_slice(&bytes[range.start as usize..range.end as usize]);
    }
    let expected: String = Sha256::digest(&header).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(base, expected);

    let flip = |name: &str| {
        let mut changed = bytes.clone();
        changed[info.tensor(name).expect("tensor").offset as usize] ^= 1;
        hash(&changed).0
    };
    assert_ne!(flip("blk.1.ffn_gate_inp.weight"), base);
    assert_eq!(flip("blk.0.ffn_up_exps.weight"), base);

    let mut renamed = w.clone();
    renamed.set("general.name", Kv::Str("other".into()));
    assert_ne!(hash(&renamed.bytes()).0, base);

    let file = temp_file(&bytes[..bytes.len() - 1]);
    assert!(matches!(model_sha256(file.path(), &info), Err(GgufError::FileChanged { .. })));
}

#[test]
fn type_table_matches_ggml() {
    let removed = [4, 5, 31, 32, 33, 36, 37, 38];
    for id in 0..43 {
        assert_eq!(ggml_type(id).is_some(), !removed.contains(&id), "type {id}");
    }
    assert_eq!(ggml_type(43), None);
    let q4_k = ggml_type(12).expect("q4_K");
    assert_eq!((q4_k.name, q4_k.block_size, q4_k.type_size), ("q4_K", 256, 144));
    assert_eq!(q4_k.row_bytes(512), Some(288));
    assert_eq!(q4_k.row_bytes(100), None);
}

fn models_dir() -> PathBuf {
    std::env::var_os("STRATA_MODELS").map(PathBuf::from).unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/models"))
}

#[test]
fn real_models_validate_when_present() {
    let Ok(entries) = std::fs::read_dir(models_dir()) else { return };
    for path in entries.filter_map(|e| e.ok()).map(|e| e.path()) {
        if path.extension().and_then(|e| e.to_str()) != Some("gguf") {
            continue;
        }
        let info = read_info(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let arch = info.get("general.architecture").and_then(Value::as_str).unwrap_or_default();
        if info.get(&format!("{arch}.expert_count")).is_none() {
            continue;
        }
        let layout = expert_layout(&info).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(!layout.layers.is_empty());
        for m in layout.layers.iter().flat_map(|l| &l.mats) {
            let last = m.expert_range(layout.n_expert - 1).expect("last expert");
            assert_eq!(last.end, info.tensor(&m.name).expect("tensor").data_range().end);
        }
        model_sha256(&path, &info).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}
