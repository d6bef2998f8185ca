//! llama.cpp's error JSON, `{"error":{"code","message","type"}}`, from one place.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorType {
    InvalidRequest,
    Server,
    NotFound,
    Unavailable,
    NotSupported,
    ExceedContextSize,
}

impl ErrorType {
    fn parts(self) -> (StatusCode, &'static str) {
        match self {
            Self::InvalidRequest => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            Self::Server => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
            Self::NotFound => (StatusCode::NOT_FOUND, "not_found_error"),
            Self::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "unavailable_error"),
            Self::NotSupported => (StatusCode::NOT_IMPLEMENTED, "not_supported_error"),
            Self::ExceedContextSize => (StatusCode::BAD_REQUEST, "exceed_context_size_error"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub kind: ErrorType,
    pub message: String,
    /// Fields llama-server adds to some errors (n_prompt_tokens and n_ctx when too long).
    pub extra: serde_json::Map<String, serde_json::Value>,
    /// Seconds for a Retry-After header (a full queue).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(kind: ErrorType, message: impl Into<String>) -> Self {
        Self { kind, message: message.into(), extra: serde_json::Map::new(), retry_after: None }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorType::InvalidRequest, message)
    }

    pub fn server(message: impl Into<String>) -> Self {
        Self::new(ErrorType::Server, message)
    }

    /// A llama.cpp failure as llama-server reports it: input it refused (std::invalid_argument,
    /// a JSON error) is a 400, anything else a 500.
    pub fn from_llama(e: strata_ffi::FfiError) -> Self {
        match e {
            strata_ffi::FfiError::BadInput(m) => Self::invalid(m),
            other => Self::server(other.to_string()),
        }
    }

    pub fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.extra.insert(key.to_string(), value.into());
        self
    }

    pub fn body(&self) -> serde_json::Value {
        let (status, ty) = self.kind.parts();
        let mut e = serde_json::json!({"code": status.as_u16(), "message": self.message, "type": ty});
        for (k, v) in &self.extra {
            e[k] = v.clone();
        }
        serde_json::json!({"error": e})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, _) = self.kind.parts();
        let mut r = (status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}
