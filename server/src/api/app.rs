//! The state every handler shares: the engine handle and what the server was started with.

use crate::api::error::{ApiError, ErrorType};
use crate::api::info::ServerInfo;
use crate::engine::EngineHandle;
use std::sync::{Arc, OnceLock};
use strata_ffi::{ChatTemplates, Model};

#[derive(Clone)]
pub struct App {
    pub engine: EngineHandle,
    pub info: Arc<ServerInfo>,
    /// The model's chat templates, made on first use after loading.
    pub chat: Arc<OnceLock<Result<Arc<ChatTemplates>, String>>>,
}

impl App {
    pub fn new(engine: EngineHandle, info: ServerInfo) -> Self {
        App { engine, info: Arc::new(info), chat: Arc::default() }
    }
}

pub fn loaded_model(engine: &EngineHandle) -> Result<Arc<Model>, ApiError> {
    engine.model().ok_or_else(|| ApiError::new(ErrorType::Unavailable, "Loading model"))
}
