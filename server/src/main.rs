//! strata-server: llama-server's command line and HTTP API over the pinned, patched llama.cpp.

#![forbid(unsafe_code)]

mod agent;
mod api;
mod cli;
mod engine;
mod experts;
mod gemm;
mod log;
mod ple;
mod router;

use cli::flags;
use std::ffi::{c_char, c_int};
use std::io::Write;
use std::process::ExitCode;

use anyhow::{Context as _, Result};
use strata_ffi::{ParseOutcome, ServerParams};

extern "C" fn print_strata_usage(_argc: c_int, _argv: *mut *mut c_char) {
    strata_ffi::flush_c_stdio();
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(flags::help_section().as_bytes());
    let _ = out.flush();
}

fn main() -> ExitCode {
    let child = router::ChildLink::from_env();
    let args: Vec<String> = std::env::args().collect();
    let (strata_args, llama_args) = match flags::split(&args) {
        Ok(split) => split,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(1);
        }
    };
    let experts = match experts::ExpertConfig::from_args(&strata_args) {
        Ok(c) => c,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(1);
        }
    };
    let mut parse_args = llama_args.clone();
    if let Some(c) = &experts {
        parse_args.extend(c.llama_args().iter().map(|a| a.to_string()));
    }
    if let Some(mode) = strata_args.ple_mode {
        parse_args.extend(mode.llama_args().iter().map(|a| a.to_string()));
    }
    let ple = match ple::config(&strata_args, std::env::var("STRATA_IO_THREADS").ok().as_deref()) {
        Ok(p) => p,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(1);
        }
    };
    let gemm = match gemm::config(|v| std::env::var(v).ok()) {
        Ok(g) => g,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(1);
        }
    };
    if let Err(e) = strata_ffi::common_init() {
        eprintln!("strata-server: error: {e}");
        return ExitCode::from(1);
    }
    let mut params = match ServerParams::parse(&parse_args, Some(print_strata_usage)) {
        Ok(ParseOutcome::Parsed(p)) => p,
        Ok(ParseOutcome::Rejected) => return ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    if let Some(link) = child.as_ref().filter(|l| l.mode == router::ChildMode::Download) {
        return router::run_download(link, params);
    }
    if params.to_json().is_ok_and(|cfg| !router::is_router(&cfg)) {
        if let Err(e) = strata_ffi::resolve_models(&mut params) {
            eprintln!("strata-server: error: failed to download model: {e}");
            return ExitCode::from(1);
        }
    }
    if let Err(e) = params.apply_server_defaults() {
        eprintln!("strata-server: error: {e}");
        return ExitCode::from(1);
    }
    match serve(params, strata_args, experts, ple, gemm, &llama_args, child) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("strata-server: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn serve(
    params: ServerParams,
    strata: flags::StrataArgs,
    experts: Option<experts::ExpertConfig>,
    ple: Option<strata_ffi::ple::PleConfig>,
    gemm: Option<gemm::GemmConfig>,
    llama_args: &[String],
    child: Option<std::sync::Arc<router::ChildLink>>,
) -> Result<()> {
    for w in flags::warnings(&strata, experts.is_some(), |v| std::env::var_os(v).is_some()) {
        eprintln!("strata: warning: {w}");
    }
    let max_queued = strata.max_queued;
    let sampler_argmax = match std::env::var("STRATA_SAMPLER_ARGMAX").as_deref().map(str::trim) {
        Err(_) | Ok("") | Ok("1") => true,
        Ok("0") => false,
        Ok(v) => anyhow::bail!(
            "STRATA_SAMPLER_ARGMAX: invalid value '{v}': expected 1 (greedy sampling answers from a scan of the logits) or 0 (the sampler chain every time)"
        ),
    };
    let cfg = params.to_json().context("reading parsed parameters")?;
    let conf = cli::config::ServerConfig::from_json(&cfg).map_err(|e| anyhow::anyhow!(e))?;
    let hosts = if conf.hostnames.is_empty() { vec!["127.0.0.1".to_string()] } else { conf.hostnames.clone() };
    let gcp = api::gcp::Gcp::from_env();
    let port = gcp.as_ref().and_then(|g| g.port).map_or(conf.port, i64::from);
    if router::is_router(&cfg) {
        return router::serve(&cfg, llama_args, router::own_flag_args(&strata), hosts, port);
    }
    let model_alias = conf.alias();
    let n_parallel = usize::try_from(conf.n_parallel).unwrap_or(1).max(1);
    let n_batch = usize::try_from(conf.n_batch).unwrap_or(0);
    // llama.cpp reserves one output per sequence but at most n_batch outputs: it would abort.
    if n_parallel > n_batch {
        anyhow::bail!("--parallel ({n_parallel}) must not exceed --batch-size ({n_batch})");
    }

    let tools = agent::tools::Tools::from_params(&cfg).context("tools setup failed")?;
    let info = api::info::ServerInfo::from_params(&cfg, model_alias.clone(), n_parallel);
    api::ui::check(&info)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let mut listeners = Vec::new();
        for host in &hosts {
            listeners.push(api::listen::Listener::bind(host, port as u16).await?);
        }
        let engine = engine::spawn(engine::EngineConfig {
            params,
            model_path: conf.model.clone(),
            model_alias,
            n_parallel,
            kv_unified: conf.kv_unified,
            n_predict_default: conf.n_predict,
            sleep_idle: conf.sleep_idle(),
            ctx_shift: conf.ctx_shift,
            experts,
            ple,
            gemm,
            max_queued,
            use_mmap: conf.load_mode.maps_the_file(),
            main_gpu: usize::try_from(conf.main_gpu).unwrap_or(0),
            sampler_argmax,
            cache_ram_mib: conf.cache_ram_mib,
            cache_idle_slots: conf.cache_idle_slots,
            n_ctx_checkpoints: usize::try_from(conf.n_ctx_checkpoints).unwrap_or(0),
            checkpoint_min_step: usize::try_from(conf.checkpoint_min_step).unwrap_or(0),
            swa_full: conf.swa_full,
            slot_prompt_similarity: conf.slot_prompt_similarity,
            speculative: conf.speculative.enabled,
            n_cache_reuse: conf.n_cache_reuse,
            lora: conf.lora_adapters.iter().map(|a| (a.path.clone(), a.scale)).collect(),
        });
        for l in &listeners {
            crate::log::info(&format!("main: server is listening on {}", l.describe()?));
        }
        let mut state = engine.state_watch();
        let load_failed = async move {
            loop {
                if let engine::State::Failed(msg) = state.borrow_and_update().clone() {
                    return msg;
                }
                if state.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        let agent = agent::Agent::start(&cfg, tools).await.context("MCP starting failed")?;
        if let Some(link) = child {
            tokio::spawn(link.follow_engine(engine.clone(), std::sync::Arc::new(info.clone())));
        }
        let app = api::router_with(engine, info, gcp.as_ref(), agent.routes);
        for l in listeners {
            tokio::spawn(api::listen::accept_loop(l, app.clone(), api::listen::read_timeout(&cfg)));
        }
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {
                agent.mcp.close_all().await;
                Ok(())
            }
            msg = load_failed => {
                eprintln!("main: {msg}");
                anyhow::bail!("exiting due to model loading error");
            }
        }
    })
}
