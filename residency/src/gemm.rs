//! The calibrated GEMM table (STRATA_HIPBLASLT_TUNING): which kernel a dense matmul of a given
//! shape takes on one GPU and one library version, and the guards that make a table for another
//! GPU or version fail loudly instead of being half-used.
//!
//! The format follows PyTorch TunableOp's results file: validator lines first (any mismatch with
//! the running device rejects the whole file), then one row per tuned shape. hipBLASLt/cuBLASLt
//! algorithm indices are not portable across releases or architectures, hence the validators; a
//! row whose shape, strides or workspace do not fit the call at hand falls back to the backend's
//! default, and the fallback is counted by reason.
//!
//! ```text
//! strata-gemm-table 1
//! validator arch sm_90
//! validator runtime 12080
//! validator blaslt 120800
//! # type_a type_b m n k lda ldb ldc choice algo workspace speedup
//! f16 f32 4096 2048 2048 2048 2048 4096 blaslt 17 4194304 1.23
//! q8_0 f32 512 2048 2048 2048 2048 512 mmq - 0 1.10
//! ```

use std::collections::HashMap;

/// What the running device and libraries are, as the backend reports them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub arch: String,
    pub runtime: String,
    pub blaslt: String,
}

/// A dense matmul as the backend is about to run it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub type_a: String,
    pub type_b: String,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub lda: u64,
    pub ldb: u64,
    pub ldc: u64,
}

/// What a tuned row says to run.
#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    /// The quantized MMQ kernels.
    Mmq,
    /// A BLASLt algorithm by its heuristic index, with the workspace it needs.
    BlasLt { algo: u32, workspace: u64 },
}

/// The decision for one call.
#[derive(Clone, Debug, PartialEq)]
pub enum Selection {
    Tuned(Choice),
    Default(Fallback),
}

/// Why a call takes the backend's default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fallback {
    /// The table has no row for this shape and these strides.
    NoEntry,
    /// The row's workspace is more than the backend can give.
    Workspace,
}

#[derive(Clone, Debug, PartialEq)]
struct Row {
    choice: Choice,
    speedup: f64,
}

/// A parsed, validated table.
#[derive(Clone, Debug, PartialEq)]
pub struct Table {
    pub validators: Vec<(String, String)>,
    rows: HashMap<Shape, Row>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GemmTableError {
    #[error("not a Strata GEMM table (the first line must be `strata-gemm-table 1`)")]
    Header,
    #[error("line {line}: {what}")]
    Line { line: usize, what: String },
    #[error("the table is for {key} {table}, this machine has {key} {device}: tune it here with tools/tune-gemm")]
    Mismatch { key: String, table: String, device: String },
    #[error("the table names no {0} validator")]
    MissingValidator(&'static str),
}

/// Validators every table carries.
const REQUIRED: [&str; 3] = ["arch", "runtime", "blaslt"];

impl Table {
    pub fn parse(text: &str) -> Result<Self, GemmTableError> {
        let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())).filter(|(_, l)| !l.is_empty() && !l.starts_with('#'));
        if lines.next().map(|(_, l)| l) != Some("strata-gemm-table 1") {
            return Err(GemmTableError::Header);
        }
        let mut validators: Vec<(String, String)> = Vec::new();
        let mut rows = HashMap::new();
        for (line, l) in lines {
            let bad = |what: String| GemmTableError::Line { line, what };
            let f: Vec<&str> = l.split_whitespace().collect();
            if f[0] == "validator" {
                if f.len() != 3 {
                    return Err(bad("a validator line is `validator KEY VALUE`".into()));
                }
                if !rows.is_empty() {
                    return Err(bad("validators come before the rows".into()));
                }
                if validators.iter().any(|(k, _)| k == f[1]) {
                    return Err(bad(format!("validator {} given twice", f[1])));
                }
                validators.push((f[1].into(), f[2].into()));
                continue;
            }
            if f.len() != 12 {
                return Err(bad(format!("a row has 12 fields (type_a type_b m n k lda ldb ldc choice algo workspace speedup), this one {}", f.len())));
            }
            let num = |i: usize, name: &str| f[i].parse::<u64>().map_err(|_| bad(format!("{name} `{}` is not a number", f[i])));
            let shape = Shape {
                type_a: f[0].into(),
                type_b: f[1].into(),
                m: num(2, "m")?,
                n: num(3, "n")?,
                k: num(4, "k")?,
                lda: num(5, "lda")?,
                ldb: num(6, "ldb")?,
                ldc: num(7, "ldc")?,
            };
            if shape.m == 0 || shape.n == 0 || shape.k == 0 || shape.lda < shape.k.min(shape.m) || shape.ldc < shape.m.min(shape.n) {
                return Err(bad("an empty shape or a leading dimension below the matrix".into()));
            }
            let workspace = num(10, "workspace")?;
            let choice = match f[8] {
                "mmq" => Choice::Mmq,
                "blaslt" => Choice::BlasLt { algo: f[9].parse().map_err(|_| bad(format!("algo `{}` is not an index", f[9])))?, workspace },
                other => return Err(bad(format!("choice `{other}` is neither mmq nor blaslt"))),
            };
            let speedup: f64 = f[11].parse().map_err(|_| bad(format!("speedup `{}` is not a number", f[11])))?;
            if !(speedup.is_finite() && speedup > 1.0) {
                return Err(bad(format!("speedup {speedup}: a row that is not faster than the default is not written")));
            }
            if rows.insert(shape, Row { choice, speedup }).is_some() {
                return Err(bad("this shape has a row already".into()));
            }
        }
        for key in REQUIRED {
            if !validators.iter().any(|(k, _)| k == key) {
                return Err(GemmTableError::MissingValidator(key));
            }
        }
        Ok(Self { validators, rows })
    }

    /// Refuses the whole table when any validator differs from the device.
    pub fn check(&self, dev: &Device) -> Result<(), GemmTableError> {
        for (key, want) in &self.validators {
            let have = match key.as_str() {
                "arch" => &dev.arch,
                "runtime" => &dev.runtime,
                "blaslt" => &dev.blaslt,
                _ => continue,
            };
            if have != want {
                return Err(GemmTableError::Mismatch { key: key.clone(), table: want.clone(), device: have.clone() });
            }
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The kernel for `shape` when the backend can give `max_workspace` bytes of workspace.
    pub fn select(&self, shape: &Shape, max_workspace: u64) -> Selection {
        match self.rows.get(shape) {
            None => Selection::Default(Fallback::NoEntry),
            Some(Row { choice: Choice::BlasLt { workspace, .. }, .. }) if *workspace > max_workspace => Selection::Default(Fallback::Workspace),
            Some(r) => Selection::Tuned(r.choice.clone()),
        }
    }

    /// The median of the rows' measured speedups (the tuner's figure of merit).
    pub fn median_speedup(&self) -> Option<f64> {
        let mut v: Vec<f64> = self.rows.values().map(|r| r.speedup).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "strata-gemm-table 1
validator arch sm_90
validator runtime 12080
validator blaslt 120800
# type_a type_b m n k lda ldb ldc choice algo workspace speedup
f16 f32 4096 2048 2048 2048 2048 4096 blaslt 17 4194304 1.23
q8_0 f32 512 2048 2048 2048 2048 512 mmq - 0 1.10
";

    fn h200() -> Device {
        Device { arch: "sm_90".into(), runtime: "12080".into(), blaslt: "120800".into() }
    }

    fn shape(type_a: &str, m: u64, n: u64, k: u64, lda: u64, ldb: u64, ldc: u64) -> Shape {
        Shape { type_a: type_a.into(), type_b: "f32".into(), m, n, k, lda, ldb, ldc }
    }

    #[test]
    fn a_table_for_this_device_selects_its_rows() {
        let t = Table::parse(GOOD).unwrap();
        t.check(&h200()).unwrap();
        assert_eq!(t.len(), 2);
        let s = shape("f16", 4096, 2048, 2048, 2048, 2048, 4096);
        assert_eq!(t.select(&s, 1 << 30), Selection::Tuned(Choice::BlasLt { algo: 17, workspace: 4194304 }));
        assert_eq!(t.select(&s, 1 << 20), Selection::Default(Fallback::Workspace));
        assert_eq!(t.select(&shape("q8_0", 512, 2048, 2048, 2048, 2048, 512), 0), Selection::Tuned(Choice::Mmq));
        // Another batch size or stride is another shape.
        assert_eq!(t.select(&shape("f16", 4096, 1024, 2048, 2048, 2048, 4096), 1 << 30), Selection::Default(Fallback::NoEntry));
        assert_eq!(t.select(&shape("f16", 4096, 2048, 2048, 2304, 2048, 4096), 1 << 30), Selection::Default(Fallback::NoEntry));
        assert_eq!(t.median_speedup(), Some(1.23));
    }

    #[test]
    fn a_table_for_another_gpu_or_library_is_refused_whole() {
        let t = Table::parse(GOOD).unwrap();
        let gfx = Device { arch: "gfx1100".into(), ..h200() };
        let e = t.check(&gfx).unwrap_err();
        assert_eq!(e.to_string(), "the table is for arch sm_90, this machine has arch gfx1100: tune it here with tools/tune-gemm");
        let old = Device { blaslt: "120700".into(), ..h200() };
        assert!(matches!(t.check(&old), Err(GemmTableError::Mismatch { key, .. }) if key == "blaslt"));
    }

    #[test]
    fn malformed_tables_name_the_line() {
        let bad = |text: &str| Table::parse(text).unwrap_err().to_string();
        assert_eq!(bad("hello\n"), GemmTableError::Header.to_string());
        let head = "strata-gemm-table 1\nvalidator arch sm_90\nvalidator runtime 1\nvalidator blaslt 1\n";
        assert!(bad(&format!("{head}f16 f32 1 2 3\n")).starts_with("line 5: a row has 12 fields"));
        assert!(bad(&format!("{head}f16 f32 x 2 2 2 2 2 mmq - 0 1.2\n")).contains("m `x` is not a number"));
        assert!(bad(&format!("{head}f16 f32 4 4 4 4 4 4 cublas 1 0 1.2\n")).contains("neither mmq nor blaslt"));
        assert!(bad(&format!("{head}f16 f32 4 4 4 4 4 4 mmq - 0 0.9\n")).contains("not faster than the default"));
        assert!(bad(&format!("{head}f16 f32 4 4 4 4 4 4 mmq - 0 1.1\nf16 f32 4 4 4 4 4 4 mmq - 0 1.2\n")).starts_with("line 6: this shape has a row already"));
        assert!(bad(&format!("{head}f16 f32 4 4 4 1 4 4 mmq - 0 1.1\n")).contains("leading dimension"));
        assert!(bad(&format!("{head}f16 f32 4 4 4 4 4 4 mmq - 0 1.1\nvalidator extra 1\n")).contains("validators come before the rows"));
        assert_eq!(bad("strata-gemm-table 1\nvalidator arch sm_90\n"), "the table names no runtime validator");
        assert!(bad("strata-gemm-table 1\nvalidator arch a\nvalidator arch b\n").contains("given twice"));
    }
}
