use std::collections::BTreeSet;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use strata_ffi::hooks::{self, Hooks, MoeExperts};
use strata_ffi::{sys, Batch, Context, ContextParams, Model, ModelParams};

use crate::support::model;

#[derive(Default)]
struct Counting {
    loaded: AtomicUsize,
    freed: AtomicUsize,
    layers: Mutex<BTreeSet<i32>>,
    calls: AtomicUsize,
    shape: Mutex<Option<(i64, i64)>>,
}

impl Hooks for Counting {
    fn model_loaded(&self, _: *const sys::llama_model) {
        self.loaded.fetch_add(1, Ordering::SeqCst);
    }
    fn model_freed(&self, _: *const sys::llama_model) {
        self.freed.fetch_add(1, Ordering::SeqCst);
    }
    fn moe_experts(&self, args: &MoeExperts<'_>) -> Option<NonNull<sys::ggml_tensor>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.layers.lock().unwrap().insert(args.layer());
        *self.shape.lock().unwrap() = Some((args.n_expert(), args.n_expert_used()));
        None
    }
}

fn last_logits(model: &Model, prompt: &str) -> Vec<f32> {
    let mut ctx = Context::new(model, ContextParams::default().with_n_ctx(256).with_n_batch(256).with_threads(2)).unwrap();
    let toks = model.vocab().tokenize(prompt, true, false).unwrap();
    let mut batch = Batch::new(toks.len(), 1);
    for (i, &t) in toks.iter().enumerate() {
        batch.add(t, i as i32, &[0], i + 1 == toks.len()).unwrap();
    }
    ctx.decode(&batch).unwrap();
    ctx.logits_ith(-1).unwrap().to_vec()
}

/// The hook ABI is wired through: load/free and every MoE layer call into Rust, and a hook
/// that declines (returns None) leaves the computation bit for bit as upstream's.
#[test]
fn moe_hook_sees_every_layer_and_declining_changes_nothing() {
    crate::support::quiet_llama_logs();
    let path = model("tiny-qwen3moe.gguf");
    let prompt = "Mixture of experts routing test";
    let before = {
        let m = Model::load(&path, &ModelParams::default()).unwrap();
        last_logits(&m, prompt)
    };

    let counting = Arc::new(Counting::default());
    hooks::install(counting.clone()).unwrap();
    let m = Model::load(&path, &ModelParams::default()).unwrap();
    let n_layer: i32 = m.meta("qwen3moe.block_count").unwrap().parse().unwrap();
    let n_expert: i64 = m.meta("qwen3moe.expert_count").unwrap().parse().unwrap();
    let n_used: i64 = m.meta("qwen3moe.expert_used_count").unwrap().parse().unwrap();
    let after = last_logits(&m, prompt);
    drop(m);
    hooks::clear();

    assert!(counting.loaded.load(Ordering::SeqCst) >= 1);
    assert!(counting.freed.load(Ordering::SeqCst) >= 1);
    assert_eq!(*counting.layers.lock().unwrap(), (0..n_layer).collect::<BTreeSet<_>>());
    assert!(counting.calls.load(Ordering::SeqCst) >= n_layer as usize);
    assert_eq!(*counting.shape.lock().unwrap(), Some((n_expert, n_used)));
    assert!(before.iter().all(|v| v.is_finite()));
    assert_eq!(before, after, "a declining hook changed the logits");
}
