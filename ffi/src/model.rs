use std::ffi::c_char;
use std::marker::PhantomData;
use std::path::Path;
use std::ptr::NonNull;

use crate::error::{FfiError, Result};
use crate::shim_string::{self, call};
use crate::sys;

pub type Token = sys::llama_token;

/// llama_model_params, possibly borrowing from the `ServerParams` it came from.
pub struct ModelParams<'a> {
    raw: sys::llama_model_params,
    _borrow: PhantomData<&'a ()>,
}

impl ModelParams<'_> {
    pub(crate) fn from_raw(raw: sys::llama_model_params) -> Self {
        Self { raw, _borrow: PhantomData }
    }
}

impl Default for ModelParams<'static> {
    fn default() -> Self {
        // SAFETY: returns a plain struct of defaults.
        let mut raw = unsafe { sys::llama_model_default_params() };
        raw.n_gpu_layers = 0;
        Self::from_raw(raw)
    }
}

pub struct Model {
    ptr: NonNull<sys::llama_model>,
}

// SAFETY: a loaded llama_model is not tied to a thread; it is freed once, by Drop.
unsafe impl Send for Model {}
// SAFETY: llama.cpp's model is immutable once loaded and read concurrently by any number of
// contexts (llama-server shares one across slots). Strata's tiers attached to it change only
// inside a decode that holds the model's gate (crate::decode_scope), whichever thread runs it.
unsafe impl Sync for Model {}

impl ModelParams<'static> {
    /// Only the vocabulary: enough for tokenization, no weights read.
    pub fn vocab_only() -> Self {
        let mut p = Self::default();
        p.raw.vocab_only = true;
        p
    }
}

impl Model {
    pub fn load(path: &Path, params: &ModelParams<'_>) -> Result<Self> {
        crate::backend::load_backends();
        let display = path.display().to_string();
        let c_path = shim_string::cstring(&display, "model path")?;
        // SAFETY: valid C string and params; a null return means failure.
        let ptr = unsafe { sys::llama_model_load_from_file(c_path.as_ptr(), params.raw) };
        NonNull::new(ptr).map(|ptr| Self { ptr }).ok_or(FfiError::ModelLoad(display))
    }

    pub fn as_ptr(&self) -> *mut sys::llama_model {
        self.ptr.as_ptr()
    }

    pub fn vocab(&self) -> Vocab<'_> {
        // SAFETY: valid model; the vocab lives as long as the model.
        let ptr = unsafe { sys::llama_model_get_vocab(self.as_ptr()) };
        Vocab { ptr: NonNull::new(ptr as *mut _).expect("model without vocab"), _model: PhantomData }
    }

    pub fn n_ctx_train(&self) -> i32 {
        // SAFETY: valid model.
        unsafe { sys::llama_model_n_ctx_train(self.as_ptr()) }
    }

    pub fn n_embd_inp(&self) -> i32 {
        // SAFETY: valid model.
        unsafe { sys::llama_model_n_embd_inp(self.as_ptr()) }
    }

    /// Whether the model keeps recurrent state (SSM/delta-net layers, alone or with attention),
    /// which cannot be cut back to an arbitrary position.
    pub fn has_recurrent_state(&self) -> bool {
        // SAFETY: valid model.
        unsafe { sys::llama_model_is_recurrent(self.as_ptr()) || sys::llama_model_is_hybrid(self.as_ptr()) }
    }

    /// Width of the embeddings the model outputs (of the pooled classifier for rerankers).
    pub fn n_embd_out(&self) -> i32 {
        // SAFETY: valid model.
        unsafe { sys::llama_model_n_embd_out(self.as_ptr()) }
    }

    /// A named chat template stored in the model (e.g. "rerank"), if it has one.
    pub fn named_template(&self, name: &str) -> Option<String> {
        let c = std::ffi::CString::new(name).ok()?;
        // SAFETY: valid model and C string; the result is owned by the model.
        let p = unsafe { sys::llama_model_chat_template(self.as_ptr(), c.as_ptr()) };
        // SAFETY: a non-null result is a NUL-terminated string that lives as long as the model.
        (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }

    /// Sliding-window attention size (0 for models without SWA).
    pub fn n_swa(&self) -> i32 {
        // SAFETY: valid model.
        unsafe { sys::llama_model_n_swa(self.as_ptr()) }
    }

    pub fn n_params(&self) -> u64 {
        // SAFETY: valid model.
        unsafe { sys::llama_model_n_params(self.as_ptr()) }
    }

    pub fn size(&self) -> u64 {
        // SAFETY: valid model.
        unsafe { sys::llama_model_size(self.as_ptr()) }
    }

    pub fn desc(&self) -> String {
        let mut buf = [0 as c_char; 256];
        // SAFETY: buf is writable for its length; the result is NUL-terminated.
        unsafe { sys::llama_model_desc(self.as_ptr(), buf.as_mut_ptr(), buf.len()) };
        // SAFETY: NUL-terminated by llama_model_desc.
        unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
    }

    /// The weights' file type as llama.cpp names it ("Q4_K - Medium", ...).
    pub fn ftype_name(&self) -> String {
        // SAFETY: valid model; llama_ftype_name returns a static string.
        unsafe { std::ffi::CStr::from_ptr(sys::llama_ftype_name(sys::llama_model_ftype(self.as_ptr()))) }.to_string_lossy().into_owned()
    }

    /// A GGUF metadata value as a string, if present.
    pub fn meta(&self, key: &str) -> Option<String> {
        let key = shim_string::cstring(key, "metadata key").ok()?;
        let mut buf = vec![0u8; 256];
        loop {
            // SAFETY: buf is writable for its length.
            let n = unsafe { sys::llama_model_meta_val_str(self.as_ptr(), key.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                return None;
            }
            if (n as usize) < buf.len() {
                buf.truncate(n as usize);
                return Some(String::from_utf8_lossy(&buf).into_owned());
            }
            buf.resize(n as usize + 1, 0);
        }
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: we own the model; contexts borrow it and are dropped first.
        unsafe { sys::llama_model_free(self.ptr.as_ptr()) }
    }
}

/// The model's vocabulary, borrowed from it.
#[derive(Clone, Copy)]
pub struct Vocab<'m> {
    ptr: NonNull<sys::llama_vocab>,
    _model: PhantomData<&'m Model>,
}

impl Vocab<'_> {
    pub fn n_tokens(&self) -> i32 {
        // SAFETY: valid vocab.
        unsafe { sys::llama_vocab_n_tokens(self.ptr.as_ptr()) }
    }

    /// llama_vocab_type as an integer (1 = SPM, 2 = BPE, ...), as llama-server reports it.
    pub fn kind(&self) -> u32 {
        // SAFETY: valid vocab.
        unsafe { sys::llama_vocab_type(self.ptr.as_ptr()) as u32 }
    }

    pub fn bos(&self) -> Token {
        // SAFETY: valid vocab.
        unsafe { sys::llama_vocab_bos(self.ptr.as_ptr()) }
    }

    pub fn eos(&self) -> Token {
        // SAFETY: valid vocab.
        unsafe { sys::llama_vocab_eos(self.ptr.as_ptr()) }
    }

    fn special(&self, f: unsafe extern "C" fn(*const sys::llama_vocab) -> Token) -> Option<Token> {
        // SAFETY: valid vocab; these accessors only read it.
        let t = unsafe { f(self.ptr.as_ptr()) };
        (t != sys::LLAMA_TOKEN_NULL).then_some(t)
    }

    /// Fill-in-the-middle tokens: prefix, suffix, middle, repository, file separator.
    pub fn fim_pre(&self) -> Option<Token> {
        self.special(sys::llama_vocab_fim_pre)
    }
    pub fn fim_suf(&self) -> Option<Token> {
        self.special(sys::llama_vocab_fim_suf)
    }
    pub fn fim_mid(&self) -> Option<Token> {
        self.special(sys::llama_vocab_fim_mid)
    }
    pub fn fim_rep(&self) -> Option<Token> {
        self.special(sys::llama_vocab_fim_rep)
    }
    pub fn fim_sep(&self) -> Option<Token> {
        self.special(sys::llama_vocab_fim_sep)
    }

    pub fn is_eog(&self, t: Token) -> bool {
        // SAFETY: valid vocab; out-of-range tokens are handled by llama.cpp.
        unsafe { sys::llama_vocab_is_eog(self.ptr.as_ptr(), t) }
    }

    pub fn add_bos(&self) -> bool {
        // SAFETY: valid vocab.
        unsafe { sys::llama_vocab_get_add_bos(self.ptr.as_ptr()) }
    }

    pub fn add_eos(&self) -> bool {
        // SAFETY: valid vocab.
        unsafe { sys::llama_vocab_get_add_eos(self.ptr.as_ptr()) }
    }

    pub fn add_sep(&self) -> bool {
        // SAFETY: valid vocab.
        unsafe { sys::llama_vocab_get_add_sep(self.ptr.as_ptr()) }
    }

    pub fn sep(&self) -> Option<Token> {
        self.special(sys::llama_vocab_sep)
    }

    pub fn tokenize(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<Token>> {
        let len = i32::try_from(text.len()).map_err(|_| FfiError::Tokenize("text too long".into()))?;
        let mut out = vec![0 as Token; text.len() + 2];
        for _ in 0..2 {
            let mut err = std::ptr::null_mut();
            // SAFETY: text is valid for len bytes (no NUL needed); out is writable for its length.
            let n = unsafe {
                sys::strata_tokenize(self.ptr.as_ptr(), text.as_ptr().cast(), len, out.as_mut_ptr(), out.len() as i32, add_special, parse_special, &mut err)
            };
            if let Some(e) = crate::shim_string::take(err) {
                return Err(FfiError::Tokenize(e));
            }
            if n == i32::MIN {
                return Err(FfiError::Tokenize("token count overflows i32".into()));
            }
            if n >= 0 {
                out.truncate(n as usize);
                return Ok(out);
            }
            out.resize((-n) as usize, 0);
        }
        Err(FfiError::Tokenize("buffer size changed between calls".into()))
    }

    /// One token's text piece as bytes (may be a partial UTF-8 sequence); an id outside the
    /// vocabulary gives an empty piece (see [`Vocab::try_token_to_piece`]).
    pub fn token_to_piece(&self, t: Token, special: bool) -> Vec<u8> {
        self.try_token_to_piece(t, special).unwrap_or_default()
    }

    /// One token's text piece, or llama.cpp's error for an id outside the vocabulary.
    pub fn try_token_to_piece(&self, t: Token, special: bool) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 32];
        loop {
            let n = call(|err| {
                // SAFETY: buf is writable for its length.
                let n = unsafe { sys::strata_token_to_piece(self.ptr.as_ptr(), t, buf.as_mut_ptr().cast(), buf.len() as i32, 0, special, err) };
                (n != i32::MIN).then_some(n)
            })?;
            if n >= 0 {
                buf.truncate(n as usize);
                return Ok(buf);
            }
            buf.resize((-n) as usize, 0);
        }
    }

    /// The text of `tokens` (lossy UTF-8), or llama.cpp's error for an id outside the vocabulary.
    pub fn detokenize(&self, tokens: &[Token], remove_special: bool, unparse_special: bool) -> Result<String> {
        let mut buf = vec![0u8; tokens.len() * 8 + 16];
        loop {
            let n = call(|err| {
                // SAFETY: tokens and buf are valid for their lengths.
                let n = unsafe {
                    sys::strata_detokenize(
                        self.ptr.as_ptr(),
                        tokens.as_ptr(),
                        tokens.len() as i32,
                        buf.as_mut_ptr().cast(),
                        buf.len() as i32,
                        remove_special,
                        unparse_special,
                        err,
                    )
                };
                (n != i32::MIN).then_some(n)
            })?;
            if n >= 0 {
                buf.truncate(n as usize);
                return Ok(String::from_utf8_lossy(&buf).into_owned());
            }
            buf.resize((-n) as usize, 0);
        }
    }
}
