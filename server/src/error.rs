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
}

impl ApiError {
    pub fn new(kind: ErrorType, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorType::InvalidRequest, message)
    }

    pub fn server(message: impl Into<String>) -> Self {
        Self::new(ErrorType::Server, message)
    }

    pub fn body(&self) -> serde_json::Value {
        let (status, ty) = self.kind.parts();
        serde_json::json!({"error": {"code": status.as_u16(), "message": self.message, "type": ty}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, _) = self.kind.parts();
        (status, Json(self.body())).into_response()
    }
}
