//! Calibrated GEMM dispatch in strata-server: `STRATA_HIPBLASLT_TUNING=FILE` (a table made by
//! tools/tune-gemm; the same variable serves cuBLASLt on NVIDIA) and `STRATA_PREFILL_MMQ=1`.
//!
//! The table is read and checked against the GPU before the model loads. A table that does not
//! parse, or was made for another GPU or library version, is refused with the reason and the
//! server goes on with the backend's default kernels: a tuning file never stops a server, and is
//! never half-used. `STRATA_GEMM_DEVICE` ("ARCH RUNTIME BLASLT") stands in for the GPU's own
//! description, so the checks can be exercised where there is no GPU.

use std::path::PathBuf;

use strata_ffi::gemm::{self, FALLBACKS, PATHS};
use strata_ffi::Verbosity;
use strata_residency::gemm::{Device, GemmTableError, Table};

use crate::cli::env::Settings;
use crate::engine::metrics::strata_family;

/// The variables, as read at start-up.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GemmConfig {
    pub table: Option<PathBuf>,
    pub prefill_mmq: bool,
    pub device: Option<Device>,
}

/// The dispatch's settings; None when neither a table nor MMQ is asked for.
pub fn config(env: &Settings) -> Option<GemmConfig> {
    (env.gemm_table.is_some() || env.prefill_mmq).then(|| GemmConfig {
        table: env.gemm_table.clone(),
        prefill_mmq: env.prefill_mmq,
        device: env.gemm_device.clone(),
    })
}

/// The table at `path` if it parses and its validators match `device`, else why not.
fn load(path: &std::path::Path, device: Option<&Device>) -> Result<Table, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    let text = String::from_utf8(bytes).map_err(|_| GemmTableError::Header.to_string())?;
    let table = Table::parse(&text).map_err(|e| e.to_string())?;
    let device = device.ok_or("there is no GPU backend with Strata's GEMM dispatch to check it against")?;
    table.check(device).map_err(|e| e.to_string())?;
    Ok(table)
}

/// Checks the table and installs the dispatch on GPU `main_gpu`. Returns the start-up log lines;
/// never fails the server.
pub fn start(cfg: &GemmConfig, main_gpu: usize) -> Vec<(Verbosity, String)> {
    let mut lines = Vec::new();
    let device = cfg.device.clone().or_else(|| gemm::device(main_gpu as i32));
    let table = match cfg.table.as_deref() {
        None => None,
        Some(path) => match load(path, device.as_ref()) {
            Ok(t) => {
                let d = device.as_ref().expect("checked");
                let median = t.median_speedup().map_or("-".into(), |m| format!("{m:.2}x"));
                lines.push((
                    Verbosity::Info,
                    format!(
                        "STRATA_HIPBLASLT_TUNING {}: {} tuned shapes for {} (runtime {}, BLASLt {}), median speedup {median}",
                        path.display(),
                        t.len(),
                        d.arch,
                        d.runtime,
                        d.blaslt
                    ),
                ));
                Some(t)
            }
            Err(e) => {
                lines.push((
                    Verbosity::Error,
                    format!("STRATA_HIPBLASLT_TUNING {}: refused: {e}; dense matmuls take the backend's default kernels", path.display()),
                ));
                None
            }
        },
    };
    if table.is_none() && !cfg.prefill_mmq {
        return lines;
    }
    match gemm::install(table, cfg.prefill_mmq) {
        Ok(()) if cfg.prefill_mmq => lines.push((Verbosity::Info, "STRATA_PREFILL_MMQ=1: quantized prompt matmuls without a tuned row take MMQ".into())),
        Ok(()) => {}
        Err(e) => lines.push((Verbosity::Warn, format!("GEMM dispatch not installed: {e}; dense matmuls take the backend's default kernels"))),
    }
    lines
}

/// The `strata:gemm_*` lines for /metrics; empty unless the dispatch is installed.
pub fn metrics_text() -> String {
    let Some((paths, fallbacks)) = gemm::counters() else { return String::new() };
    let mut out = String::new();
    let paths_help = "Dense matmuls dispatched by path (a replayed CUDA graph dispatches nothing)";
    strata_family(&mut out, "gemm_matmuls_total", "counter", paths_help, "path", PATHS.iter().copied().zip(paths));
    let fallbacks_help = "Prompt-sized dense matmuls that took the default path, by reason";
    strata_family(&mut out, "gemm_fallbacks_total", "counter", fallbacks_help, "reason", FALLBACKS.iter().copied().zip(fallbacks));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<Settings, String> {
        crate::cli::env::parse(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    #[test]
    fn variables_parse_or_name_the_bad_value() {
        assert_eq!(config(&env(&[]).unwrap()), None);
        assert_eq!(config(&env(&[("STRATA_GEMM_DEVICE", "sm_90 13000 130100")]).unwrap()), None, "a device alone asks for nothing");
        let c = config(&env(&[("STRATA_HIPBLASLT_TUNING", "t.txt"), ("STRATA_GEMM_DEVICE", "sm_90 13000 130100")]).unwrap()).unwrap();
        assert_eq!(c.table, Some(PathBuf::from("t.txt")));
        assert_eq!(c.device.unwrap().arch, "sm_90");
        assert!(config(&env(&[("STRATA_PREFILL_MMQ", "1")]).unwrap()).unwrap().prefill_mmq);
        assert!(env(&[("STRATA_PREFILL_MMQ", "yes")]).unwrap_err().contains("STRATA_PREFILL_MMQ: invalid value 'yes'"));
        assert!(env(&[("STRATA_HIPBLASLT_TUNING", "t"), ("STRATA_GEMM_DEVICE", "sm_90")]).unwrap_err().contains("STRATA_GEMM_DEVICE"));
    }

    #[test]
    fn a_table_for_another_device_is_refused_and_the_server_goes_on() {
        let dir = std::env::temp_dir().join(format!("strata-gemm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.txt");
        std::fs::write(&path, "strata-gemm-table 1\nvalidator arch sm_89\nvalidator runtime 13000\nvalidator blaslt 130100\n").unwrap();
        let dev = Device { arch: "sm_90".into(), runtime: "13000".into(), blaslt: "130100".into() };
        let lines = start(&GemmConfig { table: Some(path.clone()), prefill_mmq: false, device: Some(dev.clone()) }, 0);
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0].0, Verbosity::Error);
        assert!(lines[0].1.contains("refused: the table is for arch sm_89, this machine has arch sm_90"), "{lines:?}");
        // The right device: accepted, then not installed here (no GPU backend).
        std::fs::write(&path, "strata-gemm-table 1\nvalidator arch sm_90\nvalidator runtime 13000\nvalidator blaslt 130100\n").unwrap();
        let lines = start(&GemmConfig { table: Some(path), prefill_mmq: false, device: Some(dev) }, 0);
        assert!(lines[0].1.contains("0 tuned shapes for sm_90"), "{lines:?}");
        assert!(lines[1].1.contains("GEMM dispatch not installed"), "{lines:?}");
        assert_eq!(metrics_text(), "");
    }
}
