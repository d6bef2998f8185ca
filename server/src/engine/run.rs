//! The engine thread's life: load the model once, then make a context, serve jobs, and free
//! the context while asleep (--sleep-idle-seconds).

use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_ffi::{Context, LoraAdapter, Model, SeqRm, Speculative};
use tokio::sync::{mpsc, watch};

use super::core::Engine;
use super::core::{EngineConfig, Shared};
use super::speculative::new_speculative;
use super::task::{Job, LoraInfo, State, TaskParams};
use crate::cli::config::ServerConfig;

pub(super) fn run(cfg: EngineConfig, rx: mpsc::Receiver<Job>, state: watch::Sender<State>, shared: &Shared) {
    // Failed is sent only after everything the failed start made (contexts, GPU buffers) is freed:
    // the process may exit as soon as it hears, and freeing GPU memory during exit aborts.
    if let Err(e) = start_and_serve(cfg, rx, &state, shared) {
        let _ = state.send(State::Failed(e));
    }
}

fn start_and_serve(mut cfg: EngineConfig, mut rx: mpsc::Receiver<Job>, state: &watch::Sender<State>, shared: &Shared) -> Result<(), String> {
    if let Err(e) = strata_ffi::init_backend(Some(&cfg.params)) {
        return Err(e.to_string());
    }
    let flags = cfg.params.to_json().map_err(|e| e.to_string()).and_then(|v| ServerConfig::from_json(&v))?;
    crate::log::srv(strata_ffi::Verbosity::Info, "load_model", &format!("loading model '{}'", cfg.model_path.display()));
    crate::log::srv(strata_ffi::Verbosity::Trace, "load_model", &format!("local path '{}'", cfg.model_path.display()));
    if let Some(g) = cfg.gemm.as_ref() {
        for (level, line) in crate::gemm::start(g, cfg.main_gpu) {
            crate::log::srv(level, "load_model", &line);
        }
    }
    fit(&mut cfg)?;
    let prepared = match cfg.experts.as_ref().map(|e| crate::experts::prepare(e, &cfg.model_path, cfg.use_mmap)).transpose() {
        Ok(p) => p,
        Err(e) => {
            return Err(e);
        }
    };
    if let Some(ple) = cfg.ple {
        match strata_ffi::install_hooks().map_err(|e| e.to_string()).and_then(|()| strata_ffi::ple::enable(&cfg.model_path, ple)) {
            Ok(s) => crate::log::srv(
                strata_ffi::Verbosity::Info,
                "load_model",
                &format!(
                    "PLE: the table ({} rows of {} bytes, {:.1} MiB) stays in the file; a batch's rows are read by {} {} readers into a {} MiB row cache",
                    s.n_rows,
                    s.row_bytes,
                    s.table_bytes as f64 / (1u64 << 20) as f64,
                    s.threads,
                    if s.direct { "direct-I/O" } else { "buffered (the filesystem refused O_DIRECT)" },
                    ple.cache_bytes >> 20
                ),
            ),
            Err(e) => {
                return Err(format!("--ple-mode ssd: {e}"));
            }
        }
    }
    let model = match cfg.params.model_params().and_then(|mparams| Model::load(&cfg.model_path, &mparams)) {
        Ok(m) => Arc::new(m),
        Err(strata_ffi::FfiError::ModelLoad(_)) => {
            // llama-server's two lines: common_init_from_params's, then the server's
            let path = cfg.model_path.display();
            crate::log::line(strata_ffi::Verbosity::Error, &format!("cmn  common_init_: failed to load model '{path}'"));
            return Err(format!("failed to load model, '{path}'"));
        }
        Err(e) => {
            return Err(e.to_string());
        }
    };
    let _ = shared.model.set(model.clone());
    cfg.params.init_sampling(&model).map_err(|e| e.to_string())?;
    // /props shows a default-made task's settings: the server's sampling, nothing else of its
    // flags (no speculative types, no reasoning format, no -n)
    let base = TaskParams { reasoning_format: "none".into(), ..TaskParams::default() };
    match strata_ffi::sampling_settings(Some(&cfg.params), &serde_json::json!({}), 0) {
        Ok(mut s) => {
            s["speculative.types"] = "none".into();
            let _ = shared.default_settings.set(super::settings::task_settings(&s, &base, -1, true));
        }
        Err(e) => {
            return Err(e.to_string());
        }
    }
    let mut adapters = Vec::new();
    let mut infos = Vec::new();
    for (path, scale) in &cfg.lora {
        match LoraAdapter::load(&model, path) {
            Ok(a) => {
                infos.push(LoraInfo {
                    path: path.to_string_lossy().into_owned(),
                    scale: *scale,
                    task_name: a.meta("adapter.lora.task_name"),
                    prompt_prefix: a.meta("adapter.lora.prompt_prefix"),
                    alora_string: a
                        .alora_invocation_tokens()
                        .iter()
                        .map(|&t| String::from_utf8_lossy(&model.vocab().token_to_piece(t, true)).into_owned())
                        .collect(),
                    alora_tokens: a.alora_invocation_tokens(),
                });
                adapters.push(a);
            }
            Err(e) => {
                return Err(e.to_string());
            }
        }
    }
    if let Ok(mut l) = shared.lora.lock() {
        *l = infos;
    }
    let kv_resident = cfg.kv_resident;
    let kv_plan = kv_resident.map(|n| kv_plan(&mut cfg, &model, n));
    if let Some(p) = kv_plan.as_ref().filter(|p| p.host) {
        strata_ffi::install_hooks().map_err(|e| e.to_string())?;
        strata_ffi::kv::set_sparse_kv_host(true);
        strata_ffi::kv::set_qsa_gather(p.gather.max(cfg.experts.as_ref().map_or(0, |e| e.lab.qsa_gather)));
    }
    let mut woken_by: Option<Job> = None;
    let mut placed = false;
    open_step_trace(cfg.step_trace.as_deref());
    loop {
        let ctx = match cfg.params.context_params().and_then(|p| Context::for_server(&model, with_op_profile(p, cfg.op_profile.as_deref()), &cfg.params)) {
            Ok(c) => c,
            Err(e) => {
                return Err(e.to_string());
            }
        };
        let mut ctx = ctx;
        // the draft context exists before the hot tier is sized, so that its buffers are counted
        let mut spec = new_speculative(&mut cfg, &mut ctx)?;
        if let Some(p) = kv_plan.as_ref().filter(|_| !placed) {
            let (warn, line) = p.line(strata_ffi::kv::host_bytes());
            crate::log::srv(if warn { strata_ffi::Verbosity::Warn } else { strata_ffi::Verbosity::Info }, "load_model", &line);
        }
        if let Some(p) = prepared.as_ref().filter(|_| !placed) {
            let draft = spec.as_ref().and_then(|s| s.hot_device_use(cfg.main_gpu));
            if let Some((ub, line)) = crate::experts::prompt_batch_fit(p, cfg.main_gpu, &mut ctx, draft) {
                crate::log::srv(strata_ffi::Verbosity::Warn, "load_model", &line);
                drop(spec);
                drop(ctx);
                cfg.params.set_n_ubatch(ub);
                continue;
            }
            match crate::experts::place(p, &model, cfg.main_gpu, &mut ctx, draft) {
                Ok(r) => *shared.residency.lock().unwrap_or_else(|e| e.into_inner()) = Some(r),
                Err(e) => {
                    return Err(e);
                }
            }
            placed = true;
        }
        ctx.init_from_params(&mut cfg.params).map_err(|e| e.to_string())?;
        // init_from_params turns the context shift off where the memory cannot shift, as upstream does
        cfg.ctx_shift &= ctx.can_shift();
        let probed = ctx.probe_seq_rm().and_then(|s| Ok((s, spec.as_mut().map_or(Ok(SeqRm::Partial), Speculative::probe_seq_rm)?)));
        let (seq_rm, draft_seq_rm) = match probed {
            Ok(p) => p,
            Err(e) => {
                return Err(e.to_string());
            }
        };
        let mut engine = Engine::new(ctx, spec, [seq_rm, draft_seq_rm], &cfg, &flags, shared, &adapters);
        // llama-server's init, once the slots are made, fails on a UI config that is no JSON
        if let Some(why) = Some(&flags.ui_config_json).filter(|c| !c.is_empty()).and_then(|c| strata_ffi::json_parse_error(c.as_bytes())) {
            let msg = format!("init: failed to parse UI config: {why}");
            crate::log::srv(strata_ffi::Verbosity::Error, "init", &msg);
            return Err(msg);
        }
        let _ = shared.n_ctx_slot.set(engine.n_ctx_slot);
        shared.sleeping.store(false, std::sync::atomic::Ordering::Relaxed);
        let _ = state.send(State::Ready);
        if let Some(job) = woken_by.take() {
            engine.take(job);
        }
        match serve_jobs(&mut engine, &mut rx, shared, cfg.sleep_idle) {
            Some(job) => woken_by = Some(job),
            None => return Ok(()),
        }
    }
}

/// --fit, before the model loads: llama.cpp sizes the layers on the GPU and the context to free
/// device memory. Strata's expert tiers place the model themselves, so the fit stays out of
/// their way.
fn fit(cfg: &mut EngineConfig) -> Result<(), String> {
    if cfg.experts.is_some() {
        let on = cfg.params.to_json().map_err(|e| e.to_string())?["fit_params"].as_bool().unwrap_or(false);
        if on {
            crate::log::srv(strata_ffi::Verbosity::Info, "load_model", "--fit is skipped: the expert tiers size the model's use of GPU memory themselves");
        }
        return Ok(());
    }
    cfg.params.fit().map(|_| ()).map_err(|e| e.to_string())
}

/// What a wait for work ended with.
pub(super) enum Wait {
    Job(Job),
    Idle,
    Closed,
}

pub(super) fn wait_for_job(rx: &mut mpsc::Receiver<Job>, limit: Option<Duration>) -> Wait {
    let Some(limit) = limit else {
        return rx.blocking_recv().map_or(Wait::Closed, Wait::Job);
    };
    let t0 = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(job) => return Wait::Job(job),
            Err(mpsc::error::TryRecvError::Disconnected) => return Wait::Closed,
            Err(mpsc::error::TryRecvError::Empty) if t0.elapsed() >= limit => return Wait::Idle,
            Err(mpsc::error::TryRecvError::Empty) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Runs the engine until the channel closes (None), or, with --sleep-idle-seconds, until it
/// has been idle that long: then the context (KV cache, compute buffers) is freed and the job
/// that wakes the server is returned. The weights stay loaded.
pub(super) fn serve_jobs(engine: &mut Engine<'_>, rx: &mut mpsc::Receiver<Job>, shared: &Shared, sleep_idle: Option<Duration>) -> Option<Job> {
    loop {
        if engine.is_idle() {
            match wait_for_job(rx, sleep_idle) {
                Wait::Job(job) => engine.take(job),
                Wait::Closed => return None,
                Wait::Idle => {
                    shared.sleeping.store(true, std::sync::atomic::Ordering::Relaxed);
                    crate::log::srv(strata_ffi::Verbosity::Info, "handle_sleep", "entering sleeping state");
                    return rx.blocking_recv();
                }
            }
        }
        while let Ok(job) = rx.try_recv() {
            engine.take(job);
        }
        engine.run_slot_actions();
        let worked = engine.step();
        engine.publish();
        if !worked && !engine.pending.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// STRATA_STEP_TRACE=FILE: the host's time around each decode step (diagnostics).
pub(super) fn open_step_trace(path: Option<&std::path::Path>) {
    let Some(path) = path else { return };
    if let Err(e) = strata_ffi::step_trace::open(path) {
        crate::log::warn(&format!("STRATA_STEP_TRACE: cannot write {}: {e}", path.display()));
    }
}

/// STRATA_OP_PROFILE=FILE: per-op times of each prompt batch (diagnostics; runs the graph node by node).
pub(super) fn with_op_profile(p: strata_ffi::ContextParams, path: Option<&std::path::Path>) -> strata_ffi::ContextParams {
    let Some(path) = path else { return p };
    match p.with_op_profile(path) {
        Ok(p) => p,
        Err(e) => {
            crate::log::warn(&format!("STRATA_OP_PROFILE: cannot write {}: {e}", path.display()));
            p
        }
    }
}

/// What `--kv-resident N` comes to for this model and context (before the contexts exist).
fn kv_plan(cfg: &mut EngineConfig, model: &Model, n: u64) -> crate::kv::KvPlan {
    // every layer index a model may have, its MTP layers included
    let sparse = (0..512).filter(|&il| strata_ffi::kv::layer_sparse(model, il)).count();
    let params = cfg.params.to_json().unwrap_or_default();
    let n_ctx = params["n_ctx"].as_u64().filter(|&c| c > 0).unwrap_or(model.n_ctx_train().max(0) as u64);
    // llama_flash_attn_type: -1 auto, 0 disabled, 1 enabled
    let fa_off = cfg.params.llama_params_json().is_ok_and(|v| v["context"]["flash_attn_type"].as_i64() == Some(0));
    let n_ctx_seq = if cfg.kv_unified { n_ctx } else { n_ctx / cfg.n_parallel.max(1) as u64 };
    let gpu = strata_ffi::moe::has_gpu().then(|| strata_ffi::moe::hot_device_memory(cfg.main_gpu).2);
    crate::kv::plan(n, n_ctx_seq, sparse, gpu.as_deref(), fa_off)
}
