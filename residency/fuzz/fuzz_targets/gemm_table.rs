#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_residency::gemm::{Device, Shape, Table};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(table) = Table::parse(text) {
        let dev = Device { arch: "sm_90".into(), runtime: "12080".into(), blaslt: "120800".into() };
        let _ = table.check(&dev);
        let shape = Shape { type_a: "f16".into(), type_b: "f32".into(), m: 1, n: 1, k: 1, lda: 1, ldb: 1, ldc: 1 };
        let _ = table.select(&shape, u64::MAX);
        let _ = table.median_speedup();
    }
});
