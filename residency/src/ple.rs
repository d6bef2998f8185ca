//! Per-layer token embeddings (PLE) kept in the model file: where the table's rows are, and the
//! RAM cache of rows already read.
//!
//! A PLE table has one row per vocabulary entry (gemma4, gemma3n) or per hashed n-gram head
//! (qwen4exp), each row holding every layer's embedding for it; a ubatch needs a few hundred of
//! millions of rows. The rows are read from the file by byte range ([`PleTable::row`]), so the
//! table's bytes must lie inside the file: a truncated table is refused when it is located.
//! Prompts repeat tokens, so rows read once stay in a [`RowCache`]: least recently used out
//! first within a byte budget (the same policy as a page cache, without the page granularity
//! that makes a 2 KiB row cost 4 KiB and a fault).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::gguf::{ggml_type, GgufInfo};

/// The tensor name every architecture with a PLE table uses.
pub const TABLE_NAME: &str = "per_layer_token_embd.weight";

/// Where a PLE table's rows are in the model file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PleTable {
    /// Absolute file offset of row 0.
    pub offset: u64,
    pub row_bytes: u64,
    pub n_rows: u64,
    /// Elements per row (ggml's ne[0]).
    pub ne0: u64,
    pub ggml_type: u32,
}

impl PleTable {
    /// The model's PLE table, None when it has none; an error when the entry is malformed or its
    /// bytes run past the end of the file.
    pub fn find(info: &GgufInfo) -> Result<Option<PleTable>, String> {
        let Some(t) = info.tensor(TABLE_NAME) else { return Ok(None) };
        let ty = ggml_type(t.ggml_type).ok_or_else(|| format!("{TABLE_NAME}: unknown ggml type {}", t.ggml_type))?;
        let row_bytes = ty.row_bytes(t.ne[0]).ok_or_else(|| format!("{TABLE_NAME}: rows of {} elements do not fill whole {} blocks", t.ne[0], ty.name))?;
        if t.n_dims != 2 || row_bytes == 0 {
            return Err(format!("{TABLE_NAME}: expected a matrix, got {} dimensions of {:?}", t.n_dims, &t.ne[..t.n_dims as usize]));
        }
        let n_rows = t.ne[1];
        if row_bytes.checked_mul(n_rows) != Some(t.n_bytes) {
            return Err(format!("{TABLE_NAME}: {} rows of {row_bytes} bytes do not make its {} bytes", n_rows, t.n_bytes));
        }
        if t.offset.checked_add(t.n_bytes).is_none_or(|end| end > info.file_len) {
            return Err(format!(
                "{TABLE_NAME}: its {} bytes at offset {} run past the end of the file ({} bytes): the file is truncated",
                t.n_bytes, t.offset, info.file_len
            ));
        }
        Ok(Some(PleTable { offset: t.offset, row_bytes, n_rows, ne0: t.ne[0], ggml_type: t.ggml_type }))
    }

    /// The byte range of `row` in the file, None past the last row.
    pub fn row(&self, row: u32) -> Option<(u64, usize)> {
        (u64::from(row) < self.n_rows).then(|| (self.offset + u64::from(row) * self.row_bytes, self.row_bytes as usize))
    }

    pub fn bytes(&self) -> u64 {
        self.row_bytes * self.n_rows
    }
}

/// qwen4exp's PLE rows of a token: `heads_per_ngram` rows for each n-gram of 2..=n_gram tokens
/// ending at it, row = (XOR over the n-gram of token x multiplier) % head_vocab + head_offset,
/// computed on the host as llama.cpp's set_input does (models/qwen4exp.cpp), so that a prompt's
/// rows are known before its batches run. A predecessor before the sequence start, or at or
/// before an EOS in the window, counts as EOS; the token's own EOS does not cut its window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NgramHash {
    pub n_gram: usize,
    pub heads_per_ngram: usize,
    pub multipliers: Vec<u64>,
    pub head_offsets: Vec<u64>,
    pub head_vocab_sizes: Vec<u64>,
    pub eos: i64,
}

impl NgramHash {
    /// Checks the shapes llama.cpp checks at load (n-gram 2..=8, 1..=64 heads, ranges in i32).
    pub fn new(
        n_gram: usize,
        heads_per_ngram: usize,
        multipliers: Vec<u64>,
        head_offsets: Vec<u64>,
        head_vocab_sizes: Vec<u64>,
        eos: i64,
    ) -> Result<Self, String> {
        let heads = n_gram.saturating_sub(1) * heads_per_ngram;
        if !(2..=8).contains(&n_gram) || heads == 0 || heads > 64 {
            return Err(format!("PLE n-gram size {n_gram} with {heads_per_ngram} heads each is out of range"));
        }
        if multipliers.len() != n_gram || head_offsets.len() != heads || head_vocab_sizes.len() != heads {
            return Err(format!(
                "PLE hash arrays have {}, {} and {} entries; {n_gram}, {heads} and {heads} expected",
                multipliers.len(),
                head_offsets.len(),
                head_vocab_sizes.len()
            ));
        }
        if head_offsets.iter().zip(&head_vocab_sizes).any(|(&o, &v)| v == 0 || o.saturating_add(v) > i32::MAX as u64) {
            return Err("a PLE head range does not fit the int32 row index".into());
        }
        Ok(Self { n_gram, heads_per_ngram, multipliers, head_offsets, head_vocab_sizes, eos })
    }

    /// Rows per token.
    pub fn heads(&self) -> usize {
        (self.n_gram - 1) * self.heads_per_ngram
    }

    /// Appends the rows of tokens[from..], each token's heads in order, with tokens[..i] as the
    /// predecessors of token i.
    pub fn rows(&self, tokens: &[i32], from: usize, out: &mut Vec<u32>) {
        let mut ctx = vec![0i64; self.n_gram];
        for i in from..tokens.len() {
            ctx[0] = i64::from(tokens[i]);
            let mut cut = false;
            for s in 1..self.n_gram {
                let t = if cut || i < s { -1 } else { i64::from(tokens[i - s]) };
                cut = cut || t < 0 || t == self.eos;
                ctx[s] = if cut { self.eos } else { t };
            }
            for n in 2..=self.n_gram {
                let mixed = ctx[..n].iter().zip(&self.multipliers).fold(0u64, |m, (&t, &k)| m ^ (t as u64).wrapping_mul(k));
                let base = (n - 2) * self.heads_per_ngram;
                for h in base..base + self.heads_per_ngram {
                    out.push((mixed % self.head_vocab_sizes[h] + self.head_offsets[h]) as u32);
                }
            }
        }
    }
}

/// Rows read from the table, least recently used evicted first to stay within `budget` bytes.
#[derive(Debug)]
pub struct RowCache {
    budget: u64,
    used: u64,
    clock: u64,
    rows: HashMap<u32, (Arc<[u8]>, u64)>,
    by_age: BTreeMap<u64, u32>,
}

impl RowCache {
    /// A budget of 0 keeps nothing.
    pub fn new(budget: u64) -> Self {
        Self { budget, used: 0, clock: 0, rows: HashMap::new(), by_age: BTreeMap::new() }
    }

    /// The row's bytes, marking it used now.
    pub fn get(&mut self, row: u32) -> Option<Arc<[u8]>> {
        self.clock += 1;
        let now = self.clock;
        let (bytes, age) = self.rows.get_mut(&row)?;
        self.by_age.remove(age);
        *age = now;
        self.by_age.insert(now, row);
        Some(bytes.clone())
    }

    /// Keeps `bytes` as `row`, evicting the least recently used rows as needed; a row larger than
    /// the whole budget is not kept.
    pub fn insert(&mut self, row: u32, bytes: Arc<[u8]>) {
        let size = bytes.len() as u64;
        if size > self.budget {
            return;
        }
        if let Some((old, age)) = self.rows.remove(&row) {
            self.by_age.remove(&age);
            self.used -= old.len() as u64;
        }
        while self.used + size > self.budget {
            let Some((_, victim)) = self.by_age.pop_first() else { break };
            if let Some((old, _)) = self.rows.remove(&victim) {
                self.used -= old.len() as u64;
            }
        }
        self.clock += 1;
        self.rows.insert(row, (bytes, self.clock));
        self.by_age.insert(self.clock, row);
        self.used += size;
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The byte budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes held.
    pub fn used(&self) -> u64 {
        self.used
    }
}

/// Tokens seen to follow each token, most recent first: in decode, the next token's PLE rows are
/// likely among its predecessor's successors, so they can be read while the step that samples it
/// computes. Bounded: at most `per_token` successors each, and no new token once `max_tokens`
/// have some (those known keep learning).
#[derive(Debug, Clone)]
pub struct Successors {
    map: HashMap<i32, Vec<i32>>,
    per_token: usize,
    max_tokens: usize,
}

impl Successors {
    pub fn new(per_token: usize, max_tokens: usize) -> Self {
        Self { map: HashMap::new(), per_token, max_tokens }
    }

    /// `next` followed `prev`: it becomes `prev`'s first successor.
    pub fn observe(&mut self, prev: i32, next: i32) {
        if self.per_token == 0 || (!self.map.contains_key(&prev) && self.map.len() >= self.max_tokens) {
            return;
        }
        let list = self.map.entry(prev).or_default();
        list.retain(|&t| t != next);
        list.insert(0, next);
        list.truncate(self.per_token);
    }

    /// Every consecutive pair of `tokens`.
    pub fn observe_all(&mut self, tokens: &[i32]) {
        for w in tokens.windows(2) {
            self.observe(w[0], w[1]);
        }
    }

    /// The successors of `t`, most recent first.
    pub fn of(&self, t: i32) -> &[i32] {
        self.map.get(&t).map_or(&[], Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::TensorInfo;

    fn row(v: u8, n: usize) -> Arc<[u8]> {
        vec![v; n].into()
    }

    #[test]
    fn evicts_the_least_recently_used_within_the_budget() {
        let mut c = RowCache::new(30);
        c.insert(1, row(1, 10));
        c.insert(2, row(2, 10));
        c.insert(3, row(3, 10));
        assert!(c.get(1).is_some(), "touch 1: 2 is now the oldest");
        c.insert(4, row(4, 10));
        assert!(c.get(2).is_none());
        assert_eq!(c.get(1).as_deref(), Some(&[1u8; 10][..]));
        assert!(c.get(3).is_some() && c.get(4).is_some());
        assert_eq!((c.len(), c.used()), (3, 30));
    }

    #[test]
    fn a_zero_budget_or_an_oversized_row_keeps_nothing_and_replacing_a_row_counts_once() {
        let mut none = RowCache::new(0);
        none.insert(1, row(1, 1));
        assert!(none.is_empty());
        let mut c = RowCache::new(16);
        c.insert(1, row(1, 17));
        assert!(c.is_empty());
        c.insert(1, row(1, 8));
        c.insert(1, row(9, 8));
        assert_eq!((c.len(), c.used()), (1, 8));
        assert_eq!(c.get(1).as_deref(), Some(&[9u8; 8][..]));
    }

    fn info(ne: [u64; 2], ty: u32, offset: u64, n_bytes: u64, file_len: u64) -> GgufInfo {
        let mut full = [1u64; crate::gguf::MAX_DIMS];
        full[..2].copy_from_slice(&ne);
        GgufInfo {
            version: 3,
            file_len,
            alignment: 32,
            header_len: 0,
            data_offset: 0,
            kv: Vec::new(),
            tensors: vec![TensorInfo { name: TABLE_NAME.into(), n_dims: 2, ne: full, ggml_type: ty, offset, n_bytes }],
        }
    }

    #[test]
    fn the_table_is_located_and_a_truncated_one_refused() {
        // f16 (type 1): 64 elements, 128 bytes a row
        let t = PleTable::find(&info([64, 10], 1, 4096, 1280, 8192)).unwrap().unwrap();
        assert_eq!((t.row_bytes, t.n_rows), (128, 10));
        assert_eq!(t.row(9), Some((4096 + 9 * 128, 128)));
        assert_eq!(t.row(10), None);
        let e = PleTable::find(&info([64, 10], 1, 4096, 1280, 5000)).unwrap_err();
        assert!(e.contains("truncated"), "{e}");
        let e = PleTable::find(&info([64, 10], 1, 4096, 1000, 8192)).unwrap_err();
        assert!(e.contains("do not make"), "{e}");
        let mut none = info([64, 10], 1, 0, 1280, 8192);
        none.tensors[0].name = "token_embd.weight".into();
        assert_eq!(PleTable::find(&none), Ok(None));
    }

    #[test]
    fn ngram_rows_follow_the_hash_with_eos_and_the_sequence_start_as_resets() {
        // bigrams and trigrams, one head each: offsets 0 and 100, vocabularies 97 and 89
        let h = NgramHash::new(3, 1, vec![3, 5, 7], vec![0, 100], vec![97, 89], 2).unwrap();
        assert_eq!(h.heads(), 2);
        let row = |ctx: &[u64]| -> Vec<u32> {
            let bi = (ctx[0] * 3) ^ (ctx[1] * 5);
            let tri = bi ^ (ctx[2] * 7);
            vec![(bi % 97) as u32, (tri % 89 + 100) as u32]
        };
        let mut out = Vec::new();
        h.rows(&[10, 11, 2, 12, 13], 0, &mut out);
        let mut want = Vec::new();
        want.extend(row(&[10, 2, 2])); // before the start: EOS
        want.extend(row(&[11, 10, 2]));
        want.extend(row(&[2, 11, 10])); // its own EOS does not cut
        want.extend(row(&[12, 2, 2])); // EOS one back: everything at and before it is EOS
        want.extend(row(&[13, 12, 2]));
        assert_eq!(out, want);
        let mut tail = Vec::new();
        h.rows(&[10, 11, 2, 12, 13], 3, &mut tail);
        assert_eq!(tail, want[6..], "rows from a position on see the tokens before it");
        assert!(NgramHash::new(1, 1, vec![3], vec![], vec![], 2).is_err());
        assert!(NgramHash::new(3, 1, vec![3, 5], vec![0, 100], vec![97, 89], 2).is_err());
        assert!(NgramHash::new(3, 1, vec![3, 5, 7], vec![0, i32::MAX as u64], vec![97, 89], 2).is_err());
    }

    #[test]
    fn successors_are_the_most_recent_first_and_bounded() {
        let mut s = Successors::new(2, 2);
        s.observe_all(&[1, 2, 1, 3, 1, 2]);
        assert_eq!(s.of(1), [2, 3], "2 came last, 3 before it");
        s.observe(1, 4);
        assert_eq!(s.of(1), [4, 2], "at most two each");
        assert_eq!(s.of(2), [1]);
        assert!(s.of(3).is_empty(), "1 and 2 filled the map before 3 was followed by anything");
        s.observe(9, 1);
        assert!(s.of(9).is_empty(), "two tokens known: no new one");
    }
}
