//! GGUF header reading and validation of an MoE model's expert tensors.
//!
//! A bounds-checked cursor walks the header in the order ggml's `gguf_init_from_reader`
//! (ggml/src/gguf.cpp) does, but every count and length is checked against the bytes left in the
//! file before anything is allocated, and all offset arithmetic is checked, so a truncated or
//! hostile file yields a [`GgufError`] instead of a panic or an out-of-bounds read. Only the
//! header is read; tensor data stays on disk. [`expert_layout`] then maps each MoE layer's
//! `ffn_*_exps` tensors to per-expert byte ranges of the file.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, Read};
use std::ops::Range;
use std::path::{Path, PathBuf};

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

mod experts;
pub use experts::*;

#[cfg(test)]
mod tests;
