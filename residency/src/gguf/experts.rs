//! An MoE model's expert tensors as per-expert byte ranges of the file, and the model's hash.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::Path;

use sha2::{Digest, Sha256};

use super::{ggml_type, io_error, read_info, GgufError, GgufInfo, TensorInfo};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MatKind {
    Gate,
    Up,
    GateUp,
    Down,
}

impl MatKind {
    pub const ALL: [MatKind; 4] = [MatKind::Gate, MatKind::Up, MatKind::GateUp, MatKind::Down];

    /// The tensor name without the `blk.{L}.` prefix.
    pub fn suffix(self) -> &'static str {
        match self {
            MatKind::Gate => "ffn_gate_exps.weight",
            MatKind::Up => "ffn_up_exps.weight",
            MatKind::GateUp => "ffn_gate_up_exps.weight",
            MatKind::Down => "ffn_down_exps.weight",
        }
    }

    fn from_suffix(suffix: &str) -> Option<MatKind> {
        MatKind::ALL.into_iter().find(|k| k.suffix() == suffix)
    }
}

/// One `[ne0, ne1, n_expert]` expert tensor; expert `e` occupies `expert_range(e)` of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertMatrix {
    pub kind: MatKind,
    pub name: String,
    pub ggml_type: u32,
    pub ne: [u64; 3],
    /// Absolute file offset of expert 0.
    pub offset: u64,
    pub expert_bytes: u64,
}

impl ExpertMatrix {
    pub fn expert_range(&self, expert: u32) -> Option<Range<u64>> {
        if u64::from(expert) >= self.ne[2] {
            return None;
        }
        let start = self.offset + u64::from(expert) * self.expert_bytes;
        Some(start..start + self.expert_bytes)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertLayer {
    pub layer: u32,
    pub n_ff: u64,
    /// In [`MatKind::ALL`] order.
    pub mats: Vec<ExpertMatrix>,
}

impl ExpertLayer {
    /// Bytes of one expert of this layer, all its matrices together.
    pub fn expert_bytes(&self) -> u64 {
        self.mats.iter().map(|m| m.expert_bytes).sum()
    }

    pub fn mat(&self, kind: MatKind) -> Option<&ExpertMatrix> {
        self.mats.iter().find(|m| m.kind == kind)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertLayout {
    pub arch: String,
    pub n_layer: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub n_embd: u64,
    /// Only the layers that have experts, ascending.
    pub layers: Vec<ExpertLayer>,
}

impl ExpertLayout {
    pub fn total_expert_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.expert_bytes() * u64::from(self.n_expert)).sum()
    }

    pub fn layer(&self, layer: u32) -> Option<&ExpertLayer> {
        self.layers.iter().find(|l| l.layer == layer)
    }
}

/// Splits `blk.{L}.{suffix}` into `L` and `suffix`; `L` must be written as llama.cpp writes it.
fn block_tensor(name: &str) -> Option<(u32, &str)> {
    let (index, suffix) = name.strip_prefix("blk.")?.split_once('.')?;
    let layer: u32 = index.parse().ok()?;
    (layer.to_string() == index).then_some((layer, suffix))
}

fn is_router(name: &str) -> bool {
    block_tensor(name).is_some_and(|(_, suffix)| suffix == "ffn_gate_inp.weight")
}

/// Maps every MoE layer's expert tensors to per-expert byte ranges, checking their shapes.
pub fn expert_layout(info: &GgufInfo) -> Result<ExpertLayout, GgufError> {
    let arch = info.require_str("general.architecture")?.to_string();
    let n_layer = info.require_u32(&format!("{arch}.block_count"))?;
    let expert_count_key = format!("{arch}.expert_count");
    let n_expert = info.require_u32(&expert_count_key)?;
    if n_expert == 0 {
        return Err(GgufError::BadKey { key: expert_count_key, value: 0, problem: "an MoE model needs experts" });
    }
    let used_key = format!("{arch}.expert_used_count");
    let n_expert_used = info.require_u32(&used_key)?;
    if n_expert_used == 0 || n_expert_used > n_expert {
        return Err(GgufError::BadKey { key: used_key, value: n_expert_used.into(), problem: "it must be between 1 and the expert count" });
    }

    let mut by_layer: BTreeMap<u32, HashMap<MatKind, &TensorInfo>> = BTreeMap::new();
    for tensor in &info.tensors {
        let Some((layer, kind)) = block_tensor(&tensor.name).and_then(|(l, s)| Some((l, MatKind::from_suffix(s)?))) else {
            continue;
        };
        if layer >= n_layer {
            return Err(GgufError::LayerOutOfRange { tensor: tensor.name.clone(), layer, arch, n_layer });
        }
        by_layer.entry(layer).or_default().insert(kind, tensor);
    }
    if by_layer.is_empty() {
        return Err(GgufError::NoExperts { arch });
    }

    let mut n_embd = None;
    let mut layers = Vec::with_capacity(by_layer.len());
    for (layer, mats) in by_layer {
        layers.push(expert_layer(layer, &mats, n_expert, &mut n_embd)?);
    }
    Ok(ExpertLayout { arch, n_layer, n_expert, n_expert_used, n_embd: n_embd.unwrap_or(0), layers })
}

fn shape_error(tensor: &TensorInfo, problem: String) -> GgufError {
    GgufError::ExpertShape { tensor: tensor.name.clone(), ne: tensor.ne, problem }
}

fn expert_matrix(kind: MatKind, tensor: &TensorInfo, n_expert: u32) -> Result<ExpertMatrix, GgufError> {
    let [ne0, ne1, ne2, ne3] = tensor.ne;
    if ne3 != 1 {
        return Err(shape_error(tensor, "is not 3-dimensional".into()));
    }
    if ne2 != u64::from(n_expert) {
        return Err(shape_error(tensor, format!("has {ne2} experts, but the expert count is {n_expert}")));
    }
    // parse_header already checked the type, the block multiple and the total size.
    let expert_bytes = ggml_type(tensor.ggml_type)
        .and_then(|t| t.row_bytes(ne0))
        .and_then(|row| row.checked_mul(ne1))
        .ok_or_else(|| shape_error(tensor, "has no valid byte size".into()))?;
    Ok(ExpertMatrix { kind, name: tensor.name.clone(), ggml_type: tensor.ggml_type, ne: [ne0, ne1, ne2], offset: tensor.offset, expert_bytes })
}

fn expert_layer(layer: u32, tensors: &HashMap<MatKind, &TensorInfo>, n_expert: u32, n_embd: &mut Option<u64>) -> Result<ExpertLayer, GgufError> {
    let missing = |kind: MatKind| GgufError::MissingExpertMatrix { layer, missing: format!("blk.{layer}.{}", kind.suffix()) };
    let down = *tensors.get(&MatKind::Down).ok_or_else(|| missing(MatKind::Down))?;

    let (input, n_ff) = if let Some(&gate_up) = tensors.get(&MatKind::GateUp) {
        if let Some(&other) = tensors.get(&MatKind::Gate).or_else(|| tensors.get(&MatKind::Up)) {
            return Err(shape_error(other, format!("duplicates the fused blk.{layer}.{}", MatKind::GateUp.suffix())));
        }
        if !gate_up.ne[1].is_multiple_of(2) {
            return Err(shape_error(gate_up, "has an odd fused gate+up width".into()));
        }
        (gate_up, gate_up.ne[1] / 2)
    } else {
        let up = *tensors.get(&MatKind::Up).ok_or_else(|| missing(MatKind::Up))?;
        if let Some(&gate) = tensors.get(&MatKind::Gate) {
            if gate.ne != up.ne {
                return Err(shape_error(gate, format!("differs from {} {:?}", up.name, up.ne)));
            }
        }
        (up, up.ne[1])
    };

    let layer_embd = input.ne[0];
    match *n_embd {
        Some(expected) if expected != layer_embd => return Err(shape_error(input, format!("has n_embd {layer_embd}, but earlier layers have {expected}"))),
        _ => *n_embd = Some(layer_embd),
    }
    if down.ne[0] != n_ff || down.ne[1] != layer_embd {
        return Err(shape_error(down, format!("should be [{n_ff}, {layer_embd}, {n_expert}] to match {}", input.name)));
    }

    let mut mats = Vec::with_capacity(tensors.len());
    for kind in MatKind::ALL {
        if let Some(&tensor) = tensors.get(&kind) {
            mats.push(expert_matrix(kind, tensor, n_expert)?);
        }
    }
    Ok(ExpertLayer { layer, n_ff, mats })
}

/// Ties a profile to a model: sha256 of the header (shapes, metadata) and the routers' weights.
pub fn model_sha256(path: &Path, info: &GgufInfo) -> Result<String, GgufError> {
    let mut file = File::open(path).map_err(io_error(path))?;
    let found = file.metadata().map_err(io_error(path))?.len();
    if found != info.file_len {
        return Err(GgufError::FileChanged { path: path.to_path_buf(), expected: info.file_len, found });
    }
    let mut hasher = Sha256::new();
    hash_range(&mut file, path, 0..info.data_offset, &mut hasher)?;
    for router in info.tensors.iter().filter(|t| is_router(&t.name)) {
        hash_range(&mut file, path, router.data_range(), &mut hasher)?;
    }
    let mut hex = String::with_capacity(64);
    for byte in hasher.finalize() {
        let _ = write!(hex, "{byte:02x}");
    }
    Ok(hex)
}

fn hash_range(file: &mut File, path: &Path, range: Range<u64>, hasher: &mut Sha256) -> Result<(), GgufError> {
    file.seek(SeekFrom::Start(range.start)).map_err(io_error(path))?;
    let want = range.end - range.start;
    let copied = io::copy(&mut file.by_ref().take(want), hasher).map_err(io_error(path))?;
    if copied != want {
        return Err(GgufError::FileChanged { path: path.to_path_buf(), expected: range.end, found: range.start + copied });
    }
    Ok(())
}

/// Reads the header of the GGUF file at `path` and its expert layout.
pub fn validate(path: &Path) -> Result<(GgufInfo, ExpertLayout), GgufError> {
    let info = read_info(path)?;
    let layout = expert_layout(&info)?;
    Ok((info, layout))
}
