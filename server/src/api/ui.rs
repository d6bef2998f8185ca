//! The web UI, served as llama-server serves it: the pin's tools/ui, built by tools/build-ui and
//! embedded gzipped by build.rs (gzip only, `index.html` revalidated and cross-origin isolated,
//! hashed assets cached for a year), or the files of `--path DIR` instead. When the built-in UI
//! is off or replaced, `/sw.js` is a worker that unregisters itself.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_ENCODING, CONTENT_TYPE, ETAG, IF_MODIFIED_SINCE, IF_NONE_MATCH, LAST_MODIFIED, LOCATION};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::api::info::ServerInfo;

/// Marks an answer whose Content-Type goes out as set: a file, not JSON that Strata wrote.
#[derive(Clone, Copy)]
pub struct Verbatim;

/// One gzipped file of the built UI.
pub struct Asset {
    pub name: &'static str,
    pub data: &'static [u8],
    /// `"<sha256 of data>"`, quotes included.
    pub etag: &'static str,
    pub mime: &'static str,
}

static ASSETS: &[Asset] = include!(concat!(env!("OUT_DIR"), "/ui_assets.rs"));

const CACHE_IMMUTABLE: &str = "public, max-age=31536000, immutable";
const CACHE_REVALIDATE: &str = "no-cache";
/// What the installed app checks for updates: never cached as immutable.
const NO_CACHE_NAMES: &[&str] = &["sw.js", "manifest.webmanifest", "_app/version.json", "build.json"];

/// A browser that used the built-in UI keeps its service worker and would go on showing that
/// UI; this worker replaces it, removes itself and its caches, and reloads the open pages.
const SW_REMOVE_JS: &str = r#"
self.addEventListener('install', () => self.skipWaiting());
self.addEventListener('activate', (event) => event.waitUntil((async () => {
    await self.registration.unregister();
    await Promise.all((await caches.keys()).map((key) => caches.delete(key)));
    for (const client of await self.clients.matchAll({ type: 'window' })) client.navigate(client.url);
})()));
"#;

#[derive(Debug, thiserror::Error)]
pub enum UiError {
    #[error("static assets path not found: {0}")]
    PathNotFound(String),
}

/// llama-server's frontend paths: "/" and every embedded asset, literally (no --api-prefix).
/// They load while the model does, and need no API key.
pub fn is_frontend_path(path: &str) -> bool {
    path == "/" || path.strip_prefix('/').is_some_and(|name| ASSETS.iter().any(|a| a.name == name))
}

/// What llama-server's HTTP set-up logs and checks about the UI; a `--path` that is no
/// directory stops the server.
pub fn check(info: &ServerInfo) -> Result<(), UiError> {
    if !info.ui {
        crate::log::srv(strata_ffi::Verbosity::Info, "init_listene", "The UI is disabled");
        crate::log::srv(strata_ffi::Verbosity::Info, "init_listene", "Use --ui/--no-ui (or deprecated --webui/--no-webui) to enable/disable");
    } else if !info.public_path.is_empty() && !Path::new(&info.public_path).is_dir() {
        crate::log::srv(strata_ffi::Verbosity::Error, "init_listene", &format!("static assets path not found: {}", info.public_path));
        return Err(UiError::PathNotFound(info.public_path.clone()));
    } else if info.public_path.is_empty() {
        for a in ASSETS.iter().filter(|a| NO_CACHE_NAMES.contains(&a.name)) {
            crate::log::srv(strata_ffi::Verbosity::Debug, "init_listene", &format!("serve nocache for {}", a.name));
        }
    }
    Ok(())
}

#[derive(Clone)]
enum Source {
    /// --no-ui
    Off,
    /// The built-in UI; an empty table when the server was built without it.
    Embedded(&'static [Asset]),
    /// --path DIR
    Dir(PathBuf),
}

/// The middleware state: where the UI comes from and the --api-prefix it is mounted under.
pub struct Ui {
    prefix: String,
    source: Source,
}

impl Ui {
    pub fn new(info: &ServerInfo) -> Arc<Self> {
        let source = if !info.ui {
            Source::Off
        } else if !info.public_path.is_empty() {
            Source::Dir(PathBuf::from(&info.public_path))
        } else {
            Source::Embedded(ASSETS)
        };
        Arc::new(Self { prefix: info.api_prefix.clone(), source })
    }

    async fn answer(&self, path: &str, headers: &HeaderMap) -> Option<Response> {
        let sub = path.strip_prefix(self.prefix.as_str()).filter(|s| s.starts_with('/'))?;
        match &self.source {
            Source::Embedded(assets) => embedded(assets, sub, headers),
            Source::Dir(dir) => match static_file(dir, sub, headers).await {
                Some(res) => Some(res),
                None => (sub == "/sw.js").then(remove_worker),
            },
            Source::Off => (sub == "/sw.js").then(remove_worker),
        }
    }
}

/// Answers GET and HEAD for UI paths ahead of the API routes (static files come first in
/// llama-server's HTTP library too); everything else goes on to the routes.
pub async fn serve(State(ui): State<Arc<Ui>>, req: Request, next: Next) -> Response {
    if req.method() == Method::GET || req.method() == Method::HEAD {
        if let Some(mut res) = ui.answer(req.uri().path(), req.headers()).await {
            res.extensions_mut().insert(Verbatim);
            return res;
        }
    }
    next.run(req).await
}

fn remove_worker() -> Response {
    ([(CACHE_CONTROL, "no-cache"), (CONTENT_TYPE, "application/javascript")], SW_REMOVE_JS).into_response()
}

fn embedded(assets: &'static [Asset], sub: &str, headers: &HeaderMap) -> Option<Response> {
    let name = match sub {
        "/" | "/index.html" => "index.html",
        _ => sub.strip_prefix('/')?,
    };
    let asset = assets.iter().find(|a| a.name == name)?;
    // Only the first Accept-Encoding header counts, as in llama-server.
    let accept = headers.get("accept-encoding").and_then(|v| v.to_str().ok()).unwrap_or("");
    if !accept.contains("gzip") {
        return Some((StatusCode::UNSUPPORTED_MEDIA_TYPE, [(CONTENT_TYPE, "text/plain")], "Error: gzip is not supported by this browser").into_response());
    }
    let mut res = Response::builder().header(CONTENT_ENCODING, "gzip");
    if NO_CACHE_NAMES.contains(&name) {
        res = res.header(CACHE_CONTROL, CACHE_REVALIDATE);
    } else {
        res = res.header(ETAG, asset.etag);
        let inm = headers.get(IF_NONE_MATCH).map(|v| v.as_bytes()).unwrap_or_default();
        if inm == asset.etag.as_bytes() || inm.strip_prefix(b"W/") == Some(asset.etag.as_bytes()) {
            return Some(res.status(StatusCode::NOT_MODIFIED).body(Body::empty()).unwrap());
        }
        if name == "index.html" {
            res = res
                .header("cross-origin-embedder-policy", "require-corp")
                .header("cross-origin-opener-policy", "same-origin")
                .header(CACHE_CONTROL, CACHE_REVALIDATE);
        } else {
            res = res.header(CACHE_CONTROL, CACHE_IMMUTABLE);
        }
    }
    Some(res.header(CONTENT_TYPE, asset.mime).body(Body::from(asset.data)).unwrap())
}

/// A file of `--path DIR` the way llama-server's HTTP library serves a mount point: `..` may
/// not climb out, a directory redirects to its trailing-slash form and serves its index.html,
/// a weak ETag of mtime and size and Last-Modified answer conditional requests. None when no
/// such file exists, so the request goes on to the routes.
async fn static_file(dir: &Path, sub: &str, headers: &HeaderMap) -> Option<Response> {
    let decoded: Vec<u8> = percent_encoding::percent_decode_str(sub).collect();
    if !is_valid_path(&decoded) {
        return None;
    }
    let mut path = dir.as_os_str().to_os_string().into_vec();
    path.extend_from_slice(&decoded);
    if path.ends_with(b"/") {
        path.extend_from_slice(b"index.html");
    }
    let path = PathBuf::from(OsString::from_vec(path));
    if let (Ok(real), Ok(base)) = (std::fs::canonicalize(&path), std::fs::canonicalize(dir)) {
        if !real.starts_with(&base) {
            return Some(StatusCode::FORBIDDEN.into_response());
        }
    }
    let meta = tokio::fs::metadata(&path).await.ok()?;
    if meta.is_dir() {
        return Some((StatusCode::MOVED_PERMANENTLY, [(LOCATION, format!("{sub}/"))]).into_response());
    }
    if !meta.is_file() {
        return None;
    }
    let mtime = meta.modified().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_secs());
    let etag = format!("W/\"{mtime:x}-{:x}\"", meta.len());
    let last_modified = httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(mtime));
    let validators = [(ETAG, etag.clone()), (LAST_MODIFIED, last_modified)];
    if not_modified(headers, &etag, UNIX_EPOCH + Duration::from_secs(mtime)) {
        return Some((StatusCode::NOT_MODIFIED, validators).into_response());
    }
    let body = tokio::fs::read(&path).await.ok()?;
    Some((validators, [(CONTENT_TYPE, file_mime(&path))], body).into_response())
}

/// If-None-Match (a list of tags, or `*`) decides when present; else If-Modified-Since.
fn not_modified(headers: &HeaderMap, etag: &str, mtime: SystemTime) -> bool {
    let values: Vec<&str> = headers.get_all(IF_NONE_MATCH).iter().filter_map(|v| v.to_str().ok()).collect();
    if !values.is_empty() {
        return values.iter().flat_map(|v| v.split(',')).map(str::trim).any(|t| t == "*" || t == etag);
    }
    let since = headers.get(IF_MODIFIED_SINCE).and_then(|v| v.to_str().ok()).and_then(|v| httpdate::parse_http_date(v).ok());
    since.is_some_and(|t| mtime <= t)
}

/// No NUL or backslash, and no `..` above the root.
fn is_valid_path(path: &[u8]) -> bool {
    let mut level = 0usize;
    for part in path.split(|&b| b == b'/').filter(|p| !p.is_empty()) {
        if part.iter().any(|&b| b == 0 || b == b'\\') {
            return false;
        }
        match part {
            b"." => {}
            b".." if level == 0 => return false,
            b".." => level -= 1,
            _ => level += 1,
        }
    }
    true
}

/// The content types llama-server's HTTP library gives static files, by extension.
fn file_mime(path: &Path) -> &'static str {
    match path.extension().and_then(|e| e.to_str()).unwrap_or("") {
        "css" => "text/css",
        "csv" => "text/csv",
        "htm" | "html" => "text/html",
        "js" | "mjs" => "text/javascript",
        "txt" => "text/plain",
        "vtt" => "text/vtt",
        "apng" => "image/apng",
        "avif" => "image/avif",
        "bmp" => "image/bmp",
        "gif" => "image/gif",
        "png" => "image/png",
        "svg" => "image/svg+xml",
        "webp" => "image/webp",
        "ico" => "image/x-icon",
        "tif" | "tiff" => "image/tiff",
        "jpg" | "jpeg" => "image/jpeg",
        "mp4" => "video/mp4",
        "mpeg" => "video/mpeg",
        "webm" => "video/webm",
        "mp3" => "audio/mp3",
        "mpga" => "audio/mpeg",
        "weba" => "audio/webm",
        "wav" => "audio/wave",
        "otf" => "font/otf",
        "ttf" => "font/ttf",
        "woff" => "font/woff",
        "woff2" => "font/woff2",
        "7z" => "application/x-7z-compressed",
        "atom" => "application/atom+xml",
        "pdf" => "application/pdf",
        "json" => "application/json",
        "rss" => "application/rss+xml",
        "tar" => "application/x-tar",
        "xht" | "xhtml" => "application/xhtml+xml",
        "xslt" => "application/xslt+xml",
        "xml" => "application/xml",
        "gz" => "application/gzip",
        "zip" => "application/zip",
        "wasm" => "application/wasm",
        _ => "application/octet-stream",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Bytes;
    use axum::routing::get;
    use axum::Router;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    static FAKE: &[Asset] = &[
        Asset { name: "index.html", data: b"<index>", etag: "\"e-index\"", mime: "text/html; charset=utf-8" },
        Asset { name: "sw.js", data: b"<sw>", etag: "\"e-sw\"", mime: "application/javascript" },
        Asset { name: "_app/immutable/bundle.x.js", data: b"<js>", etag: "\"e-js\"", mime: "application/javascript" },
    ];

    fn app(prefix: &str, source: Source) -> Router {
        let ui = Arc::new(Ui { prefix: prefix.into(), source });
        Router::new().route("/health", get(|| async { "ok" })).layer(axum::middleware::from_fn_with_state(ui, serve))
    }

    async fn get_with(app: Router, uri: &str, headers: &[(&str, &str)]) -> (StatusCode, HeaderMap, Bytes) {
        let mut req = axum::http::Request::builder().uri(uri);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let res = app.oneshot(req.body(Body::empty()).unwrap()).await.unwrap();
        let (status, headers) = (res.status(), res.headers().clone());
        (status, headers, res.into_body().collect().await.unwrap().to_bytes())
    }

    const GZIP: (&str, &str) = ("accept-encoding", "gzip, deflate");

    #[tokio::test]
    async fn index_is_revalidated_and_isolated() {
        for uri in ["/", "/index.html"] {
            let (s, h, body) = get_with(app("", Source::Embedded(FAKE)), uri, &[GZIP]).await;
            assert_eq!(s, StatusCode::OK);
            assert_eq!(&body[..], b"<index>");
            assert_eq!(h[CONTENT_ENCODING], "gzip");
            assert_eq!(h[ETAG], "\"e-index\"");
            assert_eq!(h[CACHE_CONTROL], "no-cache");
            assert_eq!(h["cross-origin-embedder-policy"], "require-corp");
            assert_eq!(h["cross-origin-opener-policy"], "same-origin");
            assert_eq!(h[CONTENT_TYPE], "text/html; charset=utf-8");
        }
        for inm in ["\"e-index\"", "W/\"e-index\""] {
            let (s, h, body) = get_with(app("", Source::Embedded(FAKE)), "/", &[GZIP, ("if-none-match", inm)]).await;
            assert_eq!(s, StatusCode::NOT_MODIFIED, "{inm}");
            assert_eq!(h[ETAG], "\"e-index\"");
            assert!(body.is_empty());
        }
    }

    #[tokio::test]
    async fn assets_are_immutable_and_pwa_files_are_not() {
        let (s, h, _) = get_with(app("", Source::Embedded(FAKE)), "/_app/immutable/bundle.x.js", &[GZIP]).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h[CACHE_CONTROL], CACHE_IMMUTABLE);
        assert_eq!(h[ETAG], "\"e-js\"");
        assert!(h.get("cross-origin-opener-policy").is_none());
        let (s, h, body) = get_with(app("", Source::Embedded(FAKE)), "/sw.js", &[GZIP]).await;
        assert_eq!((s, &body[..]), (StatusCode::OK, &b"<sw>"[..]));
        assert_eq!(h[CACHE_CONTROL], "no-cache");
        assert!(h.get(ETAG).is_none());
    }

    #[tokio::test]
    async fn gzip_is_required() {
        let (s, h, body) = get_with(app("", Source::Embedded(FAKE)), "/", &[("accept-encoding", "br")]).await;
        assert_eq!(s, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(h[CONTENT_TYPE], "text/plain");
        assert!(h.get(CONTENT_ENCODING).is_none());
        assert_eq!(&body[..], b"Error: gzip is not supported by this browser");
    }

    #[tokio::test]
    async fn api_prefix_moves_the_ui_and_other_paths_reach_the_routes() {
        let (s, _, body) = get_with(app("/api", Source::Embedded(FAKE)), "/api/", &[GZIP]).await;
        assert_eq!((s, &body[..]), (StatusCode::OK, &b"<index>"[..]));
        for uri in ["/", "/apiindex.html", "/nope.js"] {
            let (s, _, _) = get_with(app("/api", Source::Embedded(FAKE)), uri, &[GZIP]).await;
            assert_eq!(s, StatusCode::NOT_FOUND, "{uri}");
        }
        let (s, _, body) = get_with(app("", Source::Embedded(FAKE)), "/health", &[]).await;
        assert_eq!((s, &body[..]), (StatusCode::OK, &b"ok"[..]));
    }

    #[tokio::test]
    async fn without_the_built_in_ui_sw_js_unregisters_itself() {
        let empty = std::env::temp_dir().join(format!("strata-ui-empty-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        for source in [Source::Off, Source::Embedded(&[]), Source::Dir(empty.clone())] {
            let (s, _, _) = get_with(app("", source.clone()), "/", &[GZIP]).await;
            let (sw, h, body) = get_with(app("", source.clone()), "/sw.js", &[GZIP]).await;
            if matches!(source, Source::Embedded(_)) {
                assert_eq!((s, sw), (StatusCode::NOT_FOUND, StatusCode::NOT_FOUND), "no assets, no routes");
                continue;
            }
            assert_ne!(s, StatusCode::OK);
            assert_eq!(sw, StatusCode::OK);
            assert_eq!(h[CACHE_CONTROL], "no-cache");
            assert_eq!(h[CONTENT_TYPE], "application/javascript");
            assert!(std::str::from_utf8(&body).unwrap().contains("registration.unregister()"));
        }
        std::fs::remove_dir(&empty).unwrap();
    }

    #[tokio::test]
    async fn path_serves_a_directory() {
        let dir = std::env::temp_dir().join(format!("strata-ui-test-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("index.html"), "<h1>mine</h1>").unwrap();
        std::fs::write(dir.join("sub/a b.js"), "let x;").unwrap();
        std::fs::write(dir.join("sw.js"), "// own worker").unwrap();
        let app = || app("/api", Source::Dir(dir.clone()));

        let (s, h, body) = get_with(app(), "/api/", &[]).await;
        assert_eq!((s, &body[..]), (StatusCode::OK, &b"<h1>mine</h1>"[..]));
        assert_eq!(h[CONTENT_TYPE], "text/html");
        let etag = h[ETAG].to_str().unwrap().to_string();
        assert!(etag.starts_with("W/\""), "{etag}");
        let inm = format!("\"x\", {etag}");
        let (s, _, body) = get_with(app(), "/api/", &[("if-none-match", inm.as_str())]).await;
        assert_eq!((s, body.len()), (StatusCode::NOT_MODIFIED, 0));
        let lm = h[LAST_MODIFIED].to_str().unwrap().to_string();
        let (s, _, _) = get_with(app(), "/api/index.html", &[("if-modified-since", lm.as_str())]).await;
        assert_eq!(s, StatusCode::NOT_MODIFIED);

        let (s, h, body) = get_with(app(), "/api/sub/a%20b.js", &[]).await;
        assert_eq!((s, &body[..]), (StatusCode::OK, &b"let x;"[..]));
        assert_eq!(h[CONTENT_TYPE], "text/javascript");
        let (s, h, _) = get_with(app(), "/api/sub", &[]).await;
        assert_eq!((s, h[LOCATION].to_str().unwrap()), (StatusCode::MOVED_PERMANENTLY, "/sub/"));
        let (_, _, body) = get_with(app(), "/api/sw.js", &[]).await;
        assert_eq!(&body[..], b"// own worker", "the directory's own sw.js comes first");
        for uri in ["/api/../etc/passwd", "/api/%2e%2e/x", "/api/missing.js", "/index.html"] {
            let (s, _, _) = get_with(app(), uri, &[]).await;
            assert_eq!(s, StatusCode::NOT_FOUND, "{uri}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn valid_paths() {
        for p in ["/", "/a/b.js", "/a/../b", "/./a", "//a"] {
            assert!(is_valid_path(p.as_bytes()), "{p}");
        }
        for p in ["/..", "/a/../../b", "/a\\b", "/a\0b"] {
            assert!(!is_valid_path(p.as_bytes()), "{p}");
        }
    }
}
