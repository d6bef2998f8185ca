use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const SERVER: &str = env!("CARGO_BIN_EXE_strata-server");
const STARTUP: Duration = Duration::from_secs(120);

/// Keeps llama.cpp's load chatter out of the test output; errors still show.
pub fn quiet_llama_logs() {
    strata_ffi::set_log_callback(|level, msg| {
        if level == strata_ffi::LogLevel::Error {
            eprint!("{msg}");
        }
    });
}

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

pub fn golden(name: &str) -> String {
    let p = repo().join("tests/golden").join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A model from the set-up cache; its absence is a failure, not a skip.
pub fn model(name: &str) -> PathBuf {
    let dir = std::env::var_os("STRATA_MODELS").map(PathBuf::from).unwrap_or_else(|| repo().join(".cache/models"));
    let p = dir.join(name);
    assert!(p.is_file(), "{} is missing: run tools/setup (it fetches and generates the test models)", p.display());
    p
}

pub struct Output {
    pub stdout: String,
    pub stderr: String,
    pub status: i32,
}

pub fn run_server(args: &[&str], env: &[(&str, &str)]) -> Output {
    let out = Command::new(SERVER).args(args).envs(env.iter().copied()).output().expect("run strata-server");
    Output {
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        status: out.status.code().unwrap_or(-1),
    }
}

/// A strata-server on an ephemeral loopback port, killed on drop.
pub struct Server {
    child: Child,
    pub base: String,
    pub log: Arc<Mutex<String>>,
}

impl Server {
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(SERVER)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn strata-server");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(addr.trim().to_string());
                }
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let addr = rx.recv_timeout(STARTUP).unwrap_or_else(|_| panic!("server did not start:\n{}", log.lock().unwrap()));
        let server = Server { child, base: format!("http://{addr}"), log };
        server.wait_ready();
        server
    }

    fn wait_ready(&self) {
        let t0 = Instant::now();
        loop {
            match ureq::get(&format!("{}/health", self.base)).call() {
                Ok(r) if r.status() == 200 => return,
                Err(ureq::Error::Status(503, _)) => {}
                other => panic!("unexpected /health answer {other:?}\n{}", self.log.lock().unwrap()),
            }
            assert!(t0.elapsed() < STARTUP, "model did not load in time:\n{}", self.log.lock().unwrap());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// POSTs JSON; returns (status, body) for success and error statuses alike.
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let res = ureq::post(&format!("{}{path}", self.base)).send_json(body.clone());
        let r = match res {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("POST {path}: {e}"),
        };
        (r.status(), r.into_json().expect("JSON body"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// The server's resident memory, in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()).unwrap()
    }

    /// CPU time the server's threads have used, in clock ticks (utime + stime of /proc/PID/stat).
    pub fn cpu_ticks(&self) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        // the fields after the command name, which is in parentheses and may hold spaces
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<u64> = rest.split_whitespace().map(|x| x.parse().unwrap_or(0)).collect();
        f[11] + f[12]
    }

    pub fn get(&self, path: &str) -> (u16, Value) {
        let r = match ureq::get(&format!("{}{path}", self.base)).call() {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("GET {path}: {e}"),
        };
        (r.status(), r.into_json().expect("JSON body"))
    }

    /// POSTs a streaming request and returns the SSE `data:` payloads, read to the end.
    pub fn post_stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let res = ureq::post(&format!("{}{path}", self.base)).send_json(body.clone()).expect("stream request");
        assert_eq!(res.header("content-type"), Some("text/event-stream"));
        BufReader::new(res.into_reader())
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| l.strip_prefix("data: ").filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).expect("SSE JSON")))
            .collect()
    }
}
