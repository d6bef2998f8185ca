use thiserror::Error;

pub type Result<T, E = FfiError> = std::result::Result<T, E>;

#[derive(Debug, Error)]
pub enum FfiError {
    #[error("failed to load model from '{0}'")]
    ModelLoad(String),
    #[error("failed to load lora adapter '{0}'")]
    Load(String),
    #[error("failed to create the llama context")]
    ContextInit,
    #[error("{0}")]
    Shim(String),
    /// llama.cpp refused its input (a std::invalid_argument or a JSON error), which
    /// llama-server answers with 400 where other exceptions get 500.
    #[error("{0}")]
    BadInput(String),
    #[error("{0} contains an interior NUL byte")]
    InteriorNul(&'static str),
    #[error("tokenization failed: {0}")]
    Tokenize(String),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("batch is full ({0} tokens)")]
    BatchFull(usize),
    #[error("invalid JSON from llama.cpp: {0}")]
    Json(#[from] serde_json::Error),
}

/// `llama_decode`'s return codes.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DecodeError {
    #[error("could not find a KV slot for the batch")]
    NoKvCacheSlot,
    #[error("decode aborted")]
    Aborted,
    #[error("invalid input batch")]
    InvalidBatch,
    #[error("fatal decode error {0}")]
    Fatal(i32),
    /// Rows a batch needed could not be read from the model file (its output is unusable).
    #[error("{0}")]
    Io(String),
}

impl DecodeError {
    pub(crate) fn check(code: i32) -> Result<(), DecodeError> {
        match code {
            0 => Ok(()),
            1 => Err(Self::NoKvCacheSlot),
            2 => Err(Self::Aborted),
            -1 => Err(Self::InvalidBatch),
            c => Err(Self::Fatal(c)),
        }
    }
}
