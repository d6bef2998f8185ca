//! strata-server: llama-server's command line and HTTP API over the pinned, patched llama.cpp.

#![forbid(unsafe_code)]

mod agent;
mod api;
mod cli;
mod engine;
mod experts;
mod gemm;
mod kv;
mod log;
mod ple;
mod router;

use cli::flags;
use std::ffi::{c_char, c_int};
use std::io::Write;
use std::process::ExitCode;

use anyhow::{Context as _, Result};
use strata_ffi::{ParseOutcome, ServerParams, Verbosity};

extern "C" fn print_strata_usage(_argc: c_int, _argv: *mut *mut c_char) {
    strata_ffi::flush_c_stdio();
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(flags::help_section().as_bytes());
    let _ = out.flush();
}

fn main() -> ExitCode {
    let code = run();
    // the log's worker writes asynchronously: what start-up said must be out before the exit
    strata_ffi::flush_c_stdio();
    code
}

fn run() -> ExitCode {
    if let Err(e) = strata_ffi::common_init() {
        eprintln!("error: {e}");
        return ExitCode::from(1);
    }
    let child = router::ChildLink::from_env();
    let args: Vec<String> = std::env::args().collect();
    // a bad value of one of Strata's flags reads as llama.cpp's parser's own errors do
    let (strata_args, llama_args) = match flags::split(&args) {
        Ok(split) => split,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(1);
        }
    };
    let env = match cli::env::read() {
        Ok(s) => s,
        Err(msg) => return fatal(&msg),
    };
    let experts = match experts::ExpertConfig::from_args(&strata_args, &env) {
        Ok(c) => c,
        Err(msg) => return fatal(&msg),
    };
    let mut parse_args = llama_args.clone();
    if let Some(c) = &experts {
        parse_args.extend(c.llama_args().iter().map(|a| a.to_string()));
        // the tiers' own --cpu-moe needs the mapping the loader would advise against
        strata_ffi::log_mute("llama_model_loader: tensor overrides to CPU are used with mmap enabled");
    }
    if let Some(mode) = strata_args.ple_mode {
        parse_args.extend(mode.llama_args().iter().map(|a| a.to_string()));
    }
    if parse_args.iter().any(|a| a == "--version") {
        // llama.cpp's parser prints the pin's version after this and exits
        eprintln!("strata-server {} (commit {})", env!("CARGO_PKG_VERSION"), env!("STRATA_GIT_COMMIT"));
    }
    let mut params = match parse_params(&parse_args) {
        Ok(p) => p,
        Err(code) => return code,
    };
    // --spec N without a drafter: the model's MTP head drafts where it has one
    let drafting = params.to_json().ok().and_then(|cfg| cli::spec::decide(&strata_args, &cfg));
    if let Some(d) = drafting.as_ref().filter(|d| !d.args.is_empty()) {
        parse_args.extend(d.args.iter().cloned());
        params = match parse_params(&parse_args) {
            Ok(p) => p,
            Err(code) => return code,
        };
    }
    if let Err(code) = refuse_options(&params) {
        return code;
    }
    if let Some(link) = child.as_ref().filter(|l| l.mode == router::ChildMode::Download) {
        return router::run_download(link, params);
    }
    log::srv(Verbosity::Info, "llama_server", "initializing ...");
    if let Some(d) = &drafting {
        log::srv(Verbosity::Info, "llama_server", &d.line);
    }
    if let Err(e) = strata_ffi::init_backend(Some(&params)) {
        return fatal(&e.to_string());
    }
    // a router owns no device: it does not enumerate them
    let is_router = params.to_json().is_ok_and(|cfg| router::is_router(&cfg));
    params.print_info(!is_router);
    if !is_router {
        if let Err(e) = strata_ffi::resolve_models(&mut params) {
            return fatal(&format!("failed to download model: {e}"));
        }
    }
    if let Err(e) = params.apply_server_defaults() {
        return fatal(&e.to_string());
    }
    // again after the download: -hf may have brought a multimodal projector
    if let Err(code) = refuse_options(&params) {
        return code;
    }
    match serve(params, strata_args, env, experts, &llama_args, child) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if e.downcast_ref::<log::Logged>().is_none() {
                log::srv(Verbosity::Error, "llama_server", &format!("{e:#}"));
            }
            ExitCode::from(1)
        }
    }
}

/// llama.cpp's parse of the arguments; a rejection has been reported by its parser.
fn parse_params(args: &[String]) -> Result<ServerParams, ExitCode> {
    match ServerParams::parse(args, Some(print_strata_usage)) {
        Ok(ParseOutcome::Parsed(p)) => Ok(p),
        Ok(ParseOutcome::Rejected) => Err(ExitCode::from(1)),
        Err(e) => {
            eprintln!("error: {e}");
            Err(ExitCode::from(1))
        }
    }
}

/// A start-up error, as llama-server logs its own: an error line, exit status 1.
fn fatal(msg: &str) -> ExitCode {
    log::srv(Verbosity::Error, "llama_server", msg);
    ExitCode::from(1)
}

/// Stops start-up, naming each, where the options ask for what strata-server does not do.
fn refuse_options(params: &ServerParams) -> Result<(), ExitCode> {
    let refused = match (params.to_json(), ServerParams::defaults_json()) {
        (Ok(cfg), Ok(defaults)) => cli::upstream::refusals(&cfg, &defaults),
        (Err(e), _) | (_, Err(e)) => vec![e.to_string()],
    };
    for r in &refused {
        log::srv(Verbosity::Error, "llama_server", r);
    }
    if refused.is_empty() {
        Ok(())
    } else {
        Err(ExitCode::from(1))
    }
}

fn serve(
    params: ServerParams,
    strata: flags::StrataArgs,
    env: cli::env::Settings,
    experts: Option<experts::ExpertConfig>,
    llama_args: &[String],
    child: Option<std::sync::Arc<router::ChildLink>>,
) -> Result<()> {
    for line in flags::alias_lines(&strata) {
        log::srv(Verbosity::Info, "llama_server", &line);
    }
    for w in flags::warnings(&strata, experts.is_some(), &env.set) {
        log::srv(Verbosity::Warn, "llama_server", &w);
    }
    let max_queued = strata.max_queued;
    let ple = ple::config(&strata, &env);
    let gemm = gemm::config(&env);
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

    // llama-server's order: the HTTP server's set-up, the security warning, then the bind
    let info = api::info::ServerInfo::from_params(&cfg, model_alias.clone(), n_parallel);
    api::listen::check_hosts(&hosts, port)?;
    for _ in &hosts {
        api::listen::log_tls(&cfg);
        api::ui::check(&info)?;
    }
    let http = api::listen::Http::from_params(&cfg, n_parallel as i64);
    let rt = http.runtime()?;
    if info.cors_origins == "*" && info.api_keys.is_empty() {
        log::srv(
            Verbosity::Warn,
            "llama_server",
            "security: no API key is set and CORS allows all origins (see https://github.com/ggml-org/llama.cpp/pull/25655)",
        );
    }
    let tools = agent::tools::Tools::from_params(&cfg).context("tools setup failed")?;
    let http = match http.with_tls(&cfg) {
        Ok(h) => h,
        Err(e) => return Err(api::listen::failed(Some(&e.to_string()), &hosts[0], port)),
    };
    let served = rt.block_on(async move {
        let listeners = match api::listen::bind_all(&hosts, port, &http).await {
            Ok(l) => l,
            Err(e) => return Err(api::listen::failed(Some(&format!("{:#}", e.error)), &e.host, port)),
        };
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
            kv_resident: strata.kv_resident,
            gemm,
            max_queued,
            use_mmap: conf.load_mode.maps_the_file(),
            main_gpu: usize::try_from(conf.main_gpu).unwrap_or(0),
            sampler_argmax: env.sampler_argmax,
            step_trace: env.step_trace.clone(),
            op_profile: env.op_profile.clone(),
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
        let addresses = listeners.iter().map(|l| l.describe(http.tls.is_some())).collect::<Result<Vec<_>>>()?;
        let mut state = engine.state_watch();
        let loaded = async move {
            loop {
                match state.borrow_and_update().clone() {
                    engine::State::Failed(msg) => return Err(msg),
                    engine::State::Ready => return Ok(()),
                    engine::State::Loading => {}
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
            tokio::spawn(api::listen::accept_loop(l, app.clone(), http.clone()));
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let stop = async move {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        };
        tokio::pin!(stop);
        tokio::select! {
            _ = &mut stop => {}
            r = loaded => match r {
                Ok(()) => {
                    log::srv(Verbosity::Info, "llama_server", "model loaded");
                    for a in &addresses {
                        log::srv(Verbosity::Info, "llama_server", &format!("listening on {a}"));
                    }
                    if addresses.iter().any(|a| a.ends_with(":8080")) {
                        log::srv(Verbosity::Warn, "llama_server", "notice: server default port will be changed to :9931 in a future release (ref: https://github.com/ggml-org/llama.cpp/pull/26508)");
                    }
                    stop.await;
                }
                Err(msg) => {
                    log::srv(Verbosity::Error, "load_model", &msg);
                    log::cleaning_up();
                    agent.mcp.close_all().await;
                    log::srv(Verbosity::Error, "llama_server", "exiting due to model loading error");
                    return Err(log::Logged.into());
                }
            },
        }
        log::cleaning_up();
        agent.mcp.close_all().await;
        Ok(())
    });
    // The engine thread drops the model and contexts once the handlers are gone: that must end
    // before the process exits, or a GPU backend is torn down under it.
    drop(rt);
    engine::wait_stopped(std::time::Duration::from_secs(60));
    served
}
