//! `--kv-resident N`: at most N tokens of a sequence's KV cache on the card (docs/kv-streaming.md).
//! Sparse-attention (QSA) layers keep their K and V in page-locked host memory that the GPU reads
//! in place, and small batches attend over each token's gathered cells; dense attention layers
//! keep theirs on the card, which the start-up line says.

/// Batches of up to this many tokens (decode steps, speculative verify batches) attend over each
/// token's selected cells, gathered from the host cache; larger ones read the cache in place.
pub const GATHER_MAX_TOKENS: u32 = 16;

/// What `--kv-resident N` comes to.
#[derive(Debug, PartialEq)]
pub struct KvPlan {
    /// The QSA layers' K and V go to host memory.
    pub host: bool,
    /// Largest batch that gathers (0: none).
    pub gather: u32,
    n: u64,
    n_ctx_seq: u64,
    sparse: usize,
    gpu: Option<String>,
    fa_off: bool,
}

/// For a model with `sparse` QSA layers at `n_ctx_seq` tokens a sequence, on `gpu` (its name) or
/// the CPU; `fa_off`: flash attention switched off (-fa off), which the gather needs.
pub fn plan(n: u64, n_ctx_seq: u64, sparse: usize, gpu: Option<&str>, fa_off: bool) -> KvPlan {
    let host = sparse > 0 && n_ctx_seq > n;
    let gather = if host && !fa_off { GATHER_MAX_TOKENS } else { 0 };
    KvPlan { host, gather, n, n_ctx_seq, sparse, gpu: gpu.map(str::to_string), fa_off }
}

impl KvPlan {
    /// The start-up line once the contexts exist and `host_bytes` of K and V were placed; true
    /// when it is a warning (the flag asked for what this model or build cannot do).
    pub fn line(&self, host_bytes: u64) -> (bool, String) {
        let n = self.n;
        if self.sparse == 0 {
            return (
                true,
                format!("--kv-resident {n}: this model has no sparse-attention (QSA) layers; its KV cache stays where llama.cpp puts it (streaming dense attention is not built)"),
            );
        }
        if !self.host {
            return (false, format!("--kv-resident {n}: a sequence's {} tokens fit: the KV cache stays on the card", self.n_ctx_seq));
        }
        if host_bytes == 0 {
            return (
                true,
                format!("--kv-resident {n}: the K and V of the {} QSA layers could not be placed in host memory; they stay on the card", self.sparse),
            );
        }
        let mib = host_bytes as f64 / (1u64 << 20) as f64;
        let whose = match &self.gpu {
            Some(g) => format!("page-locked host memory that {g} reads in place"),
            None => "host memory (no GPU: where the cache is anyway)".to_string(),
        };
        let read = if self.fa_off {
            "flash attention is off (-fa off), which the gather of each token's selected cells needs: every step reads the whole cache over the bus".to_string()
        } else {
            format!("batches of up to {} tokens attend over each token's selected cells, gathered", self.gather)
        };
        (
            self.fa_off,
            format!(
                "--kv-resident {n}: the K and V of {} QSA layers ({mib:.1} MiB for {} tokens a sequence) live in {whose}; {read}; the indexer's keys and dense attention layers' K and V stay where llama.cpp puts them",
                self.sparse, self.n_ctx_seq
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sparse_layers_of_a_context_longer_than_n_go_to_the_host() {
        let p = plan(32768, 262144, 12, Some("CUDA0"), false);
        assert!(p.host && p.gather == GATHER_MAX_TOKENS);
        let (warn, line) = p.line(3 << 30);
        assert!(
            !warn && line.contains("12 QSA layers (3072.0 MiB for 262144 tokens a sequence) live in page-locked host memory that CUDA0 reads in place"),
            "{line}"
        );
        // a context within N: nothing moves
        let p = plan(32768, 16384, 12, Some("CUDA0"), false);
        assert!(!p.host && p.gather == 0);
        assert_eq!(p.line(0), (false, "--kv-resident 32768: a sequence's 16384 tokens fit: the KV cache stays on the card".to_string()));
        // dense attention only: said, as a warning
        let p = plan(1024, 262144, 0, Some("CUDA0"), false);
        assert!(!p.host);
        let (warn, line) = p.line(0);
        assert!(warn && line.contains("no sparse-attention (QSA) layers") && line.contains("not built"), "{line}");
        // the allocation declined: the cache stayed on the card, as a warning
        let (warn, line) = plan(64, 4096, 3, Some("CUDA0"), false).line(0);
        assert!(warn && line.contains("could not be placed"), "{line}");
        // no GPU
        let (_, line) = plan(64, 4096, 3, None, false).line(1 << 20);
        assert!(line.contains("host memory (no GPU"), "{line}");
        // -fa off: no gather, and a warning that says what a step reads
        let p = plan(64, 4096, 3, Some("CUDA0"), true);
        assert!(p.host && p.gather == 0);
        let (warn, line) = p.line(1 << 20);
        assert!(warn && line.contains("flash attention is off (-fa off)"), "{line}");
    }
}
