#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_residency::gguf::{expert_layout, parse_header};

/// Also claim a longer file than the input, so the "header continues" and past-the-end paths run.
const CLAIMED_EXTRA: u64 = 1 << 40;

fuzz_target!(|data: &[u8]| {
    for file_len in [data.len() as u64, data.len() as u64 + CLAIMED_EXTRA] {
        if let Ok(info) = parse_header(data, file_len) {
            if let Ok(layout) = expert_layout(&info) {
                for matrix in layout.layers.iter().flat_map(|l| &l.mats) {
                    let last = matrix.expert_range(layout.n_expert - 1).expect("every expert has a range");
                    assert!(last.end <= file_len);
                }
                let _ = layout.total_expert_bytes();
            }
        }
    }
});
