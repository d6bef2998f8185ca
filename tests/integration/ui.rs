//! The web UI that tools/build-ui builds and strata-server embeds, served as llama-server does.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::process::{Command, Stdio};

use crate::support::{model, repo, Server};

const KEY: &str = "sk-ui-test";

struct Got {
    status: u16,
    headers: HashMap<String, String>,
    body: Vec<u8>,
}

impl Got {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// GET with the given headers; ureq (built without compression) leaves gzip bodies alone.
fn get(server: &Server, path: &str, headers: &[(&str, &str)]) -> Got {
    let mut req = ureq::get(&format!("{}{path}", server.base));
    for (k, v) in headers {
        req = req.set(k, v);
    }
    let res = match req.call() {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("GET {path}: {e}"),
    };
    let headers = res.headers_names().into_iter().map(|n| (n.to_ascii_lowercase(), res.header(&n).unwrap_or("").to_string())).collect();
    let status = res.status();
    let mut body = Vec::new();
    res.into_reader().read_to_end(&mut body).unwrap();
    Got { status, headers, body }
}

fn gunzip(data: &[u8]) -> String {
    let mut child = Command::new("gzip").arg("-dc").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("gzip");
    child.stdin.take().unwrap().write_all(data).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "not gzip data");
    String::from_utf8(out.stdout).unwrap()
}

/// name -> (etag, mime) from the manifest tools/setup builds.
fn manifest() -> HashMap<String, (String, String)> {
    let path = repo().join("target/ui/manifest.tsv");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}: run tools/setup (tools/build-ui)", path.display()));
    let assets: HashMap<_, _> = text
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            (f[0].to_string(), (f[1].to_string(), f[2].to_string()))
        })
        .collect();
    assert!(assets.contains_key("index.html"), "{} lists no UI: run tools/build-ui without STRATA_NO_UI", path.display());
    assets
}

fn tiny() -> String {
    model("tiny-llama.gguf").to_str().unwrap().to_string()
}

#[test]
fn built_in_ui_is_served_gzipped_and_cached_like_llama_server() {
    let assets = manifest();
    let server = Server::start(&["-m", &tiny(), "-c", "256", "--api-key", KEY], &[]);
    let gzip = ("Accept-Encoding", "gzip, deflate");

    let index = get(&server, "/", &[gzip]);
    assert_eq!(index.status, 200);
    assert_eq!(index.header("content-encoding"), Some("gzip"));
    assert_eq!(index.header("content-type"), Some("text/html; charset=utf-8"));
    assert_eq!(index.header("etag"), Some(assets["index.html"].0.as_str()));
    assert_eq!(index.header("cache-control"), Some("no-cache"));
    assert_eq!(index.header("cross-origin-embedder-policy"), Some("require-corp"));
    assert_eq!(index.header("cross-origin-opener-policy"), Some("same-origin"));
    assert!(gunzip(&index.body).to_ascii_lowercase().contains("<!doctype html>"));
    assert_eq!(get(&server, "/index.html", &[gzip]).body, index.body);

    let etag = index.header("etag").unwrap();
    let again = get(&server, "/", &[gzip, ("If-None-Match", etag)]);
    assert_eq!((again.status, again.body.len()), (304, 0));

    let plain = get(&server, "/", &[]);
    assert_eq!(plain.status, 415);
    assert_eq!(plain.body, b"Error: gzip is not supported by this browser");

    let (name, (etag, mime)) = assets.iter().find(|(n, _)| n.starts_with("_app/immutable/") && n.ends_with(".js")).expect("a hashed bundle");
    let asset = get(&server, &format!("/{name}"), &[gzip]);
    assert_eq!(asset.status, 200, "{name}");
    assert_eq!(asset.header("cache-control"), Some("public, max-age=31536000, immutable"));
    assert_eq!((asset.header("etag"), asset.header("content-type")), (Some(etag.as_str()), Some(mime.as_str())));

    let sw = get(&server, "/sw.js", &[gzip]);
    assert_eq!(sw.status, 200);
    assert_eq!(sw.header("cache-control"), Some("no-cache"));
    assert_eq!(sw.header("etag"), None);
    let version = get(&server, "/_app/version.json", &[gzip]);
    assert_eq!(version.header("content-type"), Some("application/json"), "asset types go out as built");

    for path in ["/", "/sw.js", "/manifest.webmanifest", "/_app/version.json", "/build.json"] {
        assert_eq!(get(&server, path, &[gzip]).status, 200, "{path} needs no API key");
    }
    assert_eq!(get(&server, "/models", &[gzip]).status, 401, "the API still does");
}

#[test]
fn no_ui_answers_404_and_retires_the_service_worker() {
    let server = Server::start(&["-m", &tiny(), "-c", "256", "--no-ui"], &[]);
    assert_eq!(get(&server, "/", &[("Accept-Encoding", "gzip")]).status, 404);
    let sw = get(&server, "/sw.js", &[("Accept-Encoding", "gzip")]);
    assert_eq!(sw.status, 200);
    assert_eq!((sw.header("cache-control"), sw.header("content-type")), (Some("no-cache"), Some("application/javascript")));
    assert_eq!(sw.header("content-encoding"), None);
    assert!(String::from_utf8_lossy(&sw.body).contains("registration.unregister()"));
    assert!(server.log.lock().unwrap().contains("The UI is disabled"));
}

#[test]
fn path_serves_a_directory_instead() {
    let dir = std::env::temp_dir().join(format!("strata-ui-path-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("index.html"), "<!doctype html><p>mine</p>").unwrap();
    std::fs::write(dir.join("app.js"), "console.log(1)").unwrap();
    let server = Server::start(&["-m", &tiny(), "-c", "256", "--path", dir.to_str().unwrap()], &[]);

    let index = get(&server, "/", &[]);
    assert_eq!((index.status, index.body.as_slice()), (200, &b"<!doctype html><p>mine</p>"[..]));
    assert_eq!(index.header("content-type"), Some("text/html"));
    assert_eq!(index.header("content-encoding"), None);
    let js = get(&server, "/app.js", &[]);
    assert_eq!((js.status, js.header("content-type")), (200, Some("text/javascript")));
    let again = get(&server, "/app.js", &[("If-None-Match", js.header("etag").unwrap())]);
    assert_eq!(again.status, 304);
    let sw = get(&server, "/sw.js", &[]);
    assert!(String::from_utf8_lossy(&sw.body).contains("registration.unregister()"), "the built-in UI's worker is retired");
    assert_eq!(get(&server, "/missing.js", &[]).status, 404);
    std::fs::remove_dir_all(&dir).unwrap();
}
