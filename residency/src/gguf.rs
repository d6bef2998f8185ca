//! GGUF header reading and validation of an MoE model's expert tensors.
//!
//! A bounds-checked cursor walks the header in the order ggml's `gguf_init_from_reader`
//! (ggml/src/gguf.cpp) does, but every count and length is checked against the bytes left in the
//! file before anything is allocated, and all offset arithmetic is checked, so a truncated or
//! hostile file yields a [`GgufError`] instead of a panic or an out-of-bounds read. Only the
//! header is read; tensor data stays on disk. [`expert_layout`] then maps each MoE layer's
//! `ffn_*_exps` tensors to per-expert byte ranges of the file.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

pub const MAGIC: &[u8; 4] = b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// The largest header [`read_info`] will read; real headers, vocabularies included, are tens of MiB.
pub const MAX_HEADER_BYTES: u64 = 256 << 20;

pub const MAX_DIMS: usize = 4;
/// ggml's `GGML_MAX_NAME` (64) counts the terminating NUL.
const MAX_TENSOR_NAME: usize = 63;
const MAX_ARRAY_DEPTH: u32 = 8;
const FIRST_READ: u64 = 1 << 20;
/// Key length, a one-byte key, value type, and the smallest value.
const MIN_KV_BYTES: u64 = 8 + 1 + 4 + 1;
/// Name length, dimension count, type and offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;
/// An array element that is itself an array: element type and length.
const MIN_NESTED_ARRAY_BYTES: u64 = 4 + 8;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("{} changed while it was being read ({expected} bytes when its header was read, {found} now)", path.display())]
    FileChanged { path: PathBuf, expected: u64, found: u64 },
    #[error("not a GGUF file: it starts with {found:02x?} instead of \"GGUF\"")]
    BadMagic { found: Vec<u8> },
    #[error("GGUF version 1 is no longer supported; convert the model again with a current llama.cpp")]
    VersionOne,
    #[error("GGUF version field {0:#010x} looks byte-swapped; big-endian GGUF files are not supported")]
    BigEndian(u32),
    #[error("unsupported GGUF version {0} (versions 2 and 3 are supported)")]
    UnsupportedVersion(u32),
    #[error("the file ends at byte {file_len}, inside {context}: {need} bytes were needed at byte {at}")]
    Truncated { context: String, at: u64, need: u64, file_len: u64 },
    #[error("the GGUF header continues past the first {have} bytes given")]
    NeedMoreBytes { have: u64 },
    #[error("the GGUF header is larger than {limit} bytes")]
    HeaderTooLarge { limit: u64 },
    #[error("{what} is {count}, but that needs at least {min_bytes} bytes and only {remaining} remain in the file")]
    CountTooLarge { what: String, count: u64, min_bytes: u128, remaining: u64 },
    #[error("key-value pair {index} has an empty key")]
    EmptyKey { index: u64 },
    #[error("{what} is not valid UTF-8")]
    NotUtf8 { what: String },
    #[error("key {0} appears more than once")]
    DuplicateKey(String),
    #[error("key {key} has unknown value type {type_id}")]
    BadValueType { key: String, type_id: u32 },
    #[error("key {key} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")]
    ArrayTooDeep { key: String },
    #[error("key {key} must be of type {expected} but is {found}")]
    KeyType { key: String, expected: &'static str, found: &'static str },
    #[error("key {key} is {value}, but {problem}")]
    BadKey { key: String, value: u64, problem: &'static str },
    #[error("key {0} is missing")]
    MissingKey(String),
    #[error("alignment {0} is not a nonzero power of two")]
    BadAlignment(u64),
    #[error("tensor {index} has a {len}-byte name; ggml allows at most {MAX_TENSOR_NAME}")]
    NameTooLong { index: u64, len: u64 },
    #[error("tensor {0} appears more than once")]
    DuplicateTensor(String),
    #[error("tensor {tensor}: {n_dims} dimensions, ggml allows at most {MAX_DIMS}")]
    TooManyDims { tensor: String, n_dims: u32 },
    #[error("tensor {tensor}: dimension {dim} is negative ({value})")]
    NegativeDim { tensor: String, dim: usize, value: i64 },
    #[error("tensor {tensor}: unknown or removed ggml type {type_id}")]
    UnknownType { tensor: String, type_id: u32 },
    #[error("tensor {tensor}: {ne0} elements per row is not a multiple of the {type_name} block size {block_size}")]
    NotBlockMultiple { tensor: String, ne0: u64, type_name: &'static str, block_size: u64 },
    #[error("tensor {tensor}: shape {ne:?} is too large to address")]
    TensorTooLarge { tensor: String, ne: [u64; 4] },
    #[error("tensor {tensor}: offset {offset} in the data section is not a multiple of the alignment {alignment}")]
    Misaligned { tensor: String, offset: u64, alignment: u64 },
    #[error("tensor {tensor}: data [{start}, {end}) runs past the end of the file ({file_len} bytes)")]
    PastEnd { tensor: String, start: u64, end: u64, file_len: u64 },
    #[error("tensor {second}: data [{second_start}, {second_end}) overlaps tensor {first} at [{first_start}, {first_end})")]
    Overlap { first: String, first_start: u64, first_end: u64, second: String, second_start: u64, second_end: u64 },
    #[error("the {arch} model has no expert tensors (blk.N.ffn_*_exps.weight)")]
    NoExperts { arch: String },
    #[error("tensor {tensor}: layer {layer} is not below {arch}.block_count {n_layer}")]
    LayerOutOfRange { tensor: String, layer: u32, arch: String, n_layer: u32 },
    #[error("layer {layer} has expert tensors but no {missing}")]
    MissingExpertMatrix { layer: u32, missing: String },
    #[error("tensor {tensor}: shape {ne:?} {problem}")]
    ExpertShape { tensor: String, ne: [u64; 4], problem: String },
}

/// A ggml tensor type: elements per block and bytes per block (ggml.c `type_traits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlType {
    pub id: u32,
    pub name: &'static str,
    pub block_size: u64,
    pub type_size: u64,
}

impl GgmlType {
    /// Bytes of one row of `ne0` elements; `None` when `ne0` is not whole blocks.
    pub fn row_bytes(&self, ne0: u64) -> Option<u64> {
        if !ne0.is_multiple_of(self.block_size) {
            return None;
        }
        (ne0 / self.block_size).checked_mul(self.type_size)
    }
}

const fn ty(id: u32, name: &'static str, block_size: u64, type_size: u64) -> GgmlType {
    GgmlType { id, name, block_size, type_size }
}

const QK_K: u64 = 256;

/// Every type id the pinned ggml defines; ids 4, 5 and 31..=33, 36..=38 were removed.
const GGML_TYPES: &[GgmlType] = &[
    ty(0, "f32", 1, 4),
    ty(1, "f16", 1, 2),
    ty(2, "q4_0", 32, 18),
    ty(3, "q4_1", 32, 20),
    ty(6, "q5_0", 32, 22),
    ty(7, "q5_1", 32, 24),
    ty(8, "q8_0", 32, 34),
    ty(9, "q8_1", 32, 36),
    ty(10, "q2_K", QK_K, 84),
    ty(11, "q3_K", QK_K, 110),
    ty(12, "q4_K", QK_K, 144),
    ty(13, "q5_K", QK_K, 176),
    ty(14, "q6_K", QK_K, 210),
    ty(15, "q8_K", QK_K, 292),
    ty(16, "iq2_xxs", QK_K, 66),
    ty(17, "iq2_xs", QK_K, 74),
    ty(18, "iq3_xxs", QK_K, 98),
    ty(19, "iq1_s", QK_K, 50),
    ty(20, "iq4_nl", 32, 18),
    ty(21, "iq3_s", QK_K, 110),
    ty(22, "iq2_s", QK_K, 82),
    ty(23, "iq4_xs", QK_K, 136),
    ty(24, "i8", 1, 1),
    ty(25, "i16", 1, 2),
    ty(26, "i32", 1, 4),
    ty(27, "i64", 1, 8),
    ty(28, "f64", 1, 8),
    ty(29, "iq1_m", QK_K, 56),
    ty(30, "bf16", 1, 2),
    ty(34, "tq1_0", QK_K, 54),
    ty(35, "tq2_0", QK_K, 66),
    ty(39, "mxfp4", 32, 17),
    ty(40, "nvfp4", 64, 36),
    ty(41, "q1_0", 128, 18),
    ty(42, "q2_0", 64, 18),
];

pub fn ggml_type(id: u32) -> Option<GgmlType> {
    GGML_TYPES.iter().find(|t| t.id == id).copied()
}

/// GGUF metadata value types (gguf.h `enum gguf_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    Str,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => Str,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "uint8",
            I8 => "int8",
            U16 => "uint16",
            I16 => "int16",
            U32 => "uint32",
            I32 => "int32",
            F32 => "float32",
            Bool => "bool",
            Str => "string",
            Array => "array",
            U64 => "uint64",
            I64 => "int64",
            F64 => "float64",
        }
    }

    fn fixed_size(self) -> Option<u64> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            Str | Array => None,
        }
    }
}

/// A metadata value. Arrays are checked to the last byte but only their type and length are
/// kept: nothing here needs the vocabulary, and keeping it would let a hostile header allocate.
/// Integer arrays of up to [`SMALL_INT_ARRAY`] elements are the exception (their little-endian
/// bits, zero-extended to u64).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array {
        elem: ValueType,
        len: u64,
    },
    /// An integer array of at most [`SMALL_INT_ARRAY`] elements, kept.
    Ints {
        elem: ValueType,
        values: Vec<u64>,
    },
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::Str(_) => ValueType::Str,
            Value::Array { .. } | Value::Ints { .. } => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Any integer type holding a non-negative value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A kept integer array's elements.
    pub fn as_ints(&self) -> Option<&[u64]> {
        match self {
            Value::Ints { values, .. } => Some(values),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub n_dims: u32,
    /// Unused trailing dimensions are 1, as in ggml.
    pub ne: [u64; MAX_DIMS],
    pub ggml_type: u32,
    /// Absolute file offset of the first byte.
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn data_range(&self) -> Range<u64> {
        self.offset..self.offset + self.n_bytes
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct GgufInfo {
    pub version: u32,
    pub file_len: u64,
    pub alignment: u64,
    /// Where the tensor infos end; the data section starts at the next multiple of the alignment.
    pub header_len: u64,
    pub data_offset: u64,
    /// In file order.
    pub kv: Vec<(String, Value)>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
}

impl GgufInfo {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.kv.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    fn require_str(&self, key: &str) -> Result<&str, GgufError> {
        let value = self.require(key)?;
        value.as_str().ok_or_else(|| GgufError::KeyType { key: key.to_string(), expected: "string", found: value.value_type().name() })
    }

    fn require_u32(&self, key: &str) -> Result<u32, GgufError> {
        let value = self.require(key)?;
        let n = value.as_u64().ok_or_else(|| GgufError::KeyType { key: key.to_string(), expected: "unsigned integer", found: value.value_type().name() })?;
        u32::try_from(n).map_err(|_| GgufError::BadKey { key: key.to_string(), value: n, problem: "it must fit in 32 bits" })
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    file_len: u64,
    context: String,
}

impl<'a> Cursor<'a> {
    fn at(&self) -> u64 {
        self.pos as u64
    }

    fn remaining_in_file(&self) -> u64 {
        self.file_len - self.at()
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], GgufError> {
        match self.at().checked_add(n) {
            Some(end) if end <= self.buf.len() as u64 => {
                let bytes = &self.buf[self.pos..end as usize];
                self.pos = end as usize;
                Ok(bytes)
            }
            Some(end) if end <= self.file_len => Err(GgufError::NeedMoreBytes { have: self.buf.len() as u64 }),
            _ => Err(GgufError::Truncated { context: self.context.clone(), at: self.at(), need: n, file_len: self.file_len }),
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N as u64)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn i64(&mut self) -> Result<i64, GgufError> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Result<&'a [u8], GgufError> {
        let len = self.u64()?;
        self.take(len)
    }

    /// Fails unless `count` items of at least `min_each` bytes can fit in the rest of the file.
    fn check_count(&self, count: u64, min_each: u64, what: impl FnOnce() -> String) -> Result<(), GgufError> {
        let min_bytes = u128::from(count) * u128::from(min_each);
        let remaining = self.remaining_in_file();
        if min_bytes > u128::from(remaining) {
            return Err(GgufError::CountTooLarge { what: what(), count, min_bytes, remaining });
        }
        Ok(())
    }
}

fn utf8(bytes: &[u8], what: impl FnOnce() -> String) -> Result<String, GgufError> {
    String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::NotUtf8 { what: what() })
}

fn check_version(version: u32) -> Result<(), GgufError> {
    match version {
        2 | 3 => Ok(()),
        1 => Err(GgufError::VersionOne),
        v if v != 0 && v & 0xFFFF == 0 => Err(GgufError::BigEndian(v)),
        v => Err(GgufError::UnsupportedVersion(v)),
    }
}

/// Integer arrays up to this length are kept (hash constants and the like); longer ones, and
/// arrays of other types, only by type and length.
pub const SMALL_INT_ARRAY: u64 = 64;

fn read_value(cur: &mut Cursor, key: &str, type_id: u32) -> Result<Value, GgufError> {
    let bad_type = |type_id| GgufError::BadValueType { key: key.to_string(), type_id };
    let value_type = ValueType::from_id(type_id).ok_or_else(|| bad_type(type_id))?;
    Ok(match value_type {
        ValueType::U8 => Value::U8(u8::from_le_bytes(cur.array()?)),
        ValueType::I8 => Value::I8(i8::from_le_bytes(cur.array()?)),
        ValueType::U16 => Value::U16(u16::from_le_bytes(cur.array()?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(cur.array()?)),
        ValueType::U32 => Value::U32(cur.u32()?),
        ValueType::I32 => Value::I32(i32::from_le_bytes(cur.array()?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(cur.array()?)),
        ValueType::Bool => Value::Bool(cur.array::<1>()?[0] != 0),
        ValueType::Str => Value::Str(String::from_utf8_lossy(cur.string()?).into_owned()),
        ValueType::U64 => Value::U64(cur.u64()?),
        ValueType::I64 => Value::I64(cur.i64()?),
        ValueType::F64 => Value::F64(f64::from_le_bytes(cur.array()?)),
        ValueType::Array => {
            let elem_id = cur.u32()?;
            let elem = ValueType::from_id(elem_id).ok_or_else(|| bad_type(elem_id))?;
            let len = cur.u64()?;
            let int = matches!(
                elem,
                ValueType::U8 | ValueType::I8 | ValueType::U16 | ValueType::I16 | ValueType::U32 | ValueType::I32 | ValueType::U64 | ValueType::I64
            );
            if int && len <= SMALL_INT_ARRAY {
                let size = elem.fixed_size().unwrap_or(8);
                let bytes = cur.take(len * size)?;
                let values = bytes
                    .chunks_exact(size as usize)
                    .map(|c| {
                        let mut b = [0u8; 8];
                        b[..c.len()].copy_from_slice(c);
                        u64::from_le_bytes(b)
                    })
                    .collect();
                Value::Ints { elem, values }
            } else {
                skip_array(cur, key, elem, len, 1)?;
                Value::Array { elem, len }
            }
        }
    })
}

fn skip_array(cur: &mut Cursor, key: &str, elem: ValueType, len: u64, depth: u32) -> Result<(), GgufError> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::ArrayTooDeep { key: key.to_string() });
    }
    let min_each = match elem {
        ValueType::Str => 8,
        ValueType::Array => MIN_NESTED_ARRAY_BYTES,
        fixed => fixed.fixed_size().unwrap_or(1),
    };
    cur.check_count(len, min_each, || format!("the length of the {} array in key {key}", elem.name()))?;
    match elem {
        ValueType::Str => {
            for _ in 0..len {
                cur.string()?;
            }
        }
        ValueType::Array => {
            for _ in 0..len {
                let inner_id = cur.u32()?;
                let inner = ValueType::from_id(inner_id).ok_or_else(|| GgufError::BadValueType { key: key.to_string(), type_id: inner_id })?;
                let inner_len = cur.u64()?;
                skip_array(cur, key, inner, inner_len, depth + 1)?;
            }
        }
        _ => {
            cur.take(len * min_each)?;
        }
    }
    Ok(())
}

struct RawTensor {
    name: String,
    n_dims: u32,
    ne: [u64; MAX_DIMS],
    ggml_type: u32,
    rel_offset: u64,
    n_bytes: u64,
}

fn read_tensor_info(cur: &mut Cursor, index: u64, alignment: u64) -> Result<RawTensor, GgufError> {
    cur.context = format!("the info of tensor {index}");
    let name_bytes = cur.string()?;
    if name_bytes.len() > MAX_TENSOR_NAME {
        return Err(GgufError::NameTooLong { index, len: name_bytes.len() as u64 });
    }
    let name = utf8(name_bytes, || format!("the name of tensor {index}"))?;
    cur.context = format!("the info of tensor {name}");

    let n_dims = cur.u32()?;
    if n_dims as usize > MAX_DIMS {
        return Err(GgufError::TooManyDims { tensor: name, n_dims });
    }
    let mut ne = [1u64; MAX_DIMS];
    for (dim, slot) in ne.iter_mut().enumerate().take(n_dims as usize) {
        let value = cur.i64()?;
        *slot = u64::try_from(value).map_err(|_| GgufError::NegativeDim { tensor: name.clone(), dim, value })?;
    }

    let type_id = cur.u32()?;
    let rel_offset = cur.u64()?;

    let ggml = ggml_type(type_id).ok_or_else(|| GgufError::UnknownType { tensor: name.clone(), type_id })?;
    if !ne[0].is_multiple_of(ggml.block_size) {
        return Err(GgufError::NotBlockMultiple { tensor: name, ne0: ne[0], type_name: ggml.name, block_size: ggml.block_size });
    }
    let n_bytes = ne[1..]
        .iter()
        .try_fold(ggml.row_bytes(ne[0]).unwrap_or(0), |acc, &n| acc.checked_mul(n))
        .ok_or_else(|| GgufError::TensorTooLarge { tensor: name.clone(), ne })?;
    if !rel_offset.is_multiple_of(alignment) {
        return Err(GgufError::Misaligned { tensor: name, offset: rel_offset, alignment });
    }
    Ok(RawTensor { name, n_dims, ne, ggml_type: type_id, rel_offset, n_bytes })
}

/// Parses the header of a GGUF file of `file_len` bytes from `bytes`, a prefix of it.
///
/// When the header runs past `bytes` but not past `file_len`, the error is
/// [`GgufError::NeedMoreBytes`]: call again with a longer prefix.
pub fn parse_header(bytes: &[u8], file_len: u64) -> Result<GgufInfo, GgufError> {
    let visible = usize::try_from(file_len).map_or(bytes.len(), |len| len.min(bytes.len()));
    let mut cur = Cursor { buf: &bytes[..visible], pos: 0, file_len, context: "the file magic".into() };

    let magic = cur.take(4)?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic.to_vec() });
    }
    cur.context = "the GGUF version".into();
    let version = cur.u32()?;
    check_version(version)?;
    cur.context = "the tensor and key-value counts".into();
    let n_tensors = cur.u64()?;
    let n_kv = cur.u64()?;
    cur.check_count(n_kv, MIN_KV_BYTES, || "the key-value count".into())?;
    cur.check_count(n_tensors, MIN_TENSOR_INFO_BYTES, || "the tensor count".into())?;

    let mut kv = Vec::new();
    let mut seen_keys = HashSet::new();
    for index in 0..n_kv {
        cur.context = format!("key-value pair {index}");
        let key_bytes = cur.string()?;
        if key_bytes.is_empty() {
            return Err(GgufError::EmptyKey { index });
        }
        let key = utf8(key_bytes, || format!("the key of key-value pair {index}"))?;
        if !seen_keys.insert(key.clone()) {
            return Err(GgufError::DuplicateKey(key));
        }
        cur.context = format!("the value of key {key}");
        let type_id = cur.u32()?;
        let value = read_value(&mut cur, &key, type_id)?;
        kv.push((key, value));
    }

    let alignment = match kv.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) => u64::from(*a),
        Some((_, other)) => return Err(GgufError::KeyType { key: ALIGNMENT_KEY.into(), expected: "uint32", found: other.value_type().name() }),
    };
    if !alignment.is_power_of_two() {
        return Err(GgufError::BadAlignment(alignment));
    }

    let mut raw = Vec::new();
    let mut seen_names = HashSet::new();
    for index in 0..n_tensors {
        let tensor = read_tensor_info(&mut cur, index, alignment)?;
        if !seen_names.insert(tensor.name.clone()) {
            return Err(GgufError::DuplicateTensor(tensor.name));
        }
        raw.push(tensor);
    }

    let header_len = cur.at();
    let data_offset = if n_tensors == 0 { Some(header_len) } else { header_len.checked_next_multiple_of(alignment) };
    let data_offset = data_offset.unwrap_or(u64::MAX);
    if data_offset > file_len {
        return Err(GgufError::Truncated { context: "the padding before the tensor data".into(), at: header_len, need: data_offset - header_len, file_len });
    }

    let tensors = raw
        .into_iter()
        .map(|t| {
            let end = data_offset.checked_add(t.rel_offset).and_then(|start| start.checked_add(t.n_bytes));
            match end {
                Some(end) if end <= file_len => {
                    Ok(TensorInfo { name: t.name, n_dims: t.n_dims, ne: t.ne, ggml_type: t.ggml_type, offset: data_offset + t.rel_offset, n_bytes: t.n_bytes })
                }
                _ => {
                    let start = data_offset.saturating_add(t.rel_offset);
                    Err(GgufError::PastEnd { tensor: t.name, start, end: start.saturating_add(t.n_bytes), file_len })
                }
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    check_overlaps(&tensors)?;

    Ok(GgufInfo { version, file_len, alignment, header_len, data_offset, kv, tensors })
}

fn check_overlaps(tensors: &[TensorInfo]) -> Result<(), GgufError> {
    let mut by_start: Vec<&TensorInfo> = tensors.iter().filter(|t| t.n_bytes > 0).collect();
    by_start.sort_by_key(|t| (t.offset, t.n_bytes));
    for pair in by_start.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if a.data_range().end > b.offset {
            return Err(GgufError::Overlap {
                first: a.name.clone(),
                first_start: a.offset,
                first_end: a.data_range().end,
                second: b.name.clone(),
                second_start: b.offset,
                second_end: b.data_range().end,
            });
        }
    }
    Ok(())
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> GgufError + '_ {
    move |source| GgufError::Io { path: path.to_path_buf(), source }
}

/// Reads and validates the header of the GGUF file at `path`, reading only as much as the header needs.
pub fn read_info(path: &Path) -> Result<GgufInfo, GgufError> {
    read_info_from(path, FIRST_READ)
}

fn read_info_from(path: &Path, first_read: u64) -> Result<GgufInfo, GgufError> {
    let mut file = File::open(path).map_err(io_error(path))?;
    let file_len = file.metadata().map_err(io_error(path))?.len();
    let mut buf = Vec::new();
    let mut want = first_read.max(1).min(file_len).min(MAX_HEADER_BYTES);
    loop {
        let missing = want - buf.len() as u64;
        let got = file.by_ref().take(missing).read_to_end(&mut buf).map_err(io_error(path))?;
        if (got as u64) < missing {
            return Err(GgufError::FileChanged { path: path.to_path_buf(), expected: file_len, found: buf.len() as u64 });
        }
        match parse_header(&buf, file_len) {
            Err(GgufError::NeedMoreBytes { .. }) if want >= MAX_HEADER_BYTES => return Err(GgufError::HeaderTooLarge { limit: MAX_HEADER_BYTES }),
            Err(GgufError::NeedMoreBytes { .. }) => want = want.saturating_mul(2).min(file_len).min(MAX_HEADER_BYTES),
            result => return result,
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
