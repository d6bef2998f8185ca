//! `STRATA_LAB`: the expert tiers' settings for tests and experiments, one variable of
//! comma-separated items (docs/lab.md). The product path is what an empty value gives.

use strata_ffi::moe::{ring, Lab, RingFault as Fault};

/// The variable's name.
pub const VAR: &str = "STRATA_LAB";

/// The items, with what each takes, as the error for an unknown one lists them.
const ITEMS: &str =
    "emulate-ring, zero-copy, pageable-copy, flat-ids, ring-trace=FILE, ring-waves=1..8, ring-pace-kib=KIB, ring-prefetch-min-p=0..1, ring-fault=copy:N|die:N|no-thread, qsa-gather=N";

/// Parses a `STRATA_LAB` value: items separated by commas, each a name or name=value.
pub fn parse(value: &str) -> Result<Lab, String> {
    let mut lab = Lab::default();
    for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (name, arg) = match item.split_once('=') {
            Some((n, v)) => (n.trim(), Some(v.trim())),
            None => (item, None),
        };
        let bad = |what: &str| format!("{VAR}: invalid value '{item}': {what}");
        let flag = |on: &mut bool| match arg {
            None => {
                *on = true;
                Ok(())
            }
            Some(_) => Err(bad(&format!("{name} takes no value"))),
        };
        let need = || arg.filter(|a| !a.is_empty()).ok_or_else(|| bad(&format!("{name} needs a value")));
        match name {
            "emulate-ring" => flag(&mut lab.emulate_ring)?,
            "zero-copy" => flag(&mut lab.zero_copy_on_cpu)?,
            "pageable-copy" => flag(&mut lab.pageable_copy)?,
            "flat-ids" => flag(&mut lab.flat_ids)?,
            "ring-trace" => lab.ring_trace = Some(need()?.into()),
            "ring-waves" => {
                lab.ring_waves = Some(
                    need()?
                        .parse::<usize>()
                        .ok()
                        .filter(|n| (1..=ring::MAX_PASSES).contains(n))
                        .ok_or_else(|| bad(&format!("expected the most passes through the prefill ring per layer, 1 to {}", ring::MAX_PASSES)))?,
                )
            }
            "ring-pace-kib" => {
                lab.ring_copy_pace = Some(
                    need()?
                        .parse::<usize>()
                        .ok()
                        .filter(|&n| n <= 1 << 22)
                        .ok_or_else(|| bad("expected KiB the prefill ring's copier issues before it waits, 0 to 4194304 (0: no pace)"))?
                        << 10,
                )
            }
            "ring-prefetch-min-p" => {
                lab.ring_prefetch_min_p = Some(
                    need()?
                        .parse::<f64>()
                        .ok()
                        .filter(|p| (0.0..=1.0).contains(p))
                        .ok_or_else(|| bad("expected the least chance of use, 0 to 1, for which the prefill ring prefetches a cold expert"))?,
                )
            }
            "ring-fault" => {
                let v = need()?;
                let nth = |n: &str| n.parse::<u64>().ok().filter(|&n| n >= 1);
                lab.ring_fault = Some(
                    match v.split_once(':') {
                        Some(("copy", n)) => nth(n).map(Fault::Copy),
                        Some(("die", n)) => nth(n).map(Fault::Die),
                        None if v == "no-thread" => Some(Fault::NoThread),
                        _ => None,
                    }
                    .ok_or_else(|| bad("expected copy:N (the N-th copy job fails), die:N (the copier thread dies at its N-th job) or no-thread"))?,
                )
            }
            "qsa-gather" => {
                lab.qsa_gather = need()?
                    .parse::<u32>()
                    .ok()
                    .filter(|&n| (1..=64).contains(&n))
                    .ok_or_else(|| bad("expected the largest batch, 1 to 64 tokens, whose QSA attention gathers each token's selected cells"))?
            }
            _ => return Err(format!("{VAR}: unknown item '{name}': expected a comma-separated list of {ITEMS}")),
        }
    }
    Ok(lab)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_parse_into_the_lab_settings() {
        assert_eq!(parse("").unwrap(), Lab::default());
        let lab = parse(" emulate-ring, zero-copy ,flat-ids,ring-trace=/tmp/t.jsonl,ring-waves=2,ring-pace-kib=16,ring-prefetch-min-p=0.25").unwrap();
        assert!(lab.emulate_ring && lab.zero_copy_on_cpu && lab.flat_ids);
        assert_eq!(lab.ring_trace.as_deref(), Some(std::path::Path::new("/tmp/t.jsonl")));
        assert_eq!((lab.ring_waves, lab.ring_copy_pace, lab.ring_prefetch_min_p), (Some(2), Some(16 << 10), Some(0.25)));
        assert!(parse("pageable-copy").unwrap().pageable_copy);
        assert_eq!(parse("qsa-gather=8").unwrap().qsa_gather, 8);
        assert_eq!(parse("ring-fault=copy:3").unwrap().ring_fault, Some(Fault::Copy(3)));
        assert_eq!(parse("ring-fault=die:1").unwrap().ring_fault, Some(Fault::Die(1)));
        assert_eq!(parse("ring-fault=no-thread").unwrap().ring_fault, Some(Fault::NoThread));
        for bad in ["ring-fault=copy:0", "ring-fault=die", "ring-fault=sometimes", "ring-fault"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_bad_item_is_an_error_that_names_it() {
        for (value, says) in [
            ("emulate-rnig", "unknown item 'emulate-rnig'"),
            ("ring-waves=0", "1 to 8"),
            ("ring-waves", "ring-waves needs a value"),
            ("zero-copy=1", "zero-copy takes no value"),
            ("ring-prefetch-min-p=2", "0 to 1"),
            ("ring-pace-kib=-1", "0 to 4194304"),
            ("qsa-gather=0", "1 to 64 tokens"),
        ] {
            let e = parse(value).unwrap_err();
            assert!(e.starts_with("STRATA_LAB: ") && e.contains(says), "{value}: {e}");
        }
    }
}
