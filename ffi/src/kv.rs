//! How the KV cache is read: which batches of a QSA layer attend over each token's selected cells,
//! gathered from the cache (patches/0011), instead of a mask over every cell.

use std::sync::atomic::{AtomicU32, Ordering};

static QSA_GATHER_MAX: AtomicU32 = AtomicU32::new(0);

/// QSA attention of batches of up to `max_tokens` tokens gathers the selected cells (0: never).
/// Set before the contexts that should build such graphs are made.
pub fn set_qsa_gather(max_tokens: u32) {
    QSA_GATHER_MAX.store(max_tokens, Ordering::Relaxed);
}

pub(crate) fn qsa_gather(n_tokens: u32) -> bool {
    n_tokens <= QSA_GATHER_MAX.load(Ordering::Relaxed)
}
