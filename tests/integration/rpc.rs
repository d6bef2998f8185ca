//! --rpc: strata-server offloads layers to two of the pin's rpc-server processes on loopback
//! (built by tools/build-upstream) and generates what it generates on the CPU alone.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::{model, repo, Server};

struct RpcServer {
    child: Child,
    endpoint: String,
    log: PathBuf,
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

fn rpc_server_bin() -> PathBuf {
    let bin = std::env::var_os("STRATA_RPC_SERVER").map(PathBuf::from).unwrap_or_else(|| repo().join("target/upstream/bin/ggml-rpc-server"));
    assert!(bin.exists(), "{} is missing: run tools/build-upstream (tools/test does)", bin.display());
    bin
}

fn start_rpc_server() -> RpcServer {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let log = std::env::temp_dir().join(format!("strata-rpc-server-{port}.log"));
    // line-buffered, so that its connection lines reach the file while it runs
    let child = Command::new("stdbuf")
        .arg("-oL")
        .arg(rpc_server_bin())
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn rpc-server");
    let endpoint = format!("127.0.0.1:{port}");
    let t0 = Instant::now();
    while std::net::TcpStream::connect(&endpoint).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(30), "rpc-server did not listen on {endpoint}");
        std::thread::sleep(Duration::from_millis(50));
    }
    RpcServer { child, endpoint, log }
}

#[test]
fn two_rpc_servers_give_the_cpu_tokens() {
    let m = model("tiny-llama.gguf");
    let req = json!({"prompt": "Once upon a time", "n_predict": 12, "temperature": 0, "return_tokens": true});
    let cpu = Server::start(&["-m", m.to_str().unwrap(), "-np", "1"], &[]);
    let (_, want) = cpu.post("/completion", &req);
    drop(cpu);

    let (a, b) = (start_rpc_server(), start_rpc_server());
    let servers = format!("{},{}", a.endpoint, b.endpoint);
    let remote = Server::start(&["-m", m.to_str().unwrap(), "-np", "1", "--rpc", &servers, "-ngl", "99"], &[]);
    let (status, got) = remote.post("/completion", &req);
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["tokens"], want["tokens"]);
    for s in [&a, &b] {
        let log = std::fs::read_to_string(&s.log).unwrap_or_default();
        assert!(log.contains("Accepted client connection"), "rpc-server {} served strata-server:\n{log}", s.endpoint);
    }
}
